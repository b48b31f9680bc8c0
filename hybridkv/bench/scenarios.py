"""The scenarios, each run through hybridkv (`CachedModel`) and transformers on the same weights.

transformers runs as a user would run it: `AutoModelForCausalLM` with its own cache, prompts with
`logits_to_keep=1` (what `generate()` does), decode steps feeding its cache back. Where both
engines are timed in one scenario their repetitions alternate, so the drift of a shared machine
hits both alike; every figure is a median.
"""

from __future__ import annotations

import copy
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.bench.machine import Limits, WeightCounts
from hybridkv.bench.workload import Chat, Plan, random_ids
from hybridkv.cached_model import CachedModel, LogitsMode

RATE_UNITS = ("tok/s",)  # higher is better; every other unit is a time, lower is better


def _peer_cache_arg(peer: Any) -> str:
    # transformers 5.24 renamed the forward's `past_key_values` (and its output field) to `cache`.
    return "cache" if "cache" in inspect.signature(peer.forward).parameters else "past_key_values"


@dataclass(slots=True)
class Result:
    """One scenario: both engines' figures in `unit`, and hybridkv's floor from the machine's limits."""

    name: str
    hybridkv: float
    transformers: float
    unit: str
    target: float | None = None  # the ratio the issue asks for
    limit: float | None = None  # the best figure the machine allows, in `unit`
    notes: dict[str, Any] = field(default_factory=dict)
    baseline: str = "transformers"  # what the `transformers` figure measures

    @property
    def better(self) -> str:
        return "higher" if self.unit in RATE_UNITS else "lower"

    @property
    def ratio(self) -> float:
        """> 1 means hybridkv is better, whatever the unit."""
        if self.unit in RATE_UNITS:
            return self.hybridkv / self.transformers
        return self.transformers / self.hybridkv

    @property
    def limit_fraction(self) -> float | None:
        """How close hybridkv comes to the machine's limit (1.0 = at the limit)."""
        if self.limit is None:
            return None
        return self.hybridkv / self.limit if self.unit in RATE_UNITS else self.limit / self.hybridkv


@dataclass(slots=True)
class Bench:
    cm: CachedModel
    peer: Any  # transformers' model of the checkpoint (AutoModelForCausalLM)
    plan: Plan
    limits: Limits
    weights: WeightCounts
    log: Callable[[str], None] = print
    cache_arg: str = field(init=False)  # the forward's name for its cache: "cache" or "past_key_values"

    def __post_init__(self) -> None:
        self.cache_arg = _peer_cache_arg(self.peer)

    @property
    def vocab(self) -> int:
        return self.cm.vocab_size

    def peer_forward(self, ids: list[list[int]], cache: Any = None) -> Any:
        """One transformers forward over a [B, T] batch of ids, last-token logits; returns its output."""
        with torch.no_grad():
            return self.peer(torch.tensor(ids), **{self.cache_arg: cache}, use_cache=True, logits_to_keep=1)

    def peer_cache(self, ids: list[list[int]]) -> Any:
        """transformers' cache after a forward over `ids`."""
        out = self.peer_forward(ids)
        return out.cache if self.cache_arg == "cache" else out.past_key_values

    def alternate(self, ours: Callable[[], float], theirs: Callable[[], float]) -> tuple[float, float]:
        """Median seconds of each (each call returns the seconds it timed), repetitions alternating."""
        for _ in range(self.plan.warmup):
            ours(), theirs()
        times = [(ours(), theirs()) for _ in range(self.plan.reps)]
        return _median([t[0] for t in times]), _median([t[1] for t in times])


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- prefill ----------------------------------------------------------------------------------


def prefill(b: Bench, name: str, n: int, target: float | None) -> Result:
    ids = random_ids(n, b.vocab, seed=n)

    def ours() -> float:
        seq = b.cm.new_sequence()
        try:
            return _timed(lambda: b.cm.feed({seq: ids}, logits="last"))
        finally:
            b.cm.release(seq)

    t_ours, t_theirs = b.alternate(ours, lambda: _timed(lambda: b.peer_forward([ids])))
    floor = b.limits.floor_seconds(b.weights.total_bytes, b.weights.prefill_flops(n))
    notes: dict[str, Any] = {"prompt_tokens": n}
    if n == b.plan.prefill_lens[0]:
        notes["max_rel_err"] = _parity(b, ids)
    return Result(name, n / t_ours, n / t_theirs, "tok/s", target, n / floor, notes)


def _parity(b: Bench, ids: list[int]) -> float:
    """Max |Δ| / max |logit| between the engines' last-token logits: proof they run the same weights."""
    seq = b.cm.new_sequence()
    try:
        ours = b.cm.feed({seq: ids}, logits="last")[seq][-1]
    finally:
        b.cm.release(seq)
    theirs = b.peer_forward([ids]).logits[0, -1].float()
    return float((ours - theirs).abs().max() / theirs.abs().max())


# -- decode -----------------------------------------------------------------------------------


def decode(b: Bench, batch: int, peer_batch: int, name: str, target: float | None) -> Result:
    """Per-step time of `batch` (hybridkv) and `peer_batch` (transformers) sequences decoding after
    `decode_prompt`-token prompts; steps alternate between the engines."""
    p = b.plan
    prompts = [random_ids(p.decode_prompt, b.vocab, seed=1000 + i) for i in range(max(batch, peer_batch))]
    steps = p.warmup + p.decode_steps
    next_ids = [random_ids(steps, b.vocab, seed=2000 + i) for i in range(max(batch, peer_batch))]
    b.log(f"  {name}: prefilling {batch} + {peer_batch} prompts of {p.decode_prompt} tokens")

    seqs = [b.cm.new_sequence() for _ in range(batch)]
    try:
        b.cm.feed({s: prompts[i] for i, s in enumerate(seqs)}, logits="last")
        cache = b.peer_cache(prompts[:peer_batch])
        ours, theirs = [], []
        for step in range(steps):
            feed = {s: [next_ids[i][step]] for i, s in enumerate(seqs)}
            t_ours = _timed(functools.partial(b.cm.feed, feed, logits="last"))
            column = [[next_ids[i][step]] for i in range(peer_batch)]
            t_theirs = _timed(functools.partial(b.peer_forward, column, cache))
            if step >= p.warmup:
                ours.append(t_ours)
                theirs.append(t_theirs)
    finally:
        for s in seqs:
            b.cm.release(s)
    t_ours, t_theirs = _median(ours), _median(theirs)
    floor = b.limits.floor_seconds(b.weights.decode_bytes(batch), b.weights.decode_flops(batch))
    notes = {"prompt_tokens": p.decode_prompt, "hybridkv_batch": batch, "transformers_batch": peer_batch}
    if batch == 1 and peer_batch == 1:
        return Result(name, 1e3 * t_ours, 1e3 * t_theirs, "ms/token", target, 1e3 * floor, notes)
    return Result(name, batch / t_ours, peer_batch / t_theirs, "tok/s", target, batch / floor, notes)


# -- chat: the next turn, regenerate, edit ----------------------------------------------------


def chat(b: Bench, targets: dict[str, float]) -> list[Result]:
    layout = b.plan.chat
    conv = Chat.build(layout, b.vocab)
    tokens = conv.tokens
    last = layout.turns - 1
    turn_start = conv.turn_starts[last]  # where the last user message starts
    prompt_end = conv.reply_starts[last]  # the last prompt's length (1,248)
    message_end = turn_start + layout.user  # the last user message's length, before the header

    def feed_span(seq: int, start: int, stop: int, logits: LogitsMode = "none") -> None:
        b.cm.feed({seq: tokens[start:stop]}, logits=logits, snapshot_at={seq: conv.boundaries_in(start, stop)})

    b.log(f"  chat: {layout.turns - 1} turns of history ({turn_start} tokens) in both engines")
    seq = b.cm.new_sequence()
    try:
        feed_span(seq, 0, layout.system)
        for t in range(last):  # each turn: the prompt's new part, then the reply (fed whole: set-up only)
            feed_span(seq, conv.turn_starts[t], conv.reply_starts[t], "last")
            feed_span(seq, conv.reply_starts[t], conv.turn_starts[t + 1])
        history = b.peer_cache([tokens[:turn_start]])

        def ours_turn() -> float:
            elapsed = _timed(lambda: feed_span(seq, turn_start, prompt_end, "last"))
            if b.cm.truncate(seq, turn_start) != turn_start:  # back to the history: restores its snapshot
                raise RuntimeError("the message-boundary snapshot before the last turn is missing")
            return elapsed

        def theirs_turn() -> float:
            cache = copy.deepcopy(history)  # untimed: the next repetition needs the history again
            return _timed(lambda: b.peer_forward([tokens[turn_start:prompt_end]], cache))

        turn = b.alternate(ours_turn, theirs_turn)
        feed_span(seq, turn_start, prompt_end, "last")
        feed_span(seq, prompt_end, len(tokens))  # the last reply: what regenerate and edit replace

        header = tokens[message_end:prompt_end]
        edited = conv.edited_last_user(b.vocab) + header
        computed: list[int] = []  # tokens hybridkv computed per repetition

        def ours_branch(length: int, new: list[int], hint: list[int]) -> float:
            before = b.cm.stats()["tokens_computed"]
            start = time.perf_counter()
            child = b.cm.fork(seq, length)
            b.cm.feed({child: new}, logits="last", snapshot_at={child: hint})
            elapsed = time.perf_counter() - start
            b.cm.release(child)
            computed.append(b.cm.stats()["tokens_computed"] - before)
            return elapsed

        regen = b.alternate(
            lambda: ours_branch(message_end, header, []),
            lambda: _timed(lambda: b.peer_forward([tokens[:prompt_end]])),
        )
        regen_computed = computed[-1]
        computed.clear()
        edit = b.alternate(
            lambda: ours_branch(turn_start, edited, [message_end - 1]),
            lambda: _timed(lambda: b.peer_forward([tokens[:turn_start] + edited])),
        )
        edit_computed = computed[-1]
    finally:
        b.cm.release(seq)

    notes = {"prompt_tokens": prompt_end, "history_tokens": turn_start}
    return [
        Result("chat_turn8_ttft", 1e3 * turn[0], 1e3 * turn[1], "ms", targets.get("chat_turn8_ttft"), None, notes),
        Result(
            "regenerate_ttft",
            1e3 * regen[0],
            1e3 * regen[1],
            "ms",
            targets.get("regenerate_ttft"),
            notes={**notes, "hybridkv_tokens_computed": regen_computed, "transformers_tokens_computed": prompt_end},
        ),
        Result(
            "edit_last_message_ttft",
            1e3 * edit[0],
            1e3 * edit[1],
            "ms",
            targets.get("edit_last_message_ttft"),
            notes={**notes, "hybridkv_tokens_computed": edit_computed, "transformers_tokens_computed": prompt_end},
        ),
    ]


# -- fork -------------------------------------------------------------------------------------


def fork(b: Bench, name: str) -> Result:
    """Time and extra bytes to fork `forks` continuations of a `fork_prompt`-token prompt:
    hybridkv's `fork` (shared by reference) against deep copies of transformers' cache."""
    p = b.plan
    prompt = random_ids(p.fork_prompt, b.vocab, seed=3000)
    seq = b.cm.new_sequence()
    try:
        b.cm.feed({seq: prompt}, logits="last")
        cache = b.peer_cache([prompt])
        extra: dict[str, int] = {}

        def ours() -> float:
            before = _used_bytes(b.cm)
            start = time.perf_counter()
            children = [b.cm.fork(seq) for _ in range(p.forks)]
            elapsed = time.perf_counter() - start
            extra["hybridkv"] = _used_bytes(b.cm) - before
            # What the forks cost once each writes its first token (copy-on-write), untimed.
            b.cm.feed({c: [1] for c in children}, logits="none")
            extra["hybridkv_after_first_token"] = _used_bytes(b.cm) - before
            for c in children:
                b.cm.release(c)
            return elapsed

        def theirs() -> float:
            start = time.perf_counter()
            copies = [copy.deepcopy(cache) for _ in range(p.forks)]
            elapsed = time.perf_counter() - start
            extra["transformers"] = _tensor_bytes(copies)
            return elapsed

        t_ours, t_theirs = b.alternate(ours, theirs)
    finally:
        b.cm.release(seq)
    notes = {
        "prompt_tokens": p.fork_prompt,
        "forks": p.forks,
        "hybridkv_extra_bytes": extra["hybridkv"],
        "hybridkv_extra_bytes_after_first_token": extra["hybridkv_after_first_token"],
        "transformers_extra_bytes": extra["transformers"],
    }
    return Result(name, 1e3 * t_ours, 1e3 * t_theirs, "ms", None, None, notes)


def _used_bytes(cm: CachedModel) -> int:
    memory = cm.cache.memory()
    return memory["kv_bytes_used"] + memory["state_bytes_used"] + memory["snapshot_bytes_used"]


def _tensor_bytes(obj: object) -> int:
    """Bytes of the distinct tensors reachable from `obj` (lists, dicts, object attributes)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
        elif hasattr(x, "__dict__"):
            stack.extend(vars(x).values())
    return total


# -- structured output: the grammar mask ------------------------------------------------------

# Records the model must keep writing: 64 of them cannot fit in any timed run, so no request
# ends early and every timed step decodes the whole batch.
RECORDS: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}
STRUCTURED_BATCHES = (1, 8)


def structured(b: Bench, targets: dict[str, float]) -> list[Result]:
    """Decode ms/token of the default model writing JSON under `RECORDS` (every token masked by
    the grammar, inside the engine's batched sampler) against the same requests decoding freely,
    greedy, at batch 1 and 8: two engines on the same weights, their steps alternating so that a
    shared machine's drift hits both alike; only steps in which a whole batch decodes are timed.
    The `transformers` column holds the unconstrained figure. The masks alone are timed too,
    replayed over the answers the constrained runs wrote (`mask_ms_per_step`)."""
    from hybridkv.cache.config import CacheConfig
    from hybridkv.engine.engine import EngineConfig
    from hybridkv.engine.grammar import Grammar, json_value
    from hybridkv.engine.llm import LLM
    from hybridkv.engine.sampling import SamplingParams

    p = b.plan
    batch_max = max(STRUCTURED_BATCHES)
    cache = CacheConfig(max_sequences=2 * batch_max + 1, max_model_len=1024, snapshots_per_sequence=4)
    ours_llm, free_llm = (LLM(cache=cache, engine=EngineConfig(max_num_seqs=batch_max)) for _ in range(2))
    grammar = Grammar(f"start: {json_value(RECORDS)}\n")
    steps = p.warmup + p.decode_steps
    assert ours_llm.engine.grammars.ll_tokenizer  # built once per model, before the grammar is timed
    start = time.perf_counter()
    ours_llm.engine.grammars.check(grammar)  # compiled here, once; each request copies it
    compile_ms = 1e3 * (time.perf_counter() - start)
    # The prompt's step samples the first token and the step sampling the last ends the requests:
    # `steps` timed steps between them.
    constrained = SamplingParams(max_tokens=steps + 2, temperature=0.0, grammar=grammar)
    free = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    results = []
    for batch in STRUCTURED_BATCHES:
        name = f"json_schema_b{batch}"
        b.log(f"  {name}: {p.reps} runs of {steps} decode steps, constrained and free steps alternating")
        prompts = [
            ours_llm.encode_chat([{"role": "user", "content": f"List the records of table {i} as JSON."}])[0]
            for i in range(batch)
        ]
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(p.reps):
            times, answers = _alternating_steps([(ours_llm, constrained), (free_llm, free)], prompts)
            ours += times[0][p.warmup :]
            theirs += times[1][p.warmup :]
        t_ours, t_theirs = _median(ours) / batch, _median(theirs) / batch
        notes = {
            "batch": batch,
            "decode_steps": len(ours),
            "grammar_compile_ms": compile_ms,
            "mask_ms_per_step": 1e3 * _median(_mask_times(ours_llm, grammar, answers[0])),
            "step_ms": 1e3 * _median(ours),
        }
        results.append(
            Result(name, 1e3 * t_ours, 1e3 * t_theirs, "ms/token", targets.get(name), None, notes, "hybridkv free")
        )
    return results


def _alternating_steps(
    runs: list[tuple[Any, Any]], prompts: list[list[int]]
) -> tuple[list[list[float]], list[list[list[int]]]]:
    """Each (LLM, params) of `runs` decodes `prompts` as one batch, the LLMs' engine steps taking
    turns. Per run: the seconds of each step in which all its requests decode (prompts in, none
    ended yet), and the tokens each request wrote."""
    requests = [[llm.engine.add_request(llm.engine.make_request(x, params)) for x in prompts] for llm, params in runs]
    for (llm, _), batch in zip(runs, requests, strict=True):  # prompts, untimed
        while not all(r.first_token_time is not None for r in batch):
            llm.engine.step()
    times: list[list[float]] = [[] for _ in runs]
    while not all(r.finished for batch in requests for r in batch):
        for (llm, _), batch, timed in zip(runs, requests, times, strict=True):
            if not all(r.finished for r in batch):
                elapsed = _timed(llm.engine.step)
                if not any(r.finished for r in batch):
                    timed.append(elapsed)
    return times, [[r.output().outputs[0].token_ids for r in batch] for batch in requests]


def _mask_times(llm: Any, grammar: Any, answers: list[list[int]]) -> list[float]:
    """Seconds to compute the batch's masks at each step of `answers`, as the sampler does."""
    from hybridkv.engine.grammar import allowed_array

    matchers = [llm.engine.grammars.matcher(grammar) for _ in answers]
    times = []
    for step in range(min(len(a) for a in answers)):
        times.append(_timed(lambda: allowed_array(matchers, llm.cm.vocab_size)))
        for matcher, answer in zip(matchers, answers, strict=True):
            matcher.consume(answer[step])
    return times
