"""The chunked and single-step gated delta rule agree with the token-by-token loop and with transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_checks import assert_close, cu_seqlens_of
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hybridkv.ops.delta_rule import _unit_lower_inverse, chunk_gated_delta_rule, recurrent_gated_delta_rule
from hybridkv.ops.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule


def make_inputs(T: int, Hv: int, dk: int, dv: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Realistic inputs: q, k L2-normalised (q scaled by dk^-0.5), g = -softplus(randn), β in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": F.normalize(torch.randn(T, Hv, dk, generator=gen), dim=-1) * dk**-0.5,
        "k": F.normalize(torch.randn(T, Hv, dk, generator=gen), dim=-1),
        "v": torch.randn(T, Hv, dv, generator=gen),
        "g": -F.softplus(torch.randn(T, Hv, generator=gen)),
        "beta": torch.rand(T, Hv, generator=gen),
    }


CASES = [
    # lens, state_at, chunk_size: length 1, lengths off the chunk grid, > 2 chunks, captures on and off it
    ([1], [0], 16),
    ([37], [], 16),
    ([16, 32], [15, 47], 16),
    ([70, 1, 5, 150, 64], [0, 3, 69, 70, 71, 100, 200, 289], 16),
    ([3, 130], [1, 2, 3, 66, 132], 64),
    ([200], [0, 63, 64, 199], 64),
]


@pytest.mark.parametrize("lens, state_at, chunk_size", CASES)
@pytest.mark.parametrize("Hv, dk, dv", [(2, 8, 8), (3, 16, 5)])
def test_chunk_matches_naive(lens, state_at, chunk_size, Hv, dk, dv):
    torch.manual_seed(0)
    x = make_inputs(sum(lens), Hv, dk, dv)
    cu = cu_seqlens_of(lens)
    h0 = torch.randn(len(lens), Hv, dk, dv)
    h0_before = h0.clone()
    at = torch.tensor(state_at, dtype=torch.long)

    o, final, states = chunk_gated_delta_rule(**x, cu_seqlens=cu, initial_state=h0, state_at=at, chunk_size=chunk_size)
    o_ref, final_ref, states_ref = naive_chunk_gated_delta_rule(**x, cu_seqlens=cu, initial_state=h0, state_at=at)

    assert_close(o, o_ref)
    assert_close(final, final_ref)
    assert_close(states, states_ref)
    assert torch.equal(h0, h0_before), "initial_state must not be modified"


def test_state_at_is_the_state_after_that_prefix():
    """The state captured after token p equals running the loop on the tokens up to p alone."""
    lens, Hv, dk, dv = [40, 90], 2, 8, 6
    x = make_inputs(sum(lens), Hv, dk, dv, seed=1)
    cu = cu_seqlens_of(lens)
    h0 = torch.randn(2, Hv, dk, dv)
    at = torch.tensor([0, 17, 39, 40, 77, 129])
    _, _, states = chunk_gated_delta_rule(**x, cu_seqlens=cu, initial_state=h0, state_at=at, chunk_size=16)

    for i, p in enumerate(at.tolist()):
        n = int(torch.searchsorted(cu, p, right=True)) - 1
        prefix = {name: t[cu[n] : p + 1] for name, t in x.items()}
        _, final_ref, _ = naive_chunk_gated_delta_rule(
            **prefix, cu_seqlens=torch.tensor([0, p + 1 - int(cu[n])]), initial_state=h0[n : n + 1]
        )
        assert_close(states[i], final_ref[0])


def test_resuming_from_a_captured_state_matches_one_long_run():
    T, cut, Hv, dk, dv = 150, 70, 2, 16, 16
    x = make_inputs(T, Hv, dk, dv, seed=2)
    h0 = torch.zeros(1, Hv, dk, dv)
    o_full, final_full, (mid,) = chunk_gated_delta_rule(
        **x, cu_seqlens=torch.tensor([0, T]), initial_state=h0, state_at=torch.tensor([cut - 1])
    )
    rest = {name: t[cut:] for name, t in x.items()}
    o_rest, final_rest, _ = chunk_gated_delta_rule(
        **rest, cu_seqlens=torch.tensor([0, T - cut]), initial_state=mid[None]
    )
    assert_close(o_rest, o_full[cut:])
    assert_close(final_rest, final_full)


def test_low_precision_inputs_compute_in_float32():
    x = make_inputs(50, 2, 8, 8, seed=3)
    x16 = {name: t.to(torch.bfloat16) for name, t in x.items()}
    cu, h0 = torch.tensor([0, 50]), torch.randn(1, 2, 8, 8)
    o, final, _ = chunk_gated_delta_rule(**x16, cu_seqlens=cu, initial_state=h0, chunk_size=16)
    o_ref, final_ref, _ = naive_chunk_gated_delta_rule(**x16, cu_seqlens=cu, initial_state=h0)
    assert_close(o, o_ref)
    assert_close(final, final_ref)


def transformers_layout(x: dict[str, torch.Tensor], dk: int, r: int) -> dict[str, torch.Tensor]:
    """Our inputs as transformers takes them: [1, T, ...], q unscaled (it scales by dk^-0.5 itself), and
    q/k with Hk = Hv / r heads (it repeat-interleaves them r times)."""
    return {
        "query": (x["q"] * dk**0.5)[:, ::r][None],
        "key": x["k"][:, ::r][None],
        "value": x["v"][None],
        "g": x["g"][None],
        "beta": x["beta"][None],
    }


def grouped_inputs(T: int, Hk: int, r: int, dk: int, dv: int, seed: int) -> dict[str, torch.Tensor]:
    """Inputs whose Hv = Hk·r query/key heads are each key head repeated r times, as the model feeds them."""
    x = make_inputs(T, Hk * r, dk, dv, seed)
    x["q"] = x["q"][:, ::r].repeat_interleave(r, dim=1)
    x["k"] = x["k"][:, ::r].repeat_interleave(r, dim=1)
    return x


@pytest.mark.parametrize("T", [1, 50, 200])
def test_chunk_matches_transformers(T):
    Hk, r, dk, dv = 2, 2, 16, 8
    x = grouped_inputs(T, Hk, r, dk, dv, seed=4)
    h0 = torch.randn(1, Hk * r, dk, dv)
    o, final, _ = chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, T]), initial_state=h0)
    o_ref, final_ref = torch_chunk_gated_delta_rule(
        **transformers_layout(x, dk, r),
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    assert_close(o, o_ref[0])
    assert_close(final, final_ref)


@pytest.mark.parametrize("N, Hv, dk, dv", [(1, 2, 8, 8), (5, 3, 16, 4)])
def test_recurrent_step_matches_naive(N, Hv, dk, dv):
    x = make_inputs(N, Hv, dk, dv, seed=5)
    state = torch.randn(N, Hv, dk, dv)
    state_before = state.clone()
    o, new_state = recurrent_gated_delta_rule(**x, state=state)
    o_ref, new_state_ref = naive_recurrent_gated_delta_rule(**x, state=state)
    assert_close(o, o_ref)
    assert_close(new_state, new_state_ref)
    assert torch.equal(state, state_before), "state must not be modified"


def test_recurrent_steps_match_transformers():
    T, Hk, r, dk, dv = 6, 2, 2, 16, 8
    x = grouped_inputs(T, Hk, r, dk, dv, seed=6)
    state = torch.randn(1, Hk * r, dk, dv)
    o_ref, final_ref = torch_recurrent_gated_delta_rule(
        **transformers_layout(x, dk, r),
        initial_state=state.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    for t in range(T):
        o, state = recurrent_gated_delta_rule(**{name: v[t : t + 1] for name, v in x.items()}, state=state)
        assert_close(o[0], o_ref[0, t])
    assert_close(state, final_ref)


def test_decode_steps_continue_a_chunked_prefill():
    """Chunked prefill of N sequences, then batched decode steps: the same as one long run."""
    lens, steps, Hv, dk, dv = [33, 5, 70], 3, 2, 8, 8
    full = [n + steps for n in lens]
    x = make_inputs(sum(full), Hv, dk, dv, seed=7)
    cu_full = cu_seqlens_of(full)
    h0 = torch.randn(len(lens), Hv, dk, dv)
    o_ref, final_ref, _ = naive_chunk_gated_delta_rule(**x, cu_seqlens=cu_full, initial_state=h0)

    prefill_rows = torch.cat([torch.arange(int(c), int(c) + n) for c, n in zip(cu_full[:-1], lens, strict=True)])
    _, state, _ = chunk_gated_delta_rule(
        **{name: t[prefill_rows] for name, t in x.items()},
        cu_seqlens=cu_seqlens_of(lens),
        initial_state=h0,
        chunk_size=16,
    )
    for s in range(steps):
        rows = cu_full[:-1] + torch.tensor(lens) + s
        o, state = recurrent_gated_delta_rule(**{name: t[rows] for name, t in x.items()}, state=state)
        assert_close(o, o_ref[rows])
    assert_close(state, final_ref)


@pytest.mark.parametrize("n", [1, 16, 37, 64])
def test_unit_lower_inverse_inverts(n):
    # A UT-transform system as the chunked rule builds it: I + strict_lower(diag(β) K Kᵀ ⊙ decay).
    gen = torch.Generator().manual_seed(n)
    k = F.normalize(torch.randn(3, 4, n, 16, generator=gen), dim=-1)
    beta, g_cum = torch.rand(3, 4, n, generator=gen), -torch.rand(3, 4, n, generator=gen).mul(0.2).cumsum(-1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).exp()
    a = torch.eye(n) + ((beta[..., None] * k) @ k.transpose(-1, -2) * decay).tril(-1)
    a_before = a.clone()
    inv = _unit_lower_inverse(a)
    assert torch.equal(a, a_before)
    assert_close(inv, torch.linalg.inv(a.double()).float(), rel=1e-5)
    assert torch.equal(inv.triu(1), torch.zeros_like(inv))
