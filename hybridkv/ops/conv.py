"""Causal depthwise conv1d with a carried state of the last K-1 inputs, as the Gated DeltaNet mixer uses.

y_t[c] = act(sum_{i<K} w[c, i] · x_{t-K+1+i}[c]); inputs before a sequence's first token come from its
state (state[:, :, -1] is the newest). Matches nn.Conv1d(groups=C, padding=K-1, bias=False)[..., :T]
then SiLU, which is what transformers runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.dtypes import f32


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    state_at: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv over packed variable-length sequences.

    Args:
        x: [T, C] pre-conv inputs, any float dtype.
        weight: [C, K].
        cu_seqlens: [N+1] int64; sequence n owns tokens cu_seqlens[n]:cu_seqlens[n+1], each length >= 1.
        initial_state: [N, C, K-1] float32, the K-1 inputs before each sequence (zeros for a fresh one).
        state_at: None or [S] int64 ascending flat token indices; the state right after each is returned.
        activation: "silu" or None.
    Returns:
        y [T, C] float32 (always float32, whatever x's dtype), final_state [N, C, K-1] (the last K-1
        inputs of each sequence, reaching into initial_state when it is shorter than K-1), and
        states_at [S, C, K-1] — all float32 and fresh.
    """
    T, C = x.shape
    K = weight.shape[1]
    N = cu_seqlens.numel() - 1
    # One buffer [T + N(K-1), C] of all sequences, each preceded by its state: [state_0, x_0, state_1, ...].
    # Token t of sequence n sits at row t + (n+1)(K-1); its window starts at row t + n(K-1).
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(N), lens, output_size=T)
    window_start = torch.arange(T) + seq_of_token * (K - 1)  # [T]
    buf = torch.empty(T + N * (K - 1), C)
    buf[window_start + (K - 1)] = x.float()
    state_rows = (cu_seqlens[:-1] + torch.arange(N) * (K - 1))[:, None] + torch.arange(K - 1)  # [N, K-1]
    buf[state_rows] = initial_state.float().transpose(1, 2)

    # Valid (unpadded) depthwise conv over the whole buffer as K shifted multiply-adds; outputs whose
    # window straddles two sequences are computed and dropped.
    n_out = buf.shape[0] - (K - 1)
    w = weight.float().t()  # [K, C]
    y_all = buf[:n_out] * w[0]
    for i in range(1, K):
        y_all.addcmul_(buf[i : i + n_out], w[i])
    y = _activate(y_all[window_start], activation)

    def states_after(tokens: torch.Tensor) -> torch.Tensor:  # [S] flat tokens -> [S, C, K-1]
        rows = (window_start[tokens] + 1)[:, None] + torch.arange(K - 1)
        return buf[rows].transpose(1, 2).contiguous()

    final_state = states_after(cu_seqlens[1:] - 1)
    wanted = torch.zeros(0, dtype=torch.long) if state_at is None else state_at
    return y, final_state, states_after(wanted)


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for N sequences: x [N, C], weight [C, K], state [N, C, K-1] float32 (not modified).

    Returns y [N, C] float32 and new_state [N, C, K-1] float32 (state shifted left by one, x appended).
    """
    window = torch.cat([f32(state), f32(x)[:, :, None]], dim=-1)  # [N, C, K]
    y = torch.linalg.vecdot(window, f32(weight))
    return _activate(y, activation), window[:, :, 1:]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}; use 'silu' or None")
