"""The causal depthwise conv agrees with the one-window-at-a-time loop and with nn.Conv1d + SiLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_checks import assert_close, cu_seqlens_of

from hybridkv.ops.conv import causal_conv1d, causal_conv1d_step
from hybridkv.ops.naive import naive_causal_conv1d, naive_causal_conv1d_step


@pytest.mark.parametrize("K", [4, 2, 1])
@pytest.mark.parametrize(
    "lens, state_at",
    [([1], [0]), ([9], []), ([1, 2, 7, 3], [0, 1, 2, 5, 9, 12]), ([20, 1], [4, 19, 20])],
)
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_matches_naive(K, lens, state_at, activation):
    torch.manual_seed(0)
    C = 6
    cu = cu_seqlens_of(lens)
    x = torch.randn(int(cu[-1]), C)
    weight = torch.randn(C, K)
    state = torch.randn(len(lens), C, K - 1)
    state_before = state.clone()
    at = torch.tensor(state_at, dtype=torch.long)

    got = causal_conv1d(x, weight, cu, state, state_at=at, activation=activation)
    want = naive_causal_conv1d(x, weight, cu, state, state_at=at, activation=activation)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)
    assert torch.equal(state, state_before), "initial_state must not be modified"


def test_fresh_sequence_matches_torch_conv1d_then_silu():
    """What transformers runs: nn.Conv1d(groups=C, padding=K-1, bias=False)(x)[..., :T], then SiLU."""
    torch.manual_seed(1)
    T, C, K = 11, 8, 4
    x = torch.randn(T, C)
    conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1, bias=False)
    want = F.silu(conv(x.T[None])[0, :, :T]).T.detach()

    y, final_state, _ = causal_conv1d(x, conv.weight[:, 0].detach(), torch.tensor([0, T]), torch.zeros(1, C, K - 1))
    assert_close(y, want)
    assert torch.equal(final_state[0], x[-(K - 1) :].T), "the state is the last K-1 pre-conv inputs"


def test_short_sequence_keeps_older_inputs_from_its_state():
    C, K = 3, 4
    state = torch.arange(C * (K - 1), dtype=torch.float32).view(1, C, K - 1)
    x = torch.full((1, C), 100.0)
    _, final_state, _ = causal_conv1d(x, torch.randn(C, K), torch.tensor([0, 1]), state)
    assert torch.equal(final_state[0], torch.cat([state[0, :, 1:], x.T], dim=1))


def test_state_at_is_the_state_after_that_prefix():
    torch.manual_seed(2)
    lens, C, K = [7, 12], 5, 4
    cu = cu_seqlens_of(lens)
    x, weight, state = torch.randn(19, C), torch.randn(C, K), torch.randn(2, C, K - 1)
    at = torch.tensor([0, 1, 6, 7, 8, 15])
    _, _, states = causal_conv1d(x, weight, cu, state, state_at=at)
    for i, p in enumerate(at.tolist()):
        n = int(torch.searchsorted(cu, p, right=True)) - 1
        start = int(cu[n])
        _, final_ref, _ = naive_causal_conv1d(
            x[start : p + 1], weight, torch.tensor([0, p + 1 - start]), state[n : n + 1]
        )
        assert_close(states[i], final_ref[0])


@pytest.mark.parametrize("K", [4, 1])
def test_step_matches_naive(K):
    torch.manual_seed(3)
    N, C = 4, 7
    x, weight, state = torch.randn(N, C), torch.randn(C, K), torch.randn(N, C, K - 1)
    state_before = state.clone()
    y, new_state = causal_conv1d_step(x, weight, state)
    y_ref, new_state_ref = naive_causal_conv1d_step(x, weight, state)
    assert_close(y, y_ref)
    assert_close(new_state, new_state_ref)
    assert torch.equal(state, state_before)


def test_decode_steps_continue_a_prefill():
    torch.manual_seed(4)
    lens, steps, C, K = [1, 6, 3], 4, 5, 4
    full = [n + steps for n in lens]
    cu_full = cu_seqlens_of(full)
    x, weight, state0 = torch.randn(int(cu_full[-1]), C), torch.randn(C, K), torch.randn(3, C, K - 1)
    y_ref, final_ref, _ = naive_causal_conv1d(x, weight, cu_full, state0)

    prefill_rows = torch.cat([torch.arange(int(c), int(c) + n) for c, n in zip(cu_full[:-1], lens, strict=True)])
    _, state, _ = causal_conv1d(x[prefill_rows], weight, cu_seqlens_of(lens), state0)
    for s in range(steps):
        rows = cu_full[:-1] + torch.tensor(lens) + s
        y, state = causal_conv1d_step(x[rows], weight, state)
        assert_close(y, y_ref[rows])
    assert_close(state, final_ref)
