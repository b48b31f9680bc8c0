"""The C++ decode kernels against their PyTorch twins, and the model through both paths against
transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_logits, make_hf_model, max_rel_err, save_checkpoint
from op_checks import assert_close, cu_seqlens_of
from op_checks import threads as op_threads

from hybridkv import CacheConfig, CachedModel
from hybridkv.models.qwen3_next import _rope
from hybridkv.ops import native
from hybridkv.ops.attention import paged_attention
from hybridkv.ops.conv import causal_conv1d
from hybridkv.ops.delta_rule import chunk_gated_delta_rule
from hybridkv.ops.moe import moe_block

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")


@pytest.mark.parametrize("T", [0, 1, 2, 5, 6, 7, 8, 9, 13, 32])
@pytest.mark.parametrize(("D", "N"), [(64, 64), (48, 200), (37, 17), (512, 1552), (16, 5), (70, 9001), (1030, 1100)])
def test_rows_matmul_equals_matmul(T: int, D: int, N: int) -> None:
    # T covers split-depth (one row; up to 8 rows on AVX-512 for weights over 4 MiB: the last
    # shape) and column strips; N whole 64-column tiles, 16-column tails, single columns and
    # several column blocks; D a ragged last group of 4 rows.
    gen = torch.Generator().manual_seed(T * 1000 + N)
    x, w = torch.randn(T, D, generator=gen), torch.randn(D, N, generator=gen)
    assert_close(native.rows_matmul(x, w), x @ w, rel=1e-5 * D**0.5)


# split-depth for one row (rows of w shorter than a page one at a time, longer 4 at a time) and up
# to 8 rows over 4 MiB (N = 23000); 64-column tiles beyond
@pytest.mark.parametrize(
    ("T", "N"), [(1, 300), (1, 8200), (3, 300), (3, 23000), (4, 300), (8, 300), (8, 23000), (16, 300)]
)
def test_rows_matmul_bf16_weights_match_the_upcast_product(T: int, N: int) -> None:
    gen = torch.Generator().manual_seed(T)
    x, w = torch.randn(T, 96, generator=gen), torch.randn(96, N, generator=gen).bfloat16()
    assert_close(native.rows_matmul(x, w), x @ w.float(), rel=1e-5 * 96**0.5)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 16, 32])
@pytest.mark.parametrize(("N", "D"), [(64, 64), (17, 37), (9, 1024), (9001, 70), (5, 16)])
def test_rows_matmul_t_equals_linear(T: int, N: int, D: int) -> None:
    # N covers 8-row groups (one row of x), 4-row groups and single rows; D whole vectors and tails.
    gen = torch.Generator().manual_seed(T * 1000 + N)
    x, w = torch.randn(T, D, generator=gen), torch.randn(N, D, generator=gen)
    assert_close(native.rows_matmul_t(x, w), F.linear(x, w), rel=1e-5 * D**0.5)


@pytest.mark.parametrize("T", [1, 5])
def test_rows_matmul_t_bf16_weights_match_the_upcast_product(T: int) -> None:
    gen = torch.Generator().manual_seed(T)
    x, w = torch.randn(T, 96, generator=gen), torch.randn(300, 96, generator=gen).bfloat16()
    assert_close(native.rows_matmul_t(x, w), F.linear(x, w.float()), rel=1e-5 * 96**0.5)


@pytest.mark.parametrize("T", [1, 2, 3, 5])
@pytest.mark.parametrize(("N", "D"), [(300, 96), (9001, 70), (13, 1024)])
def test_rows_matmul_t_bf16_activations_and_weights_match_the_float64_product(T: int, N: int, D: int) -> None:
    """Both in bfloat16: the pair products of AVX512-BF16 where the CPU has it (D in 32s, and a
    tail), else the widening path; the same exact products either way, summed in float32."""
    gen = torch.Generator().manual_seed(T * 7 + N)
    x, w = torch.randn(T, D, generator=gen).bfloat16(), torch.randn(N, D, generator=gen).bfloat16()
    want = (x.double() @ w.double().T).float()
    assert_close(native.rows_matmul_t(x, w), want, rel=1e-5 * D**0.5)


@pytest.mark.parametrize("widen_block", [8192, 7])  # one block, and blocks with a ragged last one
def test_bf16_prefill_products_without_a_bf16_gemm_run_in_float32(monkeypatch, widen_block: int) -> None:
    from hybridkv.ops import matmul

    monkeypatch.setattr(matmul, "BF16_GEMM", False)
    monkeypatch.setattr(matmul, "WIDEN_BLOCK", widen_block)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 64, generator=gen).bfloat16(), torch.randn(64, 50, generator=gen).bfloat16()
    y = matmul.mm(x, w)
    assert y.dtype == torch.bfloat16
    assert_close(y.float(), x.float() @ w.float(), rel=1e-2)  # the result rounded to bfloat16 once
    assert_close(matmul.mm_t(x, w.mT.contiguous()), x.float() @ w.float(), rel=1e-5 * 64**0.5)


@pytest.mark.parametrize("onednn", [True, False])
def test_float32_prefill_products_equal_the_float64_product(monkeypatch, onednn: bool) -> None:
    """Many rows go to oneDNN's linear on the weight as stored (`mm`: [in, out], read through a
    transposed view; `mm_t`: [out, in]) or, where it does not run, to MKL: the same product."""
    from hybridkv.ops import matmul

    assert matmul.ONEDNN_F32  # this CPU build of torch has it: the first case runs it
    monkeypatch.setattr(matmul, "ONEDNN_F32", onednn)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(70, 96, generator=gen), torch.randn(96, 130, generator=gen)
    want = (x.double() @ w.double()).float()
    assert_close(matmul.mm(x, w), want, rel=1e-5 * 96**0.5)
    assert_close(matmul.mm(x[:, ::2], w[::2]), (x[:, ::2].double() @ w[::2].double()).float(), rel=1e-5 * 48**0.5)
    assert_close(matmul.mm_t(x, w.T.contiguous()), want, rel=1e-5 * 96**0.5)


def test_rows_matmul_t_rejects_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"x \[T, D\] @ w \[N, D\]\^T"):
        native.rows_matmul_t(torch.randn(2, 8), torch.randn(4, 9))


def test_rows_matmul_rejects_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"x \[T, D\] @ w \[D, N\]"):
        native.rows_matmul(torch.randn(2, 8), torch.randn(9, 4))


@pytest.mark.parametrize(
    ("T", "threads"),
    # 100: experts with few and many rows; 300: all many; 7 threads on 3 experts: each expert's
    # depth split over threads (decode on a many-core CPU)
    [(1, None), (3, None), (16, None), (32, None), (100, None), (300, None), (1, 7), (2, 7)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_block_equals_pytorch_path(
    T: int, threads: int | None, dtype: torch.dtype, norm_topk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    E, D, I, Is, k = 8, 64, 40, 24, 3
    gen = torch.Generator().manual_seed(T)

    def weight(*shape: int) -> torch.Tensor:
        return (0.2 * torch.randn(*shape, generator=gen)).to(dtype)

    x = torch.randn(T, D, generator=gen)
    weights = (weight(D, E + 1 + 2 * Is), weight(E, D, 2 * I), weight(E, I, D), weight(Is, D))
    with op_threads(threads):
        got = native.moe_block(x, *weights, k, norm_topk)
    monkeypatch.setattr(native, "disabled", True)
    want = moe_block(x, *(w.float() for w in weights), k, norm_topk)
    assert_close(got, want, rel=1e-5)


def test_moe_block_names_what_does_not_match() -> None:
    D, E, I, Is = 8, 4, 3, 2
    gate_in, gate_up, down = torch.randn(D, E + 1 + 2 * Is), torch.randn(E, D, 2 * I), torch.randn(E, I, D)
    with pytest.raises(RuntimeError, match="top_k 5 must be in 1..4"):
        native.moe_block(torch.randn(1, D), gate_in, gate_up, down, torch.randn(Is, D), 5, True)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        native.moe_block(torch.randn(1, D), gate_in, gate_up, down[:, :2], torch.randn(Is, D), 2, True)


def _gdn_pytorch(mixed, conv_w, A_log, dt_bias, norm_w, eps, Hk, dk, conv, delta, cu, at):  # type: ignore[no-untyped-def]
    """GatedDeltaNet after in_proj with the PyTorch ops (the model's fallback path), chunked delta rule."""
    T, Hv, dv, C = mixed.shape[0], A_log.shape[0], norm_w.shape[0], conv_w.shape[0]
    qkv, z, b, a = mixed.split([C, Hv * dv, Hv, Hv], dim=-1)
    y, new_conv, conv_snaps = causal_conv1d(qkv, conv_w, cu, conv, state_at=at)
    qk, v = y.split([2 * Hk * dk, Hv * dv], dim=-1)
    qk = F.normalize(qk.reshape(T, 2 * Hk, dk), dim=-1, eps=0) * torch.tensor([dk**-0.5] * Hk + [1.0] * Hk)[:, None]
    qk = qk.repeat_interleave(Hv // Hk, dim=1)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    o, new_delta, delta_snaps = chunk_gated_delta_rule(
        qk[:, :Hv], qk[:, Hv:], v.reshape(T, Hv, dv), g, b.sigmoid(), cu, delta, state_at=at, chunk_size=16
    )
    o = F.rms_norm(o, (dv,), norm_w, eps) * F.silu(z.reshape(T, Hv, dv))
    return o.reshape(T, Hv * dv), new_conv, new_delta, conv_snaps, delta_snaps


@pytest.mark.parametrize(
    ("lens", "at"),
    [
        ([1, 1, 1], [0, 2]),  # a decode step: one token per sequence
        ([1], []),
        ([5, 1, 40], [0, 3, 4, 4, 5, 6, 25, 45]),  # first/last tokens, one token twice, a 1-token sequence
        ([70], [1, 2, 69]),  # before the conv window is full
    ],
)
@pytest.mark.parametrize(
    ("Hk", "Hv", "dk", "dv", "K"),
    [
        (2, 4, 16, 8, 4),
        (1, 1, 8, 8, 4),  # C = 24: a whole block of 16 channels and a partial one
        (4, 8, 64, 64, 4),
        (1, 2, 16, 144, 3),  # whole 128-wide rows of the state and a 16-wide rest; conv kernel 3
        (2, 2, 16, 128, 2),  # conv kernel 2: a window of one
        (1, 1, 16, 16, 5),  # conv kernel 5: the window's length at run time
        (1, 1, 16, 16, 10),  # conv kernel 10: more taps than the permute tables take, lane by lane
    ],
)
def test_gdn_forward_equals_pytorch_path_and_updates_slots_and_snapshots(
    lens: list[int], at: list[int], Hk: int, Hv: int, dk: int, dv: int, K: int
) -> None:
    _check_gdn_forward(lens, at, Hk, Hv, dk, dv, K)


def _check_gdn_forward(
    lens: list[int], at: list[int], Hk: int, Hv: int, dk: int, dv: int, K: int, gates: tuple[float, float] | None = None
) -> None:
    """`gdn_forward` against the PyTorch twin on random inputs: outputs, the slots it updates (and
    only those), the snapshots it writes (and only those). gates (a_shift, A_log): the decay
    gate's input shifted by a_shift, every head's A_log set, dt_bias 0 (else all random)."""
    T, N, C, slots_total, snaps_total = sum(lens), len(lens), 2 * Hk * dk + Hv * dv, 7, 9
    gen = torch.Generator().manual_seed(Hv * 10 + T)
    mixed = torch.randn(T, C + Hv * dv + 2 * Hv, generator=gen)
    conv_w, A_log, dt_bias = torch.randn(C, K, generator=gen), torch.randn(Hv, generator=gen), torch.randn(Hv)
    if gates is not None:
        mixed[:, -Hv:] += gates[0]  # the decay gate's input a
        A_log, dt_bias = torch.full((Hv,), gates[1]), torch.zeros(Hv)
    norm_w = torch.rand(dv, generator=gen) + 0.5
    conv_pool = torch.randn(slots_total, C, K - 1, generator=gen)
    delta_pool = 0.3 * torch.randn(slots_total, Hv, dk, dv, generator=gen)
    snap_conv, snap_delta = torch.zeros(snaps_total, C, K - 1), torch.zeros(snaps_total, Hv, dk, dv)
    slots, cu = torch.tensor([6, 0, 3][:N]), cu_seqlens_of(lens)
    snapshot_at = torch.tensor(at, dtype=torch.int64)
    snapshot_ids = torch.tensor([8, 1, 4, 0, 7, 2, 5, 3][: len(at)], dtype=torch.int64)
    before_conv, before_delta = conv_pool.clone(), delta_pool.clone()

    o, new_conv, new_delta, conv_snaps, delta_snaps = _gdn_pytorch(
        mixed, conv_w, A_log, dt_bias, norm_w, 1e-6, Hk, dk, conv_pool[slots], delta_pool[slots], cu, snapshot_at
    )
    got = native.gdn_forward(
        mixed, conv_w, A_log, dt_bias, norm_w, 1e-6, Hk, dk,
        (conv_pool, delta_pool, snap_conv, snap_delta), slots, cu, snapshot_at, snapshot_ids,
    )  # fmt: skip

    assert_close(got, o, rel=1e-4)
    assert_close(conv_pool[slots], new_conv, rel=1e-6)
    assert_close(delta_pool[slots], new_delta, rel=1e-4)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(conv_pool[untouched], before_conv[untouched])
    assert torch.equal(delta_pool[untouched], before_delta[untouched])
    assert_close(snap_conv[snapshot_ids], conv_snaps, rel=1e-6)
    assert_close(snap_delta[snapshot_ids], delta_snaps, rel=1e-4)
    others = [s for s in range(snaps_total) if s not in snapshot_ids.tolist()]
    assert not snap_conv[others].any() and not snap_delta[others].any()


def test_gdn_forward_names_bad_snapshot_positions() -> None:
    C, Hv, dv = 2 * 8 + 8, 1, 8
    pools = (torch.zeros(2, C, 3), torch.zeros(2, 1, 8, 8), torch.zeros(2, C, 3), torch.zeros(2, 1, 8, 8))
    args = (torch.randn(4, C + Hv * dv + 2 * Hv), torch.randn(C, 4), torch.zeros(1), torch.zeros(1), torch.ones(8))
    with pytest.raises(RuntimeError, match="snap_tokens must be ascending"):
        native.gdn_forward(*args, 1e-6, 1, 8, pools, torch.tensor([0]), torch.tensor([0, 4]), torch.tensor([3, 1]),
                           torch.tensor([0, 1]))  # fmt: skip


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "pytorch"])
def test_decode_batches_and_snapshots_match_transformers_on_both_paths(
    use_kernels: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not use_kernels:
        monkeypatch.setattr(native, "disabled", True)
        monkeypatch.setattr(native, "_ops", lambda: pytest.fail("a C++ kernel ran with the kernels disabled"))
    hf = make_hf_model(seed=5)
    cm = CachedModel.load(
        save_checkpoint(hf, tmp_path), cache=CacheConfig(snapshot_interval=2, max_model_len=64, block_size=4)
    )
    gen = torch.Generator().manual_seed(0)
    seqs = [cm.new_sequence() for _ in range(3)]
    cm.feed({s: torch.randint(0, 128, (5 + 3 * i,), generator=gen).tolist() for i, s in enumerate(seqs)})
    for _ in range(6):  # batched decode steps, snapshots every 2 tokens
        step = {s: [int(torch.randint(0, 128, (1,), generator=gen))] for s in seqs}
        rows = cm.feed(step, logits="last")
        for s in seqs:
            assert max_rel_err(rows[s], hf_logits(hf, cm.tokens(s))[-1:]) <= 1e-4
    seq = seqs[2]  # 11 prompt tokens, then 6 decoded
    decoded_snapshots = [p for p in range(12, cm.length(seq)) if cm.restore_point(seq, p) == p]
    assert decoded_snapshots, "decode steps wrote no snapshot"
    assert cm.truncate(seq, decoded_snapshots[0]) == decoded_snapshots[0]  # restored, nothing recomputed
    rows = cm.feed({seq: [7, 8, 9]}, logits="all")[seq]
    assert max_rel_err(rows, hf_logits(hf, cm.tokens(seq))[-3:]) <= 1e-4
    cm.cache.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 37), (3, 4, 16), (70, 48), (9, 8, 32)])
def test_rms_norm_equals_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=gen).to(dtype), torch.rand(shape[-1], generator=gen) + 0.5
    want = F.rms_norm(x.float(), (shape[-1],), w, 1e-6).to(dtype)
    assert_close(native.rms_norm(x, w, 1e-6), want, rel=1e-5 if dtype == torch.float32 else 1e-2, dtype=dtype)


def test_norms_of_many_rows_do_not_depend_on_the_threads() -> None:
    """Prefill chunks' norms split their rows over threads (from 32 rows): each row the same bits."""
    gen = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(200, 96, generator=gen), torch.randn(200, 96, generator=gen), torch.rand(96, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.rms_norm(x, w, 1e-6), *native.add_rms_norm(x, d, w, 1e-6)
        torch.set_num_threads(max(2, threads))
        many = native.rms_norm(x, w, 1e-6), *native.add_rms_norm(x, d, w, 1e-6)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(one[1], x + d)
    assert torch.equal(one[0][:5], native.rms_norm(x[:5], w, 1e-6))  # the few-row call: the same rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 37)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(shape[0])
    x, delta = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(shape[-1], generator=gen) + 0.5
    total, normed = native.add_rms_norm(x, delta, w, 1e-6)
    assert total.dtype == normed.dtype == dtype
    assert torch.equal(total, x + delta)  # the same numbers as the two ops, not just close
    assert torch.equal(normed, native.rms_norm(x + delta, w, 1e-6))
    assert_close(normed, F.rms_norm((x + delta).float(), (shape[-1],), w, 1e-6).to(dtype), rel=1e-2, dtype=dtype)
    with pytest.raises(RuntimeError, match="add_rms_norm: x .* and delta .* differ"):
        native.add_rms_norm(x, delta[:, :-1], w, 1e-6)


@pytest.mark.parametrize(("T", "I"), [(1, 3584), (5, 37), (32, 512), (70, 100)])  # 37, 100: tails past the vectors
def test_silu_mul_equals_the_pytorch_twin(T: int, I: int) -> None:  # noqa: E741
    gate_up = torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(I)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(native.silu_mul(gate_up), F.silu(gate) * up, rel=1e-6)
    assert_close(native.silu_mul(gate_up.T.contiguous().T), F.silu(gate) * up, rel=1e-6)  # strided input


@pytest.mark.parametrize(("T", "k", "D"), [(1, 8, 1024), (7, 3, 40), (56, 10, 100)])  # 40, 100: tails past the vectors
def test_moe_combine_equals_the_pytorch_twin(T: int, k: int, D: int) -> None:
    g = torch.Generator().manual_seed(T)
    y, shared = torch.randn(T * k, D, generator=g), torch.randn(T, D, generator=g)
    weights, gate = torch.rand(T, k, generator=g), torch.randn(T, 5, generator=g)[:, 2:3]  # a column: strided
    want = (y * weights.reshape(-1, 1)).view(T, k, D).sum(1) + shared * torch.sigmoid(gate)
    assert_close(native.moe_combine(y, weights, shared, gate), want, rel=1e-6)
    with pytest.raises(RuntimeError, match="moe_combine: y must be"):
        native.moe_combine(y[1:], weights, shared, gate)
    with pytest.raises(RuntimeError, match="float32 inputs only"):
        native.moe_combine(y, weights.double(), shared, gate)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("H", "Hkv", "hd", "rd"), [(4, 2, 16, 8), (8, 2, 64, 64), (2, 2, 24, 12)])
@pytest.mark.parametrize(
    ("seqs", "threads"),
    # (kv length after the step, tokens fed) per sequence. 1: the token attends only to itself.
    # Split over positions for the threads (at least 64 each): one token over 150 positions in 3
    # splits of 50; with 4 threads and 3 tokens, 150 in 3 and 70 in 2. Several tokens of one
    # sequence (a verify, a short chunk) are read as one group: 9 tokens over 150 positions, the
    # last splits holding positions only the later tokens see; a group beside single tokens; two
    # sequences whose lengths are one apart over other blocks (not a group). 32 and more query rows
    # a KV head (a 9-token group of 4 query heads a KV head, the 40-token chunk) take the scores
    # as a product on transposed keys (float32 pools).
    [
        ([(1, 1), (6, 1), (37, 1), (70, 1)], 2),
        ([(150, 1)], 2),
        ([(150, 1)], 8),
        ([(3, 1), (150, 1), (70, 1)], 4),
        ([(9, 9)], 2),
        ([(150, 9)], 2),
        ([(150, 9)], 8),
        ([(6, 1), (70, 5), (37, 1), (131, 3)], 4),
        ([(20, 1), (21, 1)], 2),
        ([(150, 40)], 3),
    ],
    ids=[
        "4 tokens", "1 token 2 threads", "1 token 8 threads", "3 tokens 4 threads", "a 9-token chunk",
        "9-token verify 2 threads", "9-token verify 8 threads", "groups and single tokens", "lengths one apart",
        "a 40-token chunk",
    ],
)  # fmt: skip
def test_attention_decode_equals_pytorch_step(
    H: int, Hkv: int, hd: int, rd: int, pool_dtype: torch.dtype, seqs: list[tuple[int, int]], threads: int
) -> None:
    bs, num_blocks = 4, 200
    T = sum(q for _, q in seqs)
    gen = torch.Generator().manual_seed(H * hd)
    qkv = torch.randn(T, (2 * H + 2 * Hkv) * hd, generator=gen)
    q_norm, k_norm = torch.rand(hd, generator=gen) + 0.5, torch.rand(hd, generator=gen) + 0.5
    angles = torch.rand(T, rd // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    k_pool = torch.randn(num_blocks, bs, Hkv, hd, generator=gen).to(pool_dtype)
    v_pool = torch.randn(num_blocks, bs, Hkv, hd, generator=gen).to(pool_dtype)
    # Each sequence's blocks scattered over the pool; entries past its last block are never read.
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seqs), 40, dtype=torch.int64)
    for n, (L, _) in enumerate(seqs):
        mine, blocks = blocks[: -(-L // bs)], blocks[-(-L // bs) :]
        block_tables[n, : len(mine)] = torch.tensor(mine)
    owner = torch.tensor([n for n, (_, q) in enumerate(seqs) for _ in range(q)])
    lens = torch.tensor([L - q + 1 + j for L, q in seqs for j in range(q)])  # each token's kv length
    slot_mapping = torch.tensor(
        [block_tables[n, (L - 1) // bs] * bs + (L - 1) % bs for n, L in zip(owner.tolist(), lens.tolist(), strict=True)]
    )
    # The PyTorch path: norms, RoPE, store, paged attention, gate.
    q, gate, k, v = qkv.split([H * hd, H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q = _rope(F.rms_norm(q.reshape(T, H, hd), (hd,), q_norm, 1e-6), cos, sin)
    k = _rope(F.rms_norm(k.reshape(T, Hkv, hd), (hd,), k_norm, 1e-6), cos, sin)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_k.view(-1, Hkv, hd)[slot_mapping] = k.to(pool_dtype)
    want_v.view(-1, Hkv, hd)[slot_mapping] = v.reshape(T, Hkv, hd).to(pool_dtype)
    cu = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()])
    o = paged_attention(q, want_k, want_v, block_tables, cu, torch.tensor([L for L, _ in seqs]), hd**-0.5)
    want = o.reshape(T, H * hd) * torch.sigmoid(gate)

    with op_threads(threads):
        got = native.attention_decode(
            qkv, q_norm, k_norm, 1e-6, cos, sin, (k_pool, v_pool), slot_mapping, block_tables[owner], lens, hd**-0.5, H
        )
    # A key rounded to the pool's type from a sum in another order can land one step of that type
    # away (bfloat16: 2^-8 relative, float16: 2^-11): so can what attends to it.
    rel = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (3e-3, 1e-3)}[pool_dtype]
    assert_close(got, want, rel=rel[0])
    assert_close(k_pool, want_k, rel=rel[1], dtype=pool_dtype)
    assert torch.equal(v_pool, want_v)


@pytest.mark.parametrize(
    ("a_shift", "A_log"),
    [
        (-30.0, 0.0),  # decay ~ exp(-e^-30): g stays near 1, no fold before the run's end
        (4.0, 3.0),  # decay ~ exp(-80) a token: g falls below the fold threshold at every token
        (0.0, 1.0),  # decay ~ 0.15: a fold every 7 or so tokens
    ],
)
def test_gdn_forward_holds_under_decays_that_keep_or_drop_the_state(a_shift: float, A_log: float) -> None:
    """The kernel keeps a run's state as g·P and folds g back in when g gets small: decays near 1
    (never folded until the end), near 0 (folded every token) and between give the PyTorch twin's
    outputs, state and snapshots."""
    _check_gdn_forward([45, 3], [10, 44, 46], 1, 2, 32, 64, 4, gates=(a_shift, A_log))
