"""`hybridkv bench --peer llama.cpp --model FILE.gguf`: hybridkv and llama.cpp on the same GGUF
file, in one run.

llama.cpp runs through llama-cpp-python's low-level API (`pip install 'hybridkv[peers]'`: a source
build): one context holding 8 sequences (`n_seq_max`), its memory kept between a chat's turns and
never saved or restored, which is what its own server does with a slot per conversation. Both
engines get the same threads (`--threads`; llama.cpp's n_threads = n_threads_batch) and the same
token ids; repetitions alternate between the engines and medians count.

    prefill_512      a fresh 512-token prompt to its last-token logits
    decode_b1, _b8   per step after 512-token prompts in 1 / 8 sequences (ms/token; tok/s)
    chat_turn8_ttft  the 8th turn's new tokens onto 7 turns of history held in the cache
    regenerate_ttft  the last answer dropped, the prompt ready to sample again: hybridkv forks at
                     the snapshot of the message boundary; llama.cpp cannot roll a recurrent state
                     back without saved state, so it computes the prompt again
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridkv.bench import GGUF_TYPES
from hybridkv.bench.machine import WeightCounts, read_bytes_per_second
from hybridkv.bench.report import _num
from hybridkv.bench.scenarios import Result, _median, _timed
from hybridkv.bench.workload import Chat, Plan, random_ids
from hybridkv.cached_model import CachedModel
from hybridkv.engine.threads import IdleCores
from hybridkv.errors import NotSupported

SEQUENCES = 8
ROOFLINE_TARGET = 1.3  # decode_b1 within this multiple of the bandwidth floor
TARGETS = {"prefill_512": 1.0, "decode_b1": 1.0, "decode_b8": 1.5, "chat_turn8_ttft": 3.0, "regenerate_ttft": 3.0}


class LlamaCpp:
    """llama.cpp's model and one context of `SEQUENCES` sequences over a GGUF file."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        try:
            import llama_cpp
            from llama_cpp import _internals
            from llama_cpp._logger import set_verbose
        except ImportError:
            raise NotSupported(
                "bench --peer llama.cpp needs llama-cpp-python: pip install 'hybridkv[peers]' (it builds llama.cpp)"
            ) from None
        self.version = str(getattr(llama_cpp, "__version__", "?"))
        _refuse_amx(llama_cpp.llama_print_system_info().decode(errors="replace"))
        set_verbose(False)  # llama.cpp's log (every graph input of every context) only on errors
        model_params = llama_cpp.llama_model_default_params()
        self.model = _internals.LlamaModel(path_model=str(path), params=model_params, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, 512, 512
        params.n_seq_max, params.kv_unified = SEQUENCES, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = _internals.LlamaContext(model=self.model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=SEQUENCES, verbose=False)
        self.positions = [0] * SEQUENCES

    def clear(self, seq: int) -> None:
        """Drop everything sequence `seq` holds."""
        self.ctx.kv_cache_seq_rm(seq, -1, -1)
        self.positions[seq] = 0

    def feed(self, tokens: Mapping[int, Sequence[int]]) -> None:
        """Each sequence's tokens after what it holds, 512 tokens a decode call, the last token of
        each sequence asking for logits (what sampling needs)."""
        pending = [(seq, pos, tok) for seq, ids in tokens.items() for pos, tok in enumerate(ids)]
        last = {seq: len(ids) - 1 for seq, ids in tokens.items()}
        b = self.batch.batch
        for start in range(0, len(pending), 512):
            chunk = pending[start : start + 512]
            b.n_tokens = len(chunk)
            for i, (seq, pos, tok) in enumerate(chunk):
                b.token[i], b.pos[i] = tok, self.positions[seq] + pos
                b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = 1, seq, pos == last[seq]
            self.ctx.decode(self.batch)
        for seq, ids in tokens.items():
            self.positions[seq] += len(ids)


# A build of llama-cpp-python without llama.cpp's AMX kernels, its other kernels as -march=native
# picks them on an AVX-512 CPU with AMX (Sapphire Rapids and later).
NO_AMX_BUILD = (
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' "
    "pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python"
)


def _refuse_amx(system_info: str) -> None:
    """llama.cpp built with its AMX kernels (`AMX_INT8 = 1` in its system info) puts the weights in
    its AMX buffers, and on these hybrid models its first product of more than one row segfaults
    in `ggml_backend_amx_mul_mat` (seen here on a Xeon with AMX for every prompt of 32 and 512
    tokens; ggml-org/llama.cpp#20824, ollama/ollama#17236), which would take the bench down with
    it: refuse, naming the build that runs."""
    if "AMX_INT8 = 1" in system_info:
        raise NotSupported(
            "bench --peer llama.cpp: this llama-cpp-python was built with llama.cpp's AMX kernels, which "
            "segfault on qwen35/qwen3next prompts (ggml-org/llama.cpp#20824); rebuild it without them: " + NO_AMX_BUILD
        )


def _alternate(plan: Plan, ours: Callable[[], float], theirs: Callable[[], float]) -> tuple[float, float]:
    for _ in range(plan.warmup):
        ours(), theirs()
    times = [(ours(), theirs()) for _ in range(plan.reps)]
    return _median([t[0] for t in times]), _median([t[1] for t in times])


class OurThreads:
    """hybridkv's thread count before each of its timed calls: fixed (None), or as its engine sets it
    when no --threads is given (`IdleCores`: the cores other processes leave idle, looked at every
    half second), with the counts used kept for the report."""

    def __init__(self, cores: IdleCores | None) -> None:
        self.cores = cores
        self.used: set[int] = set()

    def __call__(self) -> None:
        if self.cores is not None:
            self.used.add(self.cores.update())


def prefill(cm: CachedModel, peer: LlamaCpp, plan: Plan, n: int, threads: OurThreads) -> Result:
    ids = random_ids(n, cm.vocab_size, seed=n)

    def ours() -> float:
        seq = cm.new_sequence()
        threads()
        try:
            return _timed(lambda: cm.feed({seq: ids}, logits="last"))
        finally:
            cm.release(seq)

    def theirs() -> float:
        peer.clear(0)
        return _timed(lambda: peer.feed({0: ids}))

    t_ours, t_theirs = _alternate(plan, ours, theirs)
    return Result(f"prefill_{n}", n / t_ours, n / t_theirs, "tok/s", TARGETS.get(f"prefill_{n}"))


def decode(cm: CachedModel, peer: LlamaCpp, plan: Plan, batch: int, threads: OurThreads) -> Result:
    name = f"decode_b{batch}"
    prompts = [random_ids(plan.decode_prompt, cm.vocab_size, seed=1000 + i) for i in range(batch)]
    steps = plan.warmup + plan.decode_steps
    next_ids = [random_ids(steps, cm.vocab_size, seed=2000 + i) for i in range(batch)]
    seqs = [cm.new_sequence() for _ in range(batch)]
    try:
        cm.feed({s: prompts[i] for i, s in enumerate(seqs)}, logits="last")
        for i in range(batch):
            peer.clear(i)
        peer.feed({i: prompts[i] for i in range(batch)})
        ours, theirs = [], []
        for step in range(steps):
            ours_feed = {s: [next_ids[i][step]] for i, s in enumerate(seqs)}
            theirs_feed = {i: [next_ids[i][step]] for i in range(batch)}
            threads()
            t_ours = _timed(functools.partial(cm.feed, ours_feed, logits="last"))
            t_theirs = _timed(functools.partial(peer.feed, theirs_feed))
            if step >= plan.warmup:
                ours.append(t_ours)
                theirs.append(t_theirs)
    finally:
        for s in seqs:
            cm.release(s)
    t_ours, t_theirs = _median(ours), _median(theirs)
    notes = {"prompt_tokens": plan.decode_prompt}
    if batch == 1:
        return Result(name, 1e3 * t_ours, 1e3 * t_theirs, "ms/token", TARGETS.get(name), notes=notes)
    return Result(name, batch / t_ours, batch / t_theirs, "tok/s", TARGETS.get(name), notes=notes)


def chat(cm: CachedModel, peer: LlamaCpp, plan: Plan, threads: OurThreads) -> list[Result]:
    layout = plan.chat
    conv = Chat.build(layout, cm.vocab_size)
    tokens = conv.tokens
    last = layout.turns - 1
    turn_start, prompt_end = conv.turn_starts[last], conv.reply_starts[last]
    message_end = turn_start + layout.user
    seq = cm.new_sequence()
    try:
        for t in range(last):  # hybridkv's history, with the snapshots its chat would take
            start = 0 if t == 0 else conv.turn_starts[t]
            cm.feed(
                {seq: tokens[start : conv.turn_starts[t + 1]]},
                snapshot_at={seq: conv.boundaries_in(start, conv.turn_starts[t + 1])},
            )

        def ours_turn() -> float:
            threads()
            elapsed = _timed(
                lambda: cm.feed(
                    {seq: tokens[turn_start:prompt_end]},
                    logits="last",
                    snapshot_at={seq: conv.boundaries_in(turn_start, prompt_end)},
                )
            )
            if cm.truncate(seq, turn_start) != turn_start:
                raise RuntimeError("the message-boundary snapshot before the last turn is missing")
            return elapsed

        def theirs_turn() -> float:
            peer.clear(0)  # untimed: the history again, as its server holds it in the slot
            peer.feed({0: tokens[:turn_start]})
            return _timed(lambda: peer.feed({0: tokens[turn_start:prompt_end]}))

        turn = _alternate(plan, ours_turn, theirs_turn)
        cm.feed({seq: tokens[turn_start : len(tokens)]}, snapshot_at={seq: conv.boundaries_in(turn_start, len(tokens))})
        header = tokens[message_end:prompt_end]
        computed: list[int] = []

        def ours_regenerate() -> float:
            before = cm.stats()["tokens_computed"]
            threads()
            start = time.perf_counter()
            child = cm.fork(seq, message_end)
            cm.feed({child: header}, logits="last")
            elapsed = time.perf_counter() - start
            cm.release(child)
            computed.append(cm.stats()["tokens_computed"] - before)
            return elapsed

        def theirs_regenerate() -> float:
            peer.clear(0)
            return _timed(lambda: peer.feed({0: tokens[:prompt_end]}))

        regen = _alternate(plan, ours_regenerate, theirs_regenerate)
    finally:
        cm.release(seq)
    notes = {"prompt_tokens": prompt_end, "history_tokens": turn_start}
    return [
        Result("chat_turn8_ttft", 1e3 * turn[0], 1e3 * turn[1], "ms", TARGETS["chat_turn8_ttft"], notes=notes),
        Result(
            "regenerate_ttft",
            1e3 * regen[0],
            1e3 * regen[1],
            "ms",
            TARGETS["regenerate_ttft"],
            notes={**notes, "hybridkv_tokens_computed": computed[-1], "llama_cpp_tokens_computed": prompt_end},
        ),
    ]


def roofline(result: Result, read_bytes: float, probes: list[float]) -> dict[str, Any]:
    """decode_b1 against the bandwidth roofline: the bytes a step reads over the faster of the two
    read probes around the scenario (the machine's limit; the slower one measures a neighbour),
    and each engine's ms/token as a multiple of that floor (the issue's target: within 1.3×)."""
    floor_ms = 1e3 * read_bytes / max(probes)
    return {
        "read_bytes_per_token": read_bytes,
        "read_gb_s_probes": [p / 1e9 for p in probes],
        "roofline_ms": floor_ms,
        "hybridkv_of_roofline": result.hybridkv / floor_ms,
        "llama_cpp_of_roofline": result.transformers / floor_ms,
        "roofline_target": ROOFLINE_TARGET,
    }


def run(
    path: Path,
    threads: int,
    plan: Plan,
    log: Callable[[str], None] = print,
    kv_dtype: torch.dtype | None = None,
    adapt_threads: bool = False,
) -> dict[str, Any]:
    """Every scenario on the GGUF file at `path`; the JSON document (`print_llama_cpp` prints it).
    `kv_dtype`: hybridkv's K/V cache type (None: float32; llama.cpp's own is float16).
    `adapt_threads`: hybridkv on the cores other processes leave idle, up to `threads`, as its
    engine runs when no --threads is given (`IdleCores`); llama.cpp always on `threads`."""
    from hybridkv.cache.config import CacheConfig

    torch.set_num_threads(threads)
    ours = OurThreads(IdleCores(threads) if adapt_threads else None)  # its first look before the load
    started = time.perf_counter()
    n_ctx = max(plan.prefill_lens[0], plan.decode_prompt + plan.warmup + plan.decode_steps, 2048) + 64
    log(f"loading {path} in both engines ({threads} threads)")
    cm = CachedModel.load(
        path, cache=CacheConfig(max_model_len=n_ctx, max_sequences=2 * SEQUENCES + 2, kv_dtype=kv_dtype)
    )
    peer = LlamaCpp(path, threads, SEQUENCES * n_ctx)
    results = []
    log("prefill_512")
    results.append(prefill(cm, peer, plan, plan.prefill_lens[0], ours))
    for batch in (1, SEQUENCES):
        log(f"decode_b{batch}")
        # decode_b1 is bound by the read bandwidth: a probe on either side of it
        before = read_bytes_per_second(3) if batch == 1 else None
        results.append(decode(cm, peer, plan, batch, ours))
        if before is not None:
            probes = [before, read_bytes_per_second(3)]
            results[-1].notes.update(roofline(results[-1], WeightCounts.of(cm.model).decode_bytes(1), probes))
    log("chat_turn8_ttft, regenerate_ttft")
    results.extend(chat(cm, peer, plan, ours))
    scenarios = {
        r.name: {"hybridkv": r.hybridkv, "llama.cpp": r.transformers, "unit": r.unit, "ratio": r.ratio,
                 "target_ratio": r.target, **r.notes}
        for r in results
    }  # fmt: skip
    run_info = {
        "file": str(path),
        "threads": threads,
        # hybridkv's: fixed at `threads`, or what its engine's IdleCores chose (the counts used)
        "hybridkv_threads": sorted(ours.used) if adapt_threads else "fixed",
        "kv_dtype": str(cm.cache.spec.kv_dtype).removeprefix("torch."),  # llama.cpp's: its default, float16
        "llama_cpp_python": peer.version,
        "seconds": time.perf_counter() - started,
        "plan": {k: getattr(plan, k) for k in ("reps", "warmup", "decode_steps")},
        "decode_fetch_ahead": fetch_ahead(),  # as `ops.quant.stream.tune` chose it at load
    }
    return {"scenarios": scenarios, "run": run_info}


def fetch_ahead() -> bool | None:
    """Whether decode's products fetch their weights ahead here (None: no C++ kernels). The switch
    covers the 32-weight types' products too, so it holds with or without the tiled ones."""
    from hybridkv.ops import native
    from hybridkv.ops.quant.k_dot import native_stream_ahead

    return native_stream_ahead() if native.enabled() else None


def print_llama_cpp(document: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    run = document["run"]
    table = Table(
        title=f"hybridkv vs llama.cpp (llama-cpp-python {run['llama_cpp_python']}): {Path(run['file']).name}, "
        f"{run['threads']} threads, one run",
        title_justify="left",
    )
    for column in ("scenario", "hybridkv", "llama.cpp", "unit", "ratio", "target"):
        table.add_column(column, justify="left" if column in ("scenario", "unit") else "right")
    for name, s in document["scenarios"].items():
        met = s["target_ratio"] is None or s["ratio"] >= s["target_ratio"]
        color = "" if s["target_ratio"] is None else "[green]" if met else "[red]"
        target = "" if s["target_ratio"] is None else f"{color}≥ {s['target_ratio']:.1f}×"
        table.add_row(name, _num(s["hybridkv"]), _num(s["llama.cpp"]), s["unit"], f"{color}{s['ratio']:.2f}×", target)
    console.print(table)
    if (used := run.get("hybridkv_threads", "fixed")) != "fixed":
        console.print(
            f"hybridkv on the cores other processes left idle, as its engine without --threads: "
            f"{' or '.join(map(str, used))} thread(s) used; llama.cpp on {run['threads']}",
            highlight=False,
        )
    console.print(
        "ratio > 1: hybridkv better; regenerate: llama.cpp computes the whole prompt again "
        f"({document['scenarios']['regenerate_ttft']['llama_cpp_tokens_computed']} tokens), hybridkv "
        f"{document['scenarios']['regenerate_ttft']['hybridkv_tokens_computed']}",
        highlight=False,
    )
    d = document["scenarios"]["decode_b1"]
    if "roofline_ms" in d:
        met = d["hybridkv_of_roofline"] <= d["roofline_target"]
        probes = " and ".join(f"{p:.1f}" for p in d["read_gb_s_probes"])
        console.print(
            f"decode_b1 against the bandwidth roofline: {d['read_bytes_per_token'] / 2**20:.0f} MiB a step, read at "
            f"{probes} GB/s before and after (the faster counts) = {d['roofline_ms']:.1f} ms at best; hybridkv "
            f"{'[green]' if met else '[red]'}{d['hybridkv_of_roofline']:.2f}×[/] of it (target ≤ "
            f"{d['roofline_target']:.1f}×), llama.cpp {d['llama_cpp_of_roofline']:.2f}×"
            + {
                True: "; weights fetched ahead (chosen at load)",
                False: "; weights not fetched ahead (chosen at load)",
            }.get(run.get("decode_fetch_ahead"), ""),
            highlight=False,
        )


def shape_file(checkpoint: Path, file_type: str, log: Callable[[str], None] = print) -> Path:
    """The bench shape's checkpoint as a GGUF file beside it, written the first time: Q8_0 by
    `hybridkv quantize`; the K-quant mixtures (Q4_K_M, Q3_K_M, Q2_K) by llama.cpp's own quantizer
    (`llama_model_quantize`) from our BF16 file, so the K-quant file is llama.cpp's as a user would
    make it."""
    path = checkpoint.with_name(f"{checkpoint.name}-{file_type}.gguf")
    if path.is_file():
        log(f"using {path}")
        return path
    from hybridkv.bench.workload import write_bench_tokenizer
    from hybridkv.models.config import ModelConfig
    from hybridkv.models.gguf_writer import write_quantized

    if not (checkpoint / "tokenizer.json").is_file():  # a shape has none; a GGUF file needs one
        write_bench_tokenizer(checkpoint, ModelConfig.from_dir(checkpoint).vocab_size)
    ftype = GGUF_TYPES[file_type]
    if ftype is None:
        log(f"writing {path} (hybridkv quantize --type {file_type})")
        write_quantized(checkpoint, path, file_type)
        return path
    try:
        import llama_cpp
    except ImportError:
        raise NotSupported(
            f"a {file_type} file comes from llama.cpp's quantizer: pip install 'hybridkv[peers]'"
        ) from None
    bf16 = checkpoint.with_name(f"{checkpoint.name}-bf16.gguf")
    partial = path.with_name(path.name + ".partial")
    try:
        log(f"writing {bf16} (hybridkv quantize --type bf16), then {path} (llama_model_quantize, {file_type})")
        write_quantized(checkpoint, bf16, "bf16")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(partial).encode(), params) != 0:
            raise NotSupported(f"llama_model_quantize failed on {bf16}")
        partial.rename(path)
    finally:
        bf16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return path
