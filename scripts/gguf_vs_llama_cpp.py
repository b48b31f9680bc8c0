"""`hybridkv quantize`'s files checked by llama.cpp itself: its logits and perplexity on the same files.

    .venv/bin/python scripts/gguf_vs_llama_cpp.py [--work DIR] [--threads N]   # the README's tables
    .venv/bin/python scripts/gguf_vs_llama_cpp.py --fixture                     # tests/data/gguf/qwen3next-wide-*

Needs llama-cpp-python (the `[peers]` extra, a source build; on an AMX CPU without GGML_NATIVE, see
the README). Without `--fixture`:

1. Writes the default model (hybridkv/assets/default_model) with `hybridkv quantize` as f32, q8_0,
   q6_k and q4_k_m, and lists each file's tensor types (the model is 192 wide, not a multiple of
   256, so llama.cpp's rules fall back to Q5_0 / Q8_0 for most K-quant tensors).
2. Logits on the first held-out window (256 tokens): hybridkv and llama.cpp on each file (top-1
   agreement, max |difference| / max |logit|), and each against transformers on the float32
   checkpoint.
3. Perplexity on the held-out split, measured as tests/test_default_model.py and
   scripts/train_default_model.py do (the first 16384 tokens in windows of 256, each a fresh
   sequence, every token but a window's first predicted): hybridkv and llama.cpp on each file,
   and llama.cpp on llama.cpp's own quantization (`llama_model_quantize`) of the f32 file.
   Prints the README's table.

With `--fixture`: writes tests/data/gguf/qwen3next-wide-q4_k_m.gguf (hybridkv's writer, on
make_gguf_fixtures.py's `qwen3next_wide_checkpoint`) and llama.cpp's logits on it for PROMPT_IDS,
`qwen3next-wide-q4_k_m.llama_cpp_logits.safetensors`, which the default test run compares ours to.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from hybridkv import CacheConfig, CachedModel  # noqa: E402
from hybridkv.default_model import default_model_dir  # noqa: E402
from hybridkv.engine.tokenizer import Tokenizer  # noqa: E402
from hybridkv.models.gguf_writer import write_quantized  # noqa: E402

HELDOUT = REPO / "tests" / "data" / "default_model_heldout.txt"
FIXTURES = REPO / "tests" / "data" / "gguf"
SEQ_LEN, EVAL_TOKENS = 256, 16384  # as tests/test_default_model.py
TYPES = ("f32", "q8_0", "q6_k", "q4_k_m")
LLAMA_FTYPES = {"q8_0": 7, "q6_k": 18, "q4_k_m": 15}  # llama.h LLAMA_FTYPE_MOSTLY_*
PROMPT_IDS = [5, 17, 250, 3, 99, 42, 7, 300, 11, 64, 345, 2, 180, 33, 71, 9]  # the fixture's tokens


def llama(path: Path, threads: int):  # -> llama_cpp.Llama, logits for every token, F32 KV cache
    import llama_cpp

    return llama_cpp.Llama(
        str(path), n_ctx=SEQ_LEN, n_batch=SEQ_LEN, logits_all=True, verbose=False, n_threads=threads,
        n_threads_batch=threads, type_k=0, type_v=0,
    )  # fmt: skip


def llama_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def ours_logits(path: Path, windows: torch.Tensor) -> list[torch.Tensor]:
    cm = CachedModel.load(path, cache=CacheConfig(max_model_len=SEQ_LEN, max_sequences=16))
    out = []
    for part in windows.split(16):
        seqs = [cm.new_sequence() for _ in part]
        logits = cm.feed(dict(zip(seqs, part.tolist(), strict=True)), logits="all")
        out += [logits[s].float() for s in seqs]
        for s in seqs:
            cm.release(s)
    return out


def perplexity(logits: list[torch.Tensor], windows: torch.Tensor) -> float:
    pairs = zip(logits, windows, strict=True)
    total = sum(F.cross_entropy(lg[:-1].double(), w[1:], reduction="sum").item() for lg, w in pairs)
    return math.exp(total / (windows.numel() - windows.shape[0]))


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a - b).abs().max() / b.abs().max()).item()
    return f"top-1 agreement {100 * top1:.1f}%, max rel. error {rel:.2e}"


def transformers_logits(ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.Qwen3NextForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")


def file_types(path: Path) -> str:
    from hybridkv.models.gguf import GGUFFile

    with GGUFFile(path) as f:
        counts = Counter(t.type_name for t in f.tensors.values())
    return ", ".join(f"{n} {name}" for name, n in counts.most_common())


def report(work: Path, threads: int) -> None:
    torch.set_num_threads(threads)
    ids = Tokenizer.from_dir(default_model_dir()).encode(HELDOUT.read_text(encoding="utf-8"))[:EVAL_TOKENS]
    windows = torch.tensor(ids).view(-1, SEQ_LEN)
    reference = transformers_logits(windows[0].tolist())
    rows = []
    for name in TYPES:
        path = work / f"default-{name}.gguf"
        write_quantized(default_model_dir(), path, name)
        print(f"{name}: {path.stat().st_size / 1e6:.2f} MB; {file_types(path)}", flush=True)
        ours = ours_logits(path, windows)
        llm = llama(path, threads)
        theirs = [llama_logits(llm, w.tolist()) for w in windows]
        print(f"  hybridkv vs llama.cpp, window 0: {compare(ours[0], theirs[0])}")
        print(f"  hybridkv vs transformers (float32 checkpoint): {compare(ours[0], reference)}")
        print(f"  llama.cpp vs transformers (float32 checkpoint): {compare(theirs[0], reference)}")
        own = "–"
        if name in LLAMA_FTYPES:
            quantized = work / f"default-{name}-llama-quantize.gguf"
            llama_quantize(work / "default-f32.gguf", quantized, LLAMA_FTYPES[name])
            print(f"  llama-quantize's own file: {file_types(quantized)}")
            own = f"{perplexity([llama_logits(llama(quantized, threads), w.tolist()) for w in windows], windows):.3f}"
        rows.append((name, path.stat().st_size / 1e6, perplexity(ours, windows), perplexity(theirs, windows), own))
        print(f"  perplexity: hybridkv {rows[-1][2]:.3f}, llama.cpp {rows[-1][3]:.3f}, llama-quantize's file {own}")
    print("\n| file (`hybridkv quantize --type`) | size | hybridkv | llama.cpp | llama.cpp on llama-quantize's file |")
    print("|---|---|---|---|---|")
    for name, size, ours_ppl, theirs_ppl, own in rows:
        print(f"| {name} | {size:.1f} MB | {ours_ppl:.3f} | {theirs_ppl:.3f} | {own} |")


def fixture(threads: int) -> None:
    spec = importlib.util.spec_from_file_location("make_gguf_fixtures", REPO / "scripts" / "make_gguf_fixtures.py")
    assert spec and spec.loader
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "qwen3next-wide"  # general.name, as in the test's rebuild
        fixtures.qwen3next_wide_checkpoint(checkpoint)
        path = FIXTURES / "qwen3next-wide-q4_k_m.gguf"
        write_quantized(checkpoint, path, "q4_k_m")
    logits = llama_logits(llama(path, threads), PROMPT_IDS)
    save_file(
        {"tokens": torch.tensor(PROMPT_IDS), "logits": logits.contiguous()},
        str(FIXTURES / "qwen3next-wide-q4_k_m.llama_cpp_logits.safetensors"),
    )
    print(f"wrote {path} ({file_types(path)}) and llama.cpp's logits on it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="where the files go (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fixture", action="store_true", help="write the test fixture instead of the report")
    args = parser.parse_args()
    if args.fixture:
        fixture(args.threads)
        return
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        report(args.work, args.threads)
        return
    with tempfile.TemporaryDirectory() as tmp:
        report(Path(tmp), args.threads)


if __name__ == "__main__":
    main()
