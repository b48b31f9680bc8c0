"""A decoder layer's step in one C++ call (`native.decode_layer`) against the same layer run op by
op: the same kernels in the same order, so the logits must be bitwise equal, through decode steps,
batched steps with snapshots, forks, truncation and short multi-token feeds (which run the layer
loop too); and transformers stays the reference for the fused path."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_logits, make_hf_model, max_rel_err, save_checkpoint
from qwen35_reference import make_qwen35, qwen35_logits, save_qwen35

from hybridkv import CacheConfig, CachedModel
from hybridkv.models import qwen3_next
from hybridkv.models.qwen3_next import layers_op_by_op
from hybridkv.ops import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")

GGUF = Path(__file__).parents[1] / "data" / "gguf"


def _program(cm: CachedModel) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill two sequences, decode them together (snapshots every 2 tokens), fork one, decode
    three, truncate the second to a snapshot and feed it 3 tokens at once, then prefill a fourth
    sequence with 40 tokens and a fifth and sixth together with 17 and 19: every logits row
    produced, and the second sequence's tokens (the 3-token feed's rows are out[-4])."""
    gen = torch.Generator().manual_seed(1)
    V = cm.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=gen).tolist()

    out: list[torch.Tensor] = []
    a, b = cm.new_sequence(), cm.new_sequence()
    rows = cm.feed({a: ids(7), b: ids(11)}, logits="last")
    out += [rows[a], rows[b]]
    for _ in range(4):
        rows = cm.feed({a: ids(1), b: ids(1)}, logits="last")
        out += [rows[a], rows[b]]
    c = cm.fork(a)
    for _ in range(3):
        rows = cm.feed({a: ids(1), b: ids(1), c: ids(1)}, logits="last")
        out += [rows[s] for s in (a, b, c)]
    point = cm.restore_point(b, cm.length(b) - 1)
    cm.truncate(b, point)
    out.append(cm.feed({b: ids(3)}, logits="all")[b])
    d = cm.new_sequence()  # a chunk past FEW_ROWS: block-quantized layers still run in C++ (CHUNK_ROWS)
    out.append(cm.feed({d: ids(40)}, logits="all")[d])
    e, f = cm.new_sequence(), cm.new_sequence()  # two sequences' chunks in one forward of 36 tokens
    rows = cm.feed({e: ids(17), f: ids(19)}, logits="all")
    out += [rows[e], rows[f]]
    cm.cache.check_integrity()
    return out, cm.tokens(b)


def _run(cm: CachedModel, fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[int], int]:
    """The program's logits and tokens on `cm`, with layers in one call or op by op, and how many
    layer calls went to `native.decode_layer`."""
    calls = 0
    real = native.decode_layer

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal calls
        calls += 1 if len(args) == 6 else len(args[6]) // 4  # counts: 4 a layer
        return real(*args)

    with monkeypatch.context() as m, contextlib.nullcontext() if fused else layers_op_by_op():
        m.setattr(native, "decode_layer", counted)
        rows, tokens = _program(cm)
        return rows, tokens, calls


def _load_both(path: Path, **kwargs: Any) -> tuple[CachedModel, CachedModel]:
    cache = CacheConfig(snapshot_interval=2, max_model_len=64, block_size=4)
    return CachedModel.load(path, cache=cache, **kwargs), CachedModel.load(path, cache=cache, **kwargs)


def _assert_same(fused: list[torch.Tensor], op_by_op: list[torch.Tensor]) -> None:
    assert len(fused) == len(op_by_op)
    for i, (got, want) in enumerate(zip(fused, op_by_op, strict=True)):
        assert torch.equal(got, want), f"logits row set {i} differs: {float((got - want).abs().max())}"


@pytest.mark.parametrize(
    ("dtype", "quantize"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "q8_0")],
    ids=["float32", "bfloat16", "q8_0"],
)
def test_qwen3_next_layers_in_one_call_equal_op_by_op(
    dtype: torch.dtype, quantize: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = make_hf_model(seed=3)
    one, two = _load_both(save_checkpoint(hf, tmp_path, dtype), dtype=dtype, quantize=quantize)
    fused, tokens, calls = _run(one, True, monkeypatch)
    op_by_op, _, none = _run(two, False, monkeypatch)
    layers = len(one.model.layers)
    # the 18-token prefill, 4 + 3 decode steps and the 3-token feed: each a forward of <= 32 tokens;
    # with bfloat16 weights only decode steps have float32 activations, the rest run op by op; the
    # 40- and 36-token prefills too (a Qwen3-Next's layers are expert layers: not past FEW_ROWS)
    forwards = 4 + 3 if dtype == torch.bfloat16 else 1 + 4 + 3 + 1
    assert (calls, none) == (forwards * layers, 0)
    _assert_same(fused, op_by_op)
    if dtype == torch.float32 and quantize is None:  # the fused path is also transformers'
        seq_rows = fused[-4]
        assert max_rel_err(seq_rows, hf_logits(hf, tokens)[-3:]) <= 1e-4


@pytest.mark.parametrize("quantize", [None, "q4_k"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen35_layers_in_one_call_equal_op_by_op(
    moe: bool, quantize: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 256 wide, so at q4_k every projection is Q4_K (K-quant parts in one call), the experts too
    width = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    hf = make_qwen35(moe=moe, seed=4, **width)
    one, two = _load_both(save_qwen35(hf, tmp_path), quantize=quantize)
    fused, tokens, calls = _run(one, True, monkeypatch)
    plans = [layer._native_plan for layer in one.model.layers]
    assert all(plan is not None and plan.usable for plan in plans)
    assert all(plan is not None and plan.with_ffn for plan in plans)
    op_by_op, _, _ = _run(two, False, monkeypatch)
    # the 40- and 36-token prefills in C++ too where every projection is block-quantized (CHUNK_ROWS)
    assert calls == (11 if quantize is not None else 9) * len(plans)
    _assert_same(fused, op_by_op)
    if quantize is None:
        assert max_rel_err(fused[-4], qwen35_logits(hf, tokens)[-3:]) <= 1e-4
    elif not moe:  # the 40 tokens as before CHUNK_ROWS: op by op past FEW_ROWS, SDPA's attention
        monkeypatch.setattr(qwen3_next, "CHUNK_ROWS", qwen3_next.FEW_ROWS)
        three, _ = _load_both(save_qwen35(hf, tmp_path / "sdpa"), quantize=quantize)
        sdpa, _, short = _run(three, True, monkeypatch)
        assert short == 9 * len(plans)
        _assert_same(fused[:-3], sdpa[:-3])
        for got, want in zip(fused[-3:], sdpa[-3:], strict=True):
            assert max_rel_err(got, want) <= 1e-5


@pytest.mark.parametrize(
    "name",
    [
        "qwen35moe-k-q4_k_m.gguf",
        "qwen35moe-k-q2_k.gguf",
        "qwen3next-wide-q4_k_m.gguf",
        "qwen35moe-tiny-q8_0.gguf",
        "qwen35-tiny-q8_0.gguf",
    ],
)
def test_llama_cpp_files_layers_in_one_call_equal_op_by_op(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp's converter and quantizer's files (tests/data/gguf): their type mixtures, experts
    # of K-quants and 32-weight types, per-layer fallbacks
    one, two = _load_both(GGUF / name)
    fused, _, calls = _run(one, True, monkeypatch)
    plans = [layer._native_plan for layer in one.model.layers]
    assert all(plan is not None and plan.usable and plan.with_ffn for plan in plans), [
        (plan.usable, plan.with_ffn) for plan in plans if plan is not None
    ]
    # the 40- and 36-token prefills too (CHUNK_ROWS), but where a projection stays float (the tiny
    # MoE file's shared expert down: rows too narrow for its blocks)
    assert calls == (9 if name == "qwen35moe-tiny-q8_0.gguf" else 11) * len(plans)
    op_by_op, _, _ = _run(two, False, monkeypatch)
    _assert_same(fused, op_by_op)


def test_a_replaced_weight_rebuilds_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = make_hf_model(seed=5)
    one, two = _load_both(save_checkpoint(hf, tmp_path))
    _run(one, True, monkeypatch)
    layer = one.model.layers[0]
    first = layer._native_plan
    assert first is not None
    for cm in (one, two):  # the same new out_proj in both: a plan built on the old one would not see it
        mixer = cm.model.layers[0].mixer
        mixer.out_proj = torch.nn.Parameter(mixer.out_proj.detach() * 0.5, requires_grad=False)
    fused, _, _ = _run(one, True, monkeypatch)
    assert layer._native_plan is not first
    op_by_op, _, _ = _run(two, False, monkeypatch)
    _assert_same(fused, op_by_op)


def test_a_projection_without_one_kernel_runs_op_by_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = make_hf_model(seed=6)
    cm = CachedModel.load(save_checkpoint(hf, tmp_path))
    monkeypatch.setattr(qwen3_next, "native_plan", lambda w: None)
    rows, tokens, calls = _run(cm, True, monkeypatch)
    assert calls == 0
    assert all(not layer._native_plan.usable for layer in cm.model.layers)
    assert max_rel_err(rows[-4], hf_logits(hf, tokens)[-3:]) <= 1e-4


def test_a_bad_plan_is_an_error_naming_it_and_changes_no_cache() -> None:
    x, w = torch.zeros(1, 8), torch.zeros(8, 8)
    attention = [1, 0, 2, 0, 0]  # attention, no feed-forward, H = 2, float qkv_proj and o_proj
    layer = [w, torch.ones(4), torch.ones(4), w, torch.ones(8)]  # qkv, q_norm, k_norm, o_proj, post_norm
    k_pool = torch.zeros(2, 4, 1, 4)
    step = [
        torch.zeros(1, 4),
        torch.zeros(1, 4),
        k_pool,
        k_pool.clone(),
        torch.tensor([0]),
        torch.zeros(1, 2),
        torch.ones(1),
    ]
    for plan, weights, scalars, message in [
        ([7, 0], [], [], "unknown mixer kind 7"),
        ([1, 5], [], [], "unknown feed-forward kind 5"),
        ([0, 0], [], [], "the plan ends early"),
        ([1, 0, 2, 9, 0], layer, [], "unknown projection kind 9"),
        ([1, 0, 2, 3, 1, 7, 0], layer, [], "unknown projection part kind 7"),
        ([1, 0, 2, 3, 0, 0], layer, [], "a projection of 0 parts"),
        (attention, layer[:4], [], "reads more than the 4 weights given"),
        (attention, [*layer, w], [1e-6, 0.5, 1e-6], "the plan reads 5 of 6 weights and 5 of 5 integers"),
        (attention, layer, [1e-6], "this layer takes 3 scalars, got 1"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            native.decode_layer(x, x, weights, plan, scalars, step)
    with pytest.raises(RuntimeError, match="takes 7 step tensors, got 6"):
        native.decode_layer(x, x, layer, attention, [1e-6, 0.5, 1e-6], step[:6])
    scalars = [1e-6, 0.5, 1e-6]
    with pytest.raises(RuntimeError, match="counts are 4 a layer, got 3"):
        native.decode_layer(x, x, layer, attention, scalars, step, [5, 5, 3])
    with pytest.raises(RuntimeError, match="layer 0's counts run past the lists"):
        native.decode_layer(x, x, layer, attention, scalars, step, [6, 5, 3, 7])
    with pytest.raises(RuntimeError, match="layer 0 leaves its feed-forward to the caller"):
        native.decode_layer(x, x, layer, attention, scalars, step, [5, 5, 3, 7])
    with pytest.raises(RuntimeError, match="x and normed must be float32"):
        native.decode_layer(x, x.double(), layer, attention, [1e-6, 0.5, 1e-6], step)
    assert not k_pool.any()  # nothing written
