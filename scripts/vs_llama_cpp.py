"""hybridkv and llama.cpp on the same GGUF file, same threads, same prompt: prefill and batch-1
decode, each engine in its own child process, alternating. What produced the README's table
until `hybridkv bench --peer llama.cpp` exists.

    .venv/bin/python scripts/vs_llama_cpp.py FILE.gguf [--threads N] [--prompt 512] [--steps 16] [--rounds 3]

Needs llama-cpp-python (`pip install llama-cpp-python==0.3.36`: a source build, ~30 min on 2
cores). llama.cpp runs through `Llama.eval` (one sequence, its KV kept, n_batch 512); hybridkv
through `CachedModel.feed`. Reports the median over rounds of each figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
engine, path, threads, prompt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ids = [100 + (i * 7919) % 5000 for i in range(prompt)]
if engine == "llama.cpp":
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=prompt + steps + 16, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    def feed(tokens): llm.eval(tokens)
else:
    import torch
    torch.set_num_threads(threads)
    from hybridkv import CacheConfig, CachedModel
    cm = CachedModel.load(path, cache=CacheConfig(max_model_len=prompt + steps + 16, max_sequences=2))
    seq = cm.new_sequence()
    def feed(tokens): cm.feed({seq: tokens}, logits="last")
start = time.perf_counter(); feed(ids); prefill = time.perf_counter() - start
times = []
for i in range(steps):
    start = time.perf_counter(); feed([200 + i]); times.append(time.perf_counter() - start)
print(json.dumps({"prefill_tok_s": prompt / prefill, "decode_ms": 1e3 * sorted(times)[len(times) // 2]}))
"""


def measure(engine: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, engine, args.file, str(args.threads), str(args.prompt), str(args.steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"hybridkv": [], "llama.cpp": []}
    for _ in range(args.rounds):
        for engine in runs:
            runs[engine].append(measure(engine, args))
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
    h, l = med["hybridkv"], med["llama.cpp"]
    print(f"{args.file}, {args.threads} threads, prompt {args.prompt}")
    print(
        f"  prefill_{args.prompt}: hybridkv {h['prefill_tok_s']:.1f} tok/s, llama.cpp {l['prefill_tok_s']:.1f} tok/s, "
        f"ratio {h['prefill_tok_s'] / l['prefill_tok_s']:.2f}x"
    )
    print(
        f"  decode_b1: hybridkv {h['decode_ms']:.1f} ms, llama.cpp {l['decode_ms']:.1f} ms, "
        f"ratio {l['decode_ms'] / h['decode_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
