"""Slow, obviously-correct twins of every op in this package, with the same signatures.

They loop token by token and exist only to be compared against; never call them on a hot path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _seq_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:], strict=True))


def _state_at_list(state_at: torch.Tensor | None) -> list[int]:
    return [] if state_at is None else [int(p) for p in state_at.tolist()]


def naive_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    state_at: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated delta rule over packed sequences, one token at a time (`chunk_size` is ignored).

    Shapes as in `delta_rule.chunk_gated_delta_rule`: q, k [T, Hv, dk]; v [T, Hv, dv]; g, beta [T, Hv];
    cu_seqlens [N+1]; initial_state [N, Hv, dk, dv]; state_at [S] flat token indices.
    Returns o [T, Hv, dv], final_state [N, Hv, dk, dv], states_at [S, Hv, dk, dv], all float32.
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    T, Hv, dk = k.shape
    dv = v.shape[-1]
    wanted = set(_state_at_list(state_at))
    captured: dict[int, torch.Tensor] = {}
    o = torch.zeros(T, Hv, dv)
    final_state = torch.empty(len(cu_seqlens) - 1, Hv, dk, dv)
    for n, (start, end) in enumerate(_seq_bounds(cu_seqlens)):
        S = initial_state[n].float().clone()
        for t in range(start, end):
            S = S * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])
            if t in wanted:
                captured[t] = S.clone()
        final_state[n] = S
    states_at = torch.stack([captured[p] for p in _state_at_list(state_at)]) if wanted else None
    if states_at is None:
        states_at = torch.zeros(0, Hv, dk, dv)
    return o, final_state, states_at


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for N sequences, looping over sequences and heads.

    q, k [N, Hv, dk]; v [N, Hv, dv]; g, beta [N, Hv]; state [N, Hv, dk, dv] →
    o [N, Hv, dv], new_state [N, Hv, dk, dv], both float32.
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    N, Hv, dk = k.shape
    o = torch.zeros(N, Hv, v.shape[-1])
    new_state = state.float().clone()
    for n in range(N):
        for h in range(Hv):
            S = new_state[n, h] * g[n, h].exp()
            u = beta[n, h] * (v[n, h] - S.T @ k[n, h])
            S = S + torch.outer(k[n, h], u)
            o[n, h] = S.T @ q[n, h]
            new_state[n, h] = S
    return o, new_state


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}; use 'silu' or None")


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    state_at: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over packed sequences, one output token at a time.

    x [T, C]; weight [C, K]; initial_state [N, C, K-1] (column -1 is the newest previous input).
    Returns y [T, C], final_state [N, C, K-1], states_at [S, C, K-1], all float32.
    """
    x, weight = x.float(), weight.float()
    C, K = weight.shape
    wanted = _state_at_list(state_at)
    y = torch.zeros_like(x)
    final_state = torch.empty(len(cu_seqlens) - 1, C, K - 1)
    states_at = torch.empty(len(wanted), C, K - 1)
    for n, (start, end) in enumerate(_seq_bounds(cu_seqlens)):
        # Previous inputs then this sequence's inputs, oldest first: [K-1+L, C].
        buf = torch.cat([initial_state[n].float().T, x[start:end]])
        for j in range(end - start):
            window = buf[j : j + K]  # inputs t-K+1 .. t
            y[start + j] = (window.T * weight).sum(-1)
            if start + j in wanted:
                states_at[wanted.index(start + j)] = buf[j + 1 : j + K].T
        final_state[n] = buf[buf.shape[0] - (K - 1) :].T
    return _activate(y, activation), final_state, states_at


def naive_causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One conv step per sequence: x [N, C], state [N, C, K-1] → y [N, C], new_state [N, C, K-1]."""
    N, C = x.shape
    K = weight.shape[1]
    y = torch.zeros(N, C)
    new_state = torch.empty(N, C, K - 1)
    for n in range(N):
        window = torch.cat([state[n].float(), x[n].float()[:, None]], dim=1)  # [C, K]
        y[n] = (window * weight.float()).sum(-1)
        new_state[n] = window[:, 1:]
    return _activate(y, activation), new_state


def naive_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention over a paged K/V pool, one query at a time with an explicit softmax.

    q [T, H, hd]; k_pool, v_pool [num_blocks, block_size, Hkv, hd]; block_tables [N, max_blocks];
    cu_seqlens [N+1] over q; kv_lens [N]. Returns out [T, H, hd] in q's dtype.
    """
    T, H, hd = q.shape
    block_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    group = H // Hkv
    out = torch.zeros(T, H, hd)
    for n, (start, end) in enumerate(_seq_bounds(cu_seqlens)):
        kv_len = int(kv_lens[n])
        positions = range(kv_len)
        blocks = [int(block_tables[n, p // block_size]) for p in positions]
        keys = torch.stack([k_pool[b, p % block_size] for b, p in zip(blocks, positions, strict=True)]).float()
        values = torch.stack([v_pool[b, p % block_size] for b, p in zip(blocks, positions, strict=True)]).float()
        for j in range(end - start):
            pos = kv_len - (end - start) + j
            for h in range(H):
                kh = keys[: pos + 1, h // group]  # [pos+1, hd]
                scores = (kh @ q[start + j, h].float()) * scale
                weights = (scores - scores.max()).exp()
                p = weights / weights.sum()
                out[start + j, h] = p @ values[: pos + 1, h // group]
    return out.to(q.dtype)
