"""Regenerate tests/data/kquant/reference.safetensors: llama.cpp's own Q4_K, Q5_K and Q6_K blocks of
seeded random weights, to test `hybridkv.ops.quant.quantize` against a third party without
building llama.cpp at test time.

    .venv/bin/python scripts/make_kquant_fixture.py LIBGGML_BASE

LIBGGML_BASE: the `libggml-base.so` of a built llama.cpp, e.g. the one a llama-cpp-python install
ships (`site-packages/llama_cpp/lib/libggml-base.so`; the fixture was made with llama-cpp-python
0.3.36's). Its `quantize_row_q4_K_ref` / `_q5_K_ref` / `_q6_K_ref` are what `llama-quantize`
runs for these types without an importance matrix. The weights: 64 rows of 512, normal with a random
scale per row (so 128 super-blocks per type), seed 0; row 0's first super-block is zero.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kquant" / "reference.safetensors"


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen).mul(4).add(0.01)
    w[0, :256] = 0
    x = np.ascontiguousarray(w.numpy().astype(np.float32))
    tensors = {"weights": w}
    for name, block_bytes in (("q4_K", 144), ("q5_K", 176), ("q6_K", 210)):
        out = np.zeros(x.size // 256 * block_bytes, np.uint8)
        fn = getattr(lib, f"quantize_row_{name}_ref")
        fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
        tensors[name.lower()] = torch.from_numpy(out).view(64, -1)
    save_file(tensors, str(OUT))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
