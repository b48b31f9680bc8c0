"""Sparse mixture-of-experts feed-forward: each token through its top-k routed SwiGLU experts, plus
a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops import native
from hybridkv.ops.matmul import BF16_GEMM, FEW_ROWS, Weight, linear, silu_mul, swiglu
from hybridkv.ops.quant.linear import QuantExperts

Experts = torch.Tensor | QuantExperts


def moe_block(
    x: torch.Tensor,
    gate_in: Weight,
    gate_up: Experts,
    down: Experts,
    shared_down: Weight,
    top_k: int,
    norm_topk: bool,
) -> torch.Tensor:
    """The feed-forward of a sparse-MoE layer; [T, D] in x's dtype.

    x [T, D]; gate_in [D, E | 1 | 2·Is]: router logits, shared-expert gate, shared gate_up (gate
    columns first); gate_up [E, D, 2I]; down [E, I, D]; shared_down [Is, D]. The router's softmax
    runs in float32; with norm_topk the chosen k probabilities are renormalised to sum to 1. It runs
    as one C++ kernel for few tokens (decode) and for float32 weights (prefill: the kernel sorts,
    gathers and scatters, MKL multiplies); bfloat16 prefill keeps PyTorch's bfloat16 GEMMs where
    they are fast (`matmul.BF16_GEMM`), else the kernel widens each expert for MKL. Weights kept
    in a file's blocks (`QuantLinear`, `QuantExperts`) run the PyTorch path on their own products.
    """
    if (
        isinstance(gate_in, torch.Tensor)
        and isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and isinstance(shared_down, torch.Tensor)
        and (x.shape[0] <= FEW_ROWS or gate_up.dtype == torch.float32 or not BF16_GEMM)
        and native.enabled(x, gate_in, gate_up, down, shared_down)
    ):
        y = native.moe_block(x, gate_in, gate_up, down, shared_down, top_k, norm_topk)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    E = gate_up.shape[0] if isinstance(gate_up, torch.Tensor) else gate_up.num_experts
    logits = linear(x, gate_in)
    router, shared_gate, shared_gate_up = logits.split([E, 1, logits.shape[-1] - E - 1], dim=-1)
    probs = F.softmax(router, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)  # [T, k]
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    pairs = _pair_products(x, experts, gate_up, down)
    shared = linear(silu_mul(shared_gate_up), shared_down)
    if pairs is not None:
        parts = (pairs, weights, shared, shared_gate)
        if all(t.dtype == torch.float32 for t in parts) and native.enabled(*parts):
            return native.moe_combine(*parts)  # as `decode_layer`'s `block_moe`
    routed = _weighted(pairs, weights, x) if pairs is not None else _routed(x, experts, weights, gate_up, down)
    return routed + shared * torch.sigmoid(shared_gate)


# (token, expert) pairs of block experts that still go to one kernel call per projection (batched
# decode: batch 8 of top-8 is 64); beyond, each expert in turn (prefill). A batch-8 step of the
# moe-mini shape's Q8_0 file took 380 ms through the loop (~700 calls), ~260 ms this way.
PAIRS_ROWS = 512


def routed_experts(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: Experts, down: Experts
) -> torch.Tensor:
    """out[t] = Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]); [T, D] in x's dtype.

    x [T, D]; experts [T, k] int64 in [0, E); weights [T, k]; gate_up [E, D, 2I] (gate columns
    first), down [E, I, D]. The (token, expert) pairs are sorted by expert and each expert runs one
    SwiGLU over its contiguous run of rows (torch._grouped_mm is slower on CPU: its per-group
    products run on one thread), then a weighted scatter-add brings them back to their tokens.
    Experts in a file's blocks (`QuantExperts`): a decode step's (token, expert) pairs in one
    kernel call per projection (`pairs_matmul`, up to PAIRS_ROWS pairs where every part has a
    kernel), more pairs the same loop on each expert's blocks.
    """
    pairs = _pair_products(x, experts, gate_up, down)
    return _weighted(pairs, weights, x) if pairs is not None else _routed(x, experts, weights, gate_up, down)


def _routed(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: Experts, down: Experts
) -> torch.Tensor:
    """`routed_experts` where its pairs do not go to one kernel call per projection."""
    top_k = experts.shape[1]
    weights = weights.to(x.dtype)
    if isinstance(gate_up, QuantExperts) or isinstance(down, QuantExperts):
        return _routed_loop(x, experts, weights, gate_up, down)
    if x.shape[0] == 1:
        # One token: copy its k experts' weights side by side (a copy streams on every thread), then
        # one bmm per product; measured as fast as a k-split matmul pair per expert, in fewer ops.
        ids = experts[0]
        h = torch.bmm(x.expand(top_k, 1, x.shape[1]), gate_up.index_select(0, ids))
        y = torch.bmm(silu_mul(h), down.index_select(0, ids))  # [k, 1, D]
        return weights @ y[:, 0]
    return _routed_loop(x, experts, weights, gate_up, down)


def _pair_products(x: torch.Tensor, experts: torch.Tensor, gate_up: Experts, down: Experts) -> torch.Tensor | None:
    """Experts in a file's blocks (`QuantExperts`) with few enough (token, expert) pairs: every
    pair's SwiGLU in one kernel call per projection, no per-expert loop (the kernel reads each
    expert's rows once for all its pairs) → [T·k, D] in x's dtype, row t·k + j token t's j-th
    expert; else None."""
    pairs = experts.numel()
    if not (
        isinstance(gate_up, QuantExperts)
        and isinstance(down, QuantExperts)
        and (pairs <= FEW_ROWS or (pairs <= PAIRS_ROWS and gate_up.pairs_in_one_call(x) and down.pairs_in_one_call(x)))
    ):
        return None
    ids = experts.flatten()
    # Each token's row quantized once for its k pairs, not copied k times (a 56-token chunk of
    # moe-mini: the copies and their quantization were ~2.5% of the time)
    return down.pairs_matmul(silu_mul(gate_up.pairs_matmul(x, ids)), ids)


def _weighted(pairs: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[t, j] · pairs[t·k + j] → [T, D] in x's dtype."""
    k = weights.shape[1]
    return (pairs * weights.to(x.dtype).reshape(-1, 1)).view(x.shape[0], k, -1).sum(1)


def _expert(w: Experts, e: int) -> Weight:
    return w.expert(e) if isinstance(w, QuantExperts) else w[e]


def _routed_loop(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: Experts, down: Experts
) -> torch.Tensor:
    top_k = experts.shape[1]
    E = gate_up.shape[0] if isinstance(gate_up, torch.Tensor) else gate_up.num_experts
    sorted_experts, order = experts.flatten().sort(stable=True)
    token = order // top_k
    xs = x.index_select(0, token)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(torch.bincount(sorted_experts, minlength=E).tolist()):
        if n:
            ys[start : start + n] = swiglu(xs[start : start + n], _expert(gate_up, e), _expert(down, e))
            start += n
    ys = ys * weights.flatten().index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, token, ys)
