"""Routed mixture-of-experts feed-forward: each token through its top-k SwiGLU experts."""

from __future__ import annotations

import torch

from hybridkv.ops import native
from hybridkv.ops.matmul import FEW_ROWS, silu_mul, swiglu


def routed_experts(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """out[t] = Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]).

    x [T, D]; experts [T, k] int64 in [0, E); weights [T, k]; gate_up [E, D, 2I] (gate columns
    first), down [E, I, D]. Returns [T, D] in x's dtype. Few tokens go to the C++ kernel, which
    reads each chosen expert once where it lies; the rest is grouped per expert for MKL.
    """
    if x.shape[0] <= FEW_ROWS and native.enabled(x, gate_up, down):
        y = native.moe_experts(x, experts, weights, gate_up, down)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    return routed_experts_grouped(x, experts, weights, gate_up, down)


def routed_experts_grouped(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """`routed_experts` in PyTorch: the (token, expert) pairs sorted by expert, one SwiGLU per
    expert over its contiguous run of rows (torch._grouped_mm is slower on CPU: its per-group
    products run on one thread), then a weighted scatter-add back to the tokens."""
    top_k = experts.shape[1]
    if x.shape[0] == 1:
        # One token: copy its k experts' weights side by side (a copy streams on every thread), then
        # one bmm per product; measured as fast as a k-split matmul pair per expert, in fewer ops.
        ids = experts[0]
        h = torch.bmm(x.expand(top_k, 1, x.shape[1]), gate_up.index_select(0, ids))
        y = torch.bmm(silu_mul(h), down.index_select(0, ids))  # [k, 1, D]
        return weights.to(x.dtype) @ y[:, 0]
    sorted_experts, order = experts.flatten().sort(stable=True)
    token = order // top_k
    xs = x.index_select(0, token)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(torch.bincount(sorted_experts, minlength=gate_up.shape[0]).tolist()):
        if n:
            ys[start : start + n] = swiglu(xs[start : start + n], gate_up[e], down[e])
            start += n
    ys = ys * weights.to(x.dtype).flatten().index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, token, ys)
