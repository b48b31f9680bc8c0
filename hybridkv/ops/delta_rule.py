"""Gated delta rule: chunked form for prefill, single step for decode.

Per token, with state S [Hv, dk, dv]:  S ← S·exp(g_t);  u = β_t (v_t − Sᵀk_t);  S ← S + k_t ⊗ u;
o_t = Sᵀq_t.  q and k arrive already L2-normalised, q already scaled by dk^-0.5.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from hybridkv.ops.dtypes import f32


def chunk_gated_delta_rule(
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
    """Gated delta rule over packed variable-length sequences, `chunk_size` tokens per matmul.

    Args:
        q, k: [T, Hv, dk], any float dtype.
        v: [T, Hv, dv].
        g: [T, Hv] log-decay (<= 0).  beta: [T, Hv] write strength in (0, 1).
        cu_seqlens: [N+1] int64; sequence n owns tokens cu_seqlens[n]:cu_seqlens[n+1], each length >= 1.
        initial_state: [N, Hv, dk, dv] float32; not modified.
        state_at: None or [S] int64 ascending flat token indices; the state right after each of those
            tokens (of the sequence owning it) is returned.
    Returns:
        o [T, Hv, dv], final_state [N, Hv, dk, dv], states_at [S, Hv, dk, dv] — all float32, fresh.
    """
    T, Hv, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    N = cu_seqlens.numel() - 1
    plan = _plan_chunks(cu_seqlens.tolist(), [] if state_at is None else state_at.tolist(), C)
    B = len(plan.starts)

    # Lay every chunk of every sequence out as [B, Hv, C, ...]. Pad slots (only at the end of a chunk)
    # read any real token but get g = 0 and β = 0, which makes them leave the state untouched.
    starts = torch.tensor(plan.starts, dtype=torch.long)
    lens = torch.tensor(plan.lens, dtype=torch.long)
    offs = torch.arange(C)
    real = offs < lens[:, None]  # [B, C]
    slot_token = torch.where(real, starts[:, None] + offs, 0).flatten()  # token read by each of B*C slots

    def gather(x: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [B, Hv, C, ...]
        x = x.reshape(T, -1).index_select(0, slot_token).view(B, C, Hv, -1).transpose(1, 2)
        return x.to(torch.float32, memory_format=torch.contiguous_format)

    q_c, k_c, v_c = gather(q), gather(k), gather(v)
    g_c, beta_c = (gather(x).squeeze(-1) * real[:, None, :] for x in (g, beta))  # [B, Hv, C]

    # Phase 1, all chunks at once: within-chunk decays and the UT transform.
    g_cum = g_c.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    # decay[i, j] = exp(g_cum_i − g_cum_j) for j <= i; masking before exp avoids overflow above the diagonal.
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k_c * beta_c[..., None]
    # With A = I + strict_lower(diag(β) K Kᵀ ⊙ decay):  U = A⁻¹ diag(β) V,  W = A⁻¹ diag(β e^{g_cum}) K.
    ut_system = (k_beta @ k_c.transpose(-1, -2)) * decay
    ut_inverse = _unit_lower_inverse(ut_system)
    u_c = ut_inverse @ (v_c * beta_c[..., None])
    w_c = ut_inverse @ (k_beta * g_cum.exp()[..., None])
    intra = (q_c @ k_c.transpose(-1, -2)) * decay  # [B, Hv, C, C], includes the diagonal
    q_decayed = q_c * g_cum.exp()[..., None]
    k_decayed_t = (k_c * (g_cum[..., -1:] - g_cum).exp()[..., None]).transpose(-1, -2)  # [B, Hv, dk, C]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [B, Hv, 1, 1]

    # Phase 2, one step per chunk index, batched over the sequences that still have chunks. Sequences
    # are sorted longest-first and chunks stored step-major, so each step is a prefix of the states
    # against a contiguous run of chunks.
    state = initial_state[plan.order].float().contiguous()  # [N, Hv, dk, dv], a fresh copy
    o_c = torch.empty(B, Hv, C, dv)
    states_out = torch.empty(0 if state_at is None else state_at.numel(), Hv, dk, dv)
    for step, (lo, hi) in enumerate(plan.steps):
        s = state[: hi - lo]
        v_new = u_c[lo:hi] - w_c[lo:hi] @ s  # the part of the chunk's values the state does not predict
        o_step = torch.matmul(q_decayed[lo:hi], s, out=o_c[lo:hi])
        o_step.flatten(0, 1).baddbmm_(intra[lo:hi].flatten(0, 1), v_new.flatten(0, 1))
        s.mul_(chunk_decay[lo:hi])
        s.flatten(0, 1).baddbmm_(k_decayed_t[lo:hi].flatten(0, 1), v_new.flatten(0, 1))
        for out_i, slot in plan.captures_by_step.get(step, ()):
            states_out[out_i] = state[slot]

    # Read each token's row back from its slot.
    real_slots = real.flatten().nonzero().squeeze(1)
    token_slot = torch.empty(T, dtype=torch.long)
    token_slot[slot_token[real_slots]] = real_slots
    o = o_c.transpose(1, 2).reshape(B * C, Hv, dv).index_select(0, token_slot)
    final_state = torch.empty(N, Hv, dk, dv)
    final_state[plan.order] = state
    return o, final_state, states_out


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """A⁻¹ for a batch of unit lower-triangular A [..., n, n] (only its strict lower part is read).

    Block by block, [[A11, 0], [A21, A22]]⁻¹ = [[A11⁻¹, 0], [−A22⁻¹ A21 A11⁻¹, A22⁻¹]], down to 16×16
    blocks solved directly: batched matmuls instead of a triangular solve per matrix (LAPACK's loop
    over the batch), and then one product per right-hand side.
    """
    n = a.shape[-1]
    if n <= 16:
        eye = torch.eye(n, dtype=a.dtype).expand(a.shape)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    h = n // 2
    top, bottom = _unit_lower_inverse(a[..., :h, :h]), _unit_lower_inverse(a[..., h:, h:])
    out = torch.zeros_like(a)
    out[..., :h, :h] = top
    out[..., h:, h:] = bottom
    out[..., h:, :h] = -(bottom @ a[..., h:, :h]) @ top
    return out


@dataclass
class _ChunkPlan:
    """Chunks in step-major order (all sequences' first chunks, then their second chunks, ...).

    starts/lens: first token and token count of each chunk. steps: per step, its [lo, hi) run of chunks.
    order: original index of the sequence in each sorted state slot. captures_by_step: step →
    [(index into state_at, slot)].
    """

    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    captures_by_step: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


def _plan_chunks(cu: list[int], state_at: list[int], chunk_size: int) -> _ChunkPlan:
    per_seq: list[list[tuple[int, int, int]]] = []  # per sequence: (start, len, token captured after or -1)
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        # A segment ends right after each requested position so its end state is the one asked for;
        # only the last chunk of each segment is padded.
        wanted_here = state_at[bisect.bisect_left(state_at, start) : bisect.bisect_left(state_at, end)]
        cuts = sorted({p + 1 for p in wanted_here} | {end})
        seq_chunks = []
        seg_start = start
        for cut in cuts:
            for c in range(seg_start, cut, chunk_size):
                n_tok = min(chunk_size, cut - c)
                seq_chunks.append((c, n_tok, cut - 1 if c + n_tok == cut else -1))
            seg_start = cut
        per_seq.append(seq_chunks)

    plan = _ChunkPlan(order=sorted(range(len(per_seq)), key=lambda n: -len(per_seq[n])))
    wanted: dict[int, list[int]] = {}
    for i, p in enumerate(state_at):
        wanted.setdefault(p, []).append(i)
    for step in range(len(per_seq[plan.order[0]])):
        lo = len(plan.starts)
        for slot, n in enumerate(plan.order):
            if step >= len(per_seq[n]):
                break
            c, n_tok, captured = per_seq[n][step]
            plan.starts.append(c)
            plan.lens.append(n_tok)
            for out_i in wanted.get(captured, ()):
                plan.captures_by_step.setdefault(step, []).append((out_i, slot))
        plan.steps.append((lo, len(plan.starts)))
    return plan


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for N sequences at once.

    q, k [N, Hv, dk]; v [N, Hv, dv]; g, beta [N, Hv]; state [N, Hv, dk, dv] float32 (not modified).
    Returns o [N, Hv, dv] and new_state [N, Hv, dk, dv], both float32.
    """
    q, k, v, g, beta = (f32(x) for x in (q, k, v, g, beta))
    new_state = state * g.exp()[..., None, None]
    u = beta[..., None, None] * (v[..., None, :] - k[..., None, :] @ new_state)  # [N, Hv, 1, dv]
    new_state.addcmul_(k[..., :, None], u)  # rank-1 write k ⊗ u (elementwise: faster than a bmm of outer products)
    o = q[..., None, :] @ new_state
    return o.squeeze(-2), new_state
