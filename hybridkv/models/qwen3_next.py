"""Qwen3-Next: Gated DeltaNet and gated attention layers (3:1 by default), sparse MoE feed-forward.

Cache needs per layer kind: an attention layer writes K/V rows into the paged pools
(`batch.store_kv`, then attends over `batch.kv_pools`); a linear layer reads and writes one conv
state [N, C, K-1] and one delta state [N, Hv, dk, dv] per sequence, float32
(`batch.linear_state`, `batch.store_linear_state`), plus the states after `batch.snapshot_at`.

Weights are rearranged once at load time (`checkpoint_layout`, the one place that knows
checkpoint names) so the forward pass does a few large matmuls and plain splits. Projections are
stored transposed, [in, out], and applied as `x @ W` (`ops.matmul.mm`): at decode batch sizes that
streams at up to twice the memory bandwidth of `F.linear`'s x @ Wᵀ, and decode is bandwidth-bound.
When `ops.native` is built, a linear layer runs as one C++ kernel after in_proj (prefill and
decode, `native.gdn_forward`), and so does an attention layer's decode step (`native.attention_decode`);
a forward of up to 32 tokens (decode, verify) runs each whole decoder layer as one call of those
kernels (`native.decode_layer`, planned once per layer: `DecoderLayer.native_plan`).

    linear layer  in_proj  [D, q | k | v | z | b | a]  (the checkpoint groups qkvz and ba per key head)
    attention     qkv_proj [D, q | gate | k | v]        (the checkpoint interleaves q/gate per head)
    MoE           gate_in  [D, router E | shared gate 1 | shared gate Is | shared up Is]: one matmul
    MoE experts   gate_up [E, D, 2I] gate columns first, down [E, I, D]
    zero-centred norms stored as (1 + w) in float32
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.cache.batch import ForwardBatch
from hybridkv.models.config import ModelConfig
from hybridkv.models.weights import COMPUTE_DTYPES, Layout, Piece, WriteFn
from hybridkv.ops import native
from hybridkv.ops.attention import paged_attention
from hybridkv.ops.conv import causal_conv1d, causal_conv1d_step
from hybridkv.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from hybridkv.ops.dtypes import f32
from hybridkv.ops.matmul import FEW_ROWS, Weight, linear, mm_t, native_plan, swiglu
from hybridkv.ops.moe import PAIRS_ROWS, Experts, moe_block
from hybridkv.ops.quant.linear import QuantExperts, QuantLinear, block_matmul
from hybridkv.ops.quant.linear import floating as quant_floating
from hybridkv.ops.quant.weight import QuantizedWeight
from hybridkv.ops.thread_flag import ThreadFlag

if TYPE_CHECKING:
    from hybridkv.models.mtp import MTPBlock, MTPHidden


# A forward of up to this many tokens whose layers' projections and experts are all
# block-quantized runs them in C++ (`native.decode_layer`: attention read from the paged pools in
# place, no gather, no Python between the kernels), as a decode step does up to FEW_ROWS; expert
# layers up to PAIRS_ROWS // top_k (64 at top-8). Against op by op, onto ~1,200 held tokens (2
# threads): the 0.8B shape's Q4_K_M file at 56 tokens (a chat turn) 1.11x, 100 and 128 1.08x,
# 256 1.03x, 512 0.96x (there SDPA's attention is the faster); moe-mini's at 56 tokens 1.06x.
# Float projections keep FEW_ROWS: past it their products go to MKL either way.
CHUNK_ROWS = 128


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(torch.linalg.vecdot(x, x)[..., None] + eps)


class RMSNorm(nn.Module):
    """x / rms(x) · weight in float32, cast back to x's dtype; weight is float32 (zero-centred
    checkpoint norms are loaded as 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _weight(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.enabled(x, self.weight):  # any row count (F.rms_norm's six ops: a chat chunk 1.07x slower)
            return native.rms_norm(x, self.weight, self.eps)
        y = F.rms_norm(f32(x), self.weight.shape, self.weight, self.eps)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): a residual add and the norm after it, in one C++ call where
        `forward` would take the kernel (the same numbers)."""
        if x.shape == delta.shape and native.enabled(x, delta, self.weight):
            return native.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer: causal conv + SiLU over q|k|v, then the gated delta rule."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.index = index  # j: this layer's number among linear layers
        self.Hk, self.Hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.r = c.value_heads_per_key_head
        self.C = c.conv_channels
        # Value head h reads key head h // r (grouped, Hugging Face's order) or, when a GGUF file
        # keeps llama.cpp's tiled order for qwen35, h % Hk (`models.gguf_blocks`).
        self.tiled_heads = False
        self.in_proj: Weight = _weight(c.hidden_size, self.C + self.Hv * self.dv + 2 * self.Hv, dtype=dtype)
        self.conv_weight = _weight(self.C, c.linear_conv_kernel_dim, dtype=dtype)
        self.A_log = _weight(self.Hv, dtype=torch.float32)
        self.dt_bias = _weight(self.Hv, dtype=torch.float32)
        self.norm = RMSNorm(self.dv, c.rms_norm_eps)  # plain x̂·w, gated by silu(z)
        self.out_proj: Weight = _weight(self.Hv * self.dv, c.hidden_size, dtype=dtype)
        # Per-head scale after the joint q|k L2 norm: dk^-0.5 for the Hk query heads, 1 for the keys.
        qk_scale = torch.tensor([self.dk**-0.5] * self.Hk + [1.0] * self.Hk)[:, None]
        self.qk_scale: torch.Tensor
        self.register_buffer("qk_scale", qk_scale, persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, Hk, Hv, dk, dv = x.shape[0], self.Hk, self.Hv, self.dk, self.dv
        mixed = linear(x, self.in_proj)
        if native.enabled(mixed, self.conv_weight, self.A_log, self.dt_bias, self.norm.weight):
            o = native.gdn_forward(
                mixed, self.conv_weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps, Hk, dk,
                batch.linear_pools(self.index), batch.state_slots, batch.cu_seqlens, batch.snapshot_at,
                batch.snapshot_ids, self.tiled_heads,
            )  # fmt: skip
            return linear(o.to(x.dtype), self.out_proj)
        qkv, z, b, a = mixed.split([self.C, Hv * dv, Hv, Hv], dim=-1)
        conv_state, delta_state = batch.linear_state(self.index)

        if batch.is_decode:  # token n is sequence n: its snapshot is its new state
            y, conv_state = causal_conv1d_step(qkv, self.conv_weight, conv_state)
            conv_snaps = conv_state.index_select(0, batch.snapshot_at)
        else:
            y, conv_state, conv_snaps = causal_conv1d(
                qkv, self.conv_weight, batch.cu_seqlens, conv_state, state_at=batch.snapshot_at
            )

        qk, v = y.split([2 * Hk * dk, Hv * dv], dim=-1)
        qk = _l2norm(qk.reshape(T, 2 * Hk, dk)) * self.qk_scale  # q and k heads normalised together
        if self.r > 1 and self.tiled_heads:  # value head h reads key head h % Hk
            q, k = qk[:, :Hk].repeat(1, self.r, 1), qk[:, Hk:].repeat(1, self.r, 1)
        else:  # value head h reads key head h // r
            qk = qk.repeat_interleave(self.r, dim=1) if self.r > 1 else qk
            q, k = qk[:, :Hv], qk[:, Hv:]
        v = v.reshape(T, Hv, dv)
        g = -self.A_log.exp() * F.softplus(f32(a) + self.dt_bias)
        beta = f32(b).sigmoid()

        if batch.is_decode:
            o, delta_state = recurrent_gated_delta_rule(q, k, v, g, beta, delta_state)
            delta_snaps = delta_state.index_select(0, batch.snapshot_at)
        else:
            o, delta_state, delta_snaps = chunk_gated_delta_rule(
                q, k, v, g, beta, batch.cu_seqlens, delta_state, state_at=batch.snapshot_at
            )
        batch.store_linear_state(self.index, conv_state, delta_state, conv_snaps, delta_snaps)

        o = self.norm(o) * F.silu(f32(z).reshape(T, Hv, dv))
        return linear(o.reshape(T, Hv * dv).to(x.dtype), self.out_proj)


class GatedAttention(nn.Module):
    """Softmax attention with q/k RMSNorm, partial RoPE and a sigmoid output gate, over paged K/V."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.index = index  # a: this layer's number among attention layers
        self.H, self.Hkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.hd**-0.5
        self.qkv_proj: Weight = _weight(c.hidden_size, (2 * self.H + 2 * self.Hkv) * self.hd, dtype=dtype)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.o_proj: Weight = _weight(self.H * self.hd, c.hidden_size, dtype=dtype)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor, rows: int = FEW_ROWS
    ) -> torch.Tensor:
        qkv = linear(x, self.qkv_proj)
        if batch.num_tokens <= rows and native.enabled(qkv, self.q_norm.weight, self.k_norm.weight):
            # Decode steps, verifies and short chunks (up to `rows`: CHUNK_ROWS where the layers
            # run as `forward_normed`): each token attends as a decode step does.
            tables, kv_lens = batch.token_tables()
            o = native.attention_decode(
                qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, batch.kv_pools(self.index),
                batch.slot_mapping, tables, kv_lens, self.scale, self.H,
            )  # fmt: skip
            return linear(o.to(x.dtype), self.o_proj)
        q, gate, k, v = self.split_heads(qkv, cos, sin)
        batch.store_kv(self.index, k, v)
        k_pool, v_pool = batch.kv_pools(self.index)
        o = paged_attention(q, k_pool, v_pool, batch.block_tables, batch.cu_seqlens, batch.kv_lens, self.scale)
        return self.output(o, gate)

    def split_heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv_proj's output [T, ...] → q [T, H, hd] and k [T, Hkv, hd] normed and rotated, the
        gate [T, H·hd], v [T, Hkv, hd]."""
        T, H, Hkv, hd = qkv.shape[0], self.H, self.Hkv, self.hd
        q, gate, k, v = qkv.split([H * hd, H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = _rope(self.q_norm(q.reshape(T, H, hd)), cos, sin)
        k = _rope(self.k_norm(k.reshape(T, Hkv, hd)), cos, sin)
        return q, gate, k, v.reshape(T, Hkv, hd)

    def output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output o [T, H, hd] gated by sigmoid(gate) and projected: [T, D]."""
        return linear(o.reshape(o.shape[0], -1).to(gate.dtype) * torch.sigmoid(gate), self.o_proj)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first rd dims of x [T, heads, hd]; cos, sin [T, rd]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        E, D, I, Is = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
        self.E, self.Is, self.top_k, self.norm_topk_prob = E, Is, c.num_experts_per_tok, c.norm_topk_prob
        self.gate_in: Weight = _weight(D, E + 1 + 2 * Is, dtype=dtype)  # router | shared gate | shared gate_up
        self.gate_up: Experts = _weight(E, D, 2 * I, dtype=dtype)
        self.down: Experts = _weight(E, I, D, dtype=dtype)
        self.shared_down: Weight = _weight(Is, D, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_block(x, self.gate_in, self.gate_up, self.down, self.shared_down, self.top_k, self.norm_topk_prob)


class DenseMLP(nn.Module):
    """SwiGLU feed-forward, for layers in mlp_only_layers (or all layers when num_experts is 0)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up: Weight = _weight(config.hidden_size, 2 * config.intermediate_size, dtype=dtype)
        self.down: Weight = _weight(config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up, self.down)


_OP_BY_OP = ThreadFlag()


def layers_op_by_op() -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread) decoder layers run their kernels one call each, as modules,
    instead of one `native.decode_layer` call a layer: the same numbers, timed part by part
    (`bench.profile`)."""
    return _OP_BY_OP.set()


def _fusable(x: torch.Tensor) -> bool:
    """Whether layers may run as `native.decode_layer` calls on activations x: float32, outside
    autograd and outside `layers_op_by_op()` (each layer's plan decides the rest)."""
    return x.dtype == torch.float32 and not torch.is_grad_enabled() and not _OP_BY_OP


class DecoderLayer(nn.Module):
    """h = x + mixer(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        kind = config.layer_kinds[layer]
        self.mixer: GatedDeltaNet | GatedAttention
        if kind == "linear":
            self.mixer = GatedDeltaNet(config, config.linear_layers.index(layer), dtype)
        else:
            self.mixer = GatedAttention(config, config.attention_layers.index(layer), dtype)
        self.ffn = SparseMoE(config, dtype) if config.moe_layers[layer] else DenseMLP(config, dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._native_plan: NativePlan | None = None  # built on the first decode step (`native_plan`)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.input_norm(x), batch, cos, sin)
        return x + self.ffn(self.post_norm(x))

    def forward_normed(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` given input_norm(x) → (its output, next_norm of the output): each residual add
        taken with the norm after it (`RMSNorm.add`), for a decode step's per-layer op count. With
        float32 activations outside autograd, the C++ kernels run the layer in one call
        (`native.decode_layer`, the same kernels in the same order) where its weights allow."""
        plan = self.native_plan(next_norm) if _fusable(x) else None
        if plan is not None and x.shape[0] <= plan.max_tokens:
            h, n = native.decode_layer(x, normed, plan.weights, plan.ints, plan.scalars, self._step(batch, cos, sin))
            return (h, n) if plan.with_ffn else next_norm.add(h, self.ffn(n))
        h, n = self.post_norm.add(x, self.mix(normed, batch, cos, sin, CHUNK_ROWS))
        return next_norm.add(h, self.ffn(n))

    def native_plan(self, next_norm: RMSNorm) -> NativePlan | None:
        """This layer as `native.decode_layer` runs it before `next_norm` (see `csrc/layer.cpp`),
        built on first use and again whenever a weight or module it read was replaced; None where
        the Python would not run one kernel per part (a projection part without a kernel, or
        inside `float_activations()`)."""
        plan = self._native_plan
        if plan is None or plan.next_norm is not next_norm or not plan.current():
            plan = self._native_plan = _build_plan(self, next_norm)
        return plan if plan.usable and not quant_floating() else None

    def _step(self, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """This step's cache tensors in `decode_layer`'s order."""
        m = self.mixer
        if isinstance(m, GatedDeltaNet):
            pools = batch.linear_pools(m.index)
            return [*pools, batch.state_slots, batch.cu_seqlens, batch.snapshot_at, batch.snapshot_ids]
        return [cos, sin, *batch.kv_pools(m.index), batch.slot_mapping, *batch.token_tables()]

    def mix(
        self, normed: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor, rows: int = FEW_ROWS
    ) -> torch.Tensor:
        """The mixer's output; an attention's tokens attend as decode steps do up to `rows`."""
        if isinstance(self.mixer, GatedDeltaNet):
            return self.mixer(normed, batch)
        return self.mixer(normed, batch, cos, sin, rows)


# `csrc/layer.cpp`'s layer kinds
_DELTANET, _ATTENTION = 0, 1
_FFN_NONE, _FFN_DENSE, _FFN_MOE, _FFN_BLOCK_MOE = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class NativePlan:
    """A decoder layer as `native.decode_layer` reads it (`DecoderLayer.native_plan`)."""

    next_norm: RMSNorm
    # For every module and weight it read: the dict of its owner that held it, its name there, the
    # object. A replaced one (a module's setattr) no longer is what that dict holds under its name.
    held_in: tuple[dict[str, Any], ...]
    names: tuple[str, ...]
    held: tuple[object, ...]
    usable: bool  # False: some part has no single kernel; the layer runs op by op
    weights: list[torch.Tensor] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)
    with_ffn: bool = False  # the call runs the feed-forward and next norm too (else the caller does)
    max_tokens: int = FEW_ROWS  # forwards of more tokens run op by op (CHUNK_ROWS if block-quantized)

    def current(self) -> bool:
        """Whether every module and weight it read is still in place (C-level loops: a decode step
        checks every layer's plan)."""
        return all(map(operator.is_, map(dict.get, self.held_in, self.names), self.held))


@dataclass(frozen=True, slots=True)
class _NativeStack:
    """Every layer's `NativePlan` joined for `native.decode_layer` with counts (`Qwen3NextModel._native_stack`)."""

    plans: tuple[NativePlan, ...]  # the plans it joins: a rebuilt plan makes a new stack
    weights: list[torch.Tensor]
    ints: list[int]
    scalars: list[float]
    counts: list[int]  # per layer: weights, ints, scalars, step tensors


def _held_by(owner: nn.Module, name: str) -> tuple[dict[str, Any], str, object]:
    """(the dict of `owner` that holds attribute `name`, name, its value)."""
    for d in (owner._parameters, owner._buffers, owner._modules, vars(owner)):
        if name in d:
            return d, name, d[name]
    raise AttributeError(f"{type(owner).__name__} has no {name!r}")


def _build_plan(layer: DecoderLayer, next_norm: RMSNorm) -> NativePlan:
    m, f = layer.mixer, layer.ffn
    read = [(layer, "mixer"), (layer, "ffn"), (layer, "post_norm"), (layer.post_norm, "weight"), (next_norm, "weight")]
    if isinstance(m, GatedDeltaNet):
        read += [(m, "in_proj"), (m, "conv_weight"), (m, "A_log"), (m, "dt_bias"), (m, "norm"), (m.norm, "weight")]
        read += [(m, "out_proj")]
    else:
        read += [(m, "qkv_proj"), (m, "q_norm"), (m.q_norm, "weight"), (m, "k_norm"), (m.k_norm, "weight")]
        read += [(m, "o_proj")]
    read += [(f, name) for name in ("gate_up", "down", "gate_in", "shared_down") if hasattr(f, name)]
    held_in, names, held = zip(*(_held_by(owner, name) for owner, name in read), strict=True)
    weights: list[torch.Tensor] = []
    ints: list[int] = []

    def plan_of(w: Weight | QuantExperts) -> tuple[list[torch.Tensor], list[int]] | None:
        return w.native_plan() if isinstance(w, QuantExperts) else native_plan(w)

    floats = False  # whether some projection is a float tensor

    def add(*parts: Weight | QuantExperts) -> bool:  # projections and experts, each one kernel
        nonlocal floats
        for w in parts:
            plan = plan_of(w)
            if plan is None:
                return False
            floats = floats or isinstance(w, torch.Tensor)
            weights.extend(plan[0])
            ints.extend(plan[1])
        return True

    dense = isinstance(f, DenseMLP) and all(plan_of(w) is not None for w in (f.gate_up, f.down))
    moe = isinstance(f, SparseMoE) and all(
        isinstance(w, torch.Tensor) for w in (f.gate_in, f.gate_up, f.down, f.shared_down)
    )
    block_moe = (
        isinstance(f, SparseMoE)
        and isinstance(f.gate_up, QuantExperts)
        and isinstance(f.down, QuantExperts)
        and all(plan_of(w) is not None for w in (f.gate_in, f.gate_up, f.down, f.shared_down))
    )
    ffn = _FFN_DENSE if dense else _FFN_MOE if moe else _FFN_BLOCK_MOE if block_moe else _FFN_NONE
    ints += [_DELTANET if isinstance(m, GatedDeltaNet) else _ATTENTION, ffn]
    if isinstance(m, GatedDeltaNet):
        ints += [m.Hk, m.dk, int(m.tiled_heads)]
        usable = add(m.in_proj)
        weights += [m.conv_weight, m.A_log, m.dt_bias, m.norm.weight]
        usable = usable and add(m.out_proj)
        scalars = [m.norm.eps]
    else:
        ints += [m.H]
        usable = add(m.qkv_proj)
        weights += [m.q_norm.weight, m.k_norm.weight]
        usable = usable and add(m.o_proj)
        scalars = [m.q_norm.eps, m.scale]
    weights.append(layer.post_norm.weight)
    scalars.append(layer.post_norm.eps)
    if isinstance(f, DenseMLP) and dense:
        add(f.gate_up, f.down)
    elif isinstance(f, SparseMoE) and moe:
        ints += [f.top_k, int(f.norm_topk_prob)]
        weights += [cast(torch.Tensor, w) for w in (f.gate_in, f.gate_up, f.down, f.shared_down)]
    elif isinstance(f, SparseMoE) and block_moe:
        ints += [f.top_k, int(f.norm_topk_prob), f.E]
        add(f.gate_in, f.gate_up, f.down, f.shared_down)
    with_ffn = dense or moe or block_moe
    # CHUNK_ROWS for layers of block-quantized projections (experts of blocks too: their pairs in
    # one call per part, up to PAIRS_ROWS, as the Python takes them)
    max_tokens = CHUNK_ROWS if (dense or block_moe) and not floats else FEW_ROWS
    if isinstance(f, SparseMoE) and block_moe:  # every pair in one call per part (PAIRS_ROWS)
        max_tokens = min(max_tokens, PAIRS_ROWS // f.top_k)
    if with_ffn:
        weights.append(next_norm.weight)
        scalars.append(next_norm.eps)
    usable = usable and not any(t.requires_grad or not t.is_cpu for t in weights)
    return NativePlan(next_norm, held_in, names, held, usable, weights, ints, scalars, with_ffn, max_tokens)


class Qwen3NextModel(nn.Module):
    """Qwen3-Next causal LM: a pure function of token ids and a `ForwardBatch`.

    It never allocates cache memory: K/V and recurrent states live in the batch's pools.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, mtp: MTPHidden | None = None) -> None:
        super().__init__()
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {dtype} not supported; use torch.float32 or torch.bfloat16")
        self.config, self.dtype = config, dtype
        # [V, D]; a GGUF model may keep it in the file's blocks (rows dequantized as they are looked up)
        self.embed: torch.Tensor | QuantizedWeight = _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._stack: _NativeStack | None = None  # every layer's plan joined (`_native_stack`)
        self.lm_head: Weight | None = (  # [D, V]; a tied model multiplies by the embedding [V, D] instead
            None if config.tie_word_embeddings else _weight(config.hidden_size, config.vocab_size, dtype=dtype)
        )
        rd = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # The MTP block (`mtp`: which hidden state feeds it), when loaded for drafting: every forward
        # then also writes its K/V and the hidden carry (see `models.mtp`).
        self.mtp: MTPBlock | None = None
        if mtp is not None:
            from hybridkv.models.mtp import MTPBlock  # the block is built from this module's layers

            self.mtp = MTPBlock(config, dtype, mtp)

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [T] (flat, in the batch's token order) → logits [T or len(logits_indices), V] float32.

        Loaded parameters do not require grad, so no graph is built; scripts/train_default_model.py
        makes them trainable and runs this same forward with gradients.
        """
        if input_ids.shape != (batch.num_tokens,):
            raise ValueError(f"input_ids has shape {list(input_ids.shape)}, the batch has {batch.num_tokens} tokens")
        x = embeds = self.embed_tokens(input_ids)
        if batch.is_decode and x.dtype != torch.float32 and batch.num_tokens <= FEW_ROWS and native.enabled(x):
            # A decode step runs on the C++ kernels, which compute in float32 whatever the weights:
            # keep the activations float32 rather than cast them down and back up around every call.
            x = x.float()
        cos, sin = self.rope(batch.positions, x.dtype)
        layers = cast(list[DecoderLayer], list(self.layers))
        # (a decode step never walks the plans for `_native_rows`: FEW_ROWS is always in)
        rows = batch.num_tokens
        if len(layers) > 0 and (rows <= FEW_ROWS or rows <= self._native_rows(layers)) and native.enabled(x):
            # A decode step, a verify or (block-quantized, `CHUNK_ROWS`) a short chunk: each
            # residual add taken with the norm after it (the next layer's input norm; the final
            # norm after the last layer), half the per-layer ops around the kernels.
            normed = layers[0].input_norm(x)
            stack = self._native_stack(layers, x)
            if stack is not None:  # every layer in one call
                step = [t for layer in layers for t in layer._step(batch, cos, sin)]
                x, normed = native.decode_layer(x, normed, stack.weights, stack.ints, stack.scalars, step, stack.counts)
            else:
                for i, decoder in enumerate(layers):
                    after = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
                    x, normed = decoder.forward_normed(x, normed, batch, cos, sin, after)
        else:
            for layer in self.layers:
                x = layer(x, batch, cos, sin)
            if self.mtp is None:  # the final norm on the rows that give logits only
                if logits_indices is not None:
                    x = x.index_select(0, logits_indices)
                return self.head(self.norm(x))
            normed = self.norm(x)
        if self.mtp is not None:
            self.mtp.catch_up(embeds, normed if self.mtp.hidden == "post_norm" else x, batch, self.rope)
        if logits_indices is not None:
            normed = normed.index_select(0, logits_indices)
        return self.head(normed)

    def _native_rows(self, layers: list[DecoderLayer]) -> int:
        """The most tokens a forward runs layer by layer as `forward_normed` (each layer one
        `native.decode_layer` call where its plan allows): FEW_ROWS, or up to CHUNK_ROWS where every
        layer's plan takes that many (block-quantized projections); the same whether or not the
        layers then run fused, so `layers_op_by_op()` computes the same numbers."""
        rows = CHUNK_ROWS
        for i, layer in enumerate(layers):
            plan = layer.native_plan(layers[i + 1].input_norm if i + 1 < len(layers) else self.norm)
            rows = min(rows, plan.max_tokens if plan is not None else FEW_ROWS)
        return max(rows, FEW_ROWS)

    def _native_stack(self, layers: list[DecoderLayer], x: torch.Tensor) -> _NativeStack | None:
        """Every layer's plan joined for one `native.decode_layer` with counts call, where every layer would
        run in one call of its own with its feed-forward (else None: layer by layer)."""
        if not _fusable(x):
            return None
        plans = []
        for i, layer in enumerate(layers):
            plan = layer.native_plan(layers[i + 1].input_norm if i + 1 < len(layers) else self.norm)
            if plan is None or not plan.with_ffn or x.shape[0] > plan.max_tokens:
                return None
            plans.append(plan)
        stack = self._stack
        if (
            stack is None
            or len(stack.plans) != len(plans)
            or any(a is not b for a, b in zip(stack.plans, plans, strict=True))
        ):
            stack = self._stack = _NativeStack(
                tuple(plans),
                [t for p in plans for t in p.weights],
                [i for p in plans for i in p.ints],
                [f for p in plans for f in p.scalars],
                [
                    n
                    for p in plans
                    for n in (len(p.weights), len(p.ints), len(p.scalars), 8 if p.ints[0] == _DELTANET else 7)
                ],
            )
        return stack

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → embeddings [T, D] in the compute dtype."""
        return _embedding(input_ids, self.embed, self.dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rd] of positions [T], in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden rows [T, D] → logits [T, V] float32."""
        # A tied head multiplies by the embedding [V, D] as stored: `mm_t` reads it once per step.
        if self.lm_head is not None:
            logits = linear(x, self.lm_head)
        elif isinstance(self.embed, QuantizedWeight):
            logits = block_matmul(x, self.embed)
        else:
            logits = mm_t(x, self.embed)
        return logits.float()

    def _held(self) -> list[torch.Tensor | QuantizedWeight | QuantLinear | QuantExperts]:
        held: list[torch.Tensor | QuantizedWeight | QuantLinear | QuantExperts] = list(self.parameters())
        for module in self.modules():
            held += [v for v in vars(module).values() if isinstance(v, (QuantizedWeight, QuantLinear, QuantExperts))]
        return held

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds weights: parameters, buffers, plain tensor attributes, and the
        blocks and float parts of projections kept as a file's blocks (`ops.pages.move`)."""
        tensors: list[torch.Tensor] = list(self.buffers())
        for w in self._held():
            parts = w.parts if isinstance(w, (QuantLinear, QuantExperts)) else (w,)
            tensors += [p.blocks if isinstance(p, QuantizedWeight) else p for p in parts]
        for module in self.modules():
            tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        return tensors

    def weight_sizes(self) -> tuple[int, int]:
        """(parameters, bytes) of the weights as held: a file's blocks count their bytes."""
        held = self._held()
        numel = sum(w.numel() for w in held)
        nbytes = sum(w.nbytes for w in held)
        return numel, nbytes


def _embedding(ids: torch.Tensor, embed: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(embed, QuantizedWeight):  # the looked-up rows only
        return embed.rows(ids).to(dtype)
    return F.embedding(ids, embed)


# -- checkpoint mapping: the one place that knows Hugging Face names and layouts -----------------


def is_ignored(config: ModelConfig, name: str) -> bool:
    """Checkpoint tensors plain decoding does not use: the multi-token-prediction head, a tied lm_head."""
    return name.startswith("mtp.") or (config.tie_word_embeddings and name == "lm_head.weight")


LinearLayoutFn = Callable[[ModelConfig, str], Layout]


def _zero_centred(param: torch.Tensor, w: torch.Tensor) -> None:
    param.copy_(1.0 + w.float())


def rows(start: int, stop: int) -> WriteFn:
    def write(param: torch.Tensor, t: torch.Tensor) -> None:
        param[start:stop].copy_(t)

    return write


def _expert(e: int, start: int | None = None, stop: int | None = None) -> WriteFn:
    def write(param: torch.Tensor, t: torch.Tensor) -> None:
        param[e, start:stop].copy_(t)

    return write


def _transposed(pieces: list[Piece]) -> list[Piece]:
    """The pieces of a projection stored [in, out]: each writes its checkpoint [out, in] tensor
    through the transposed view, so the writers above keep indexing checkpoint rows."""

    def through_mT(write: WriteFn) -> WriteFn:
        return lambda param, t: write(param.mT, t)

    return [Piece(p.name, p.shape, through_mT(p.write)) for p in pieces]


def checkpoint_layout(config: ModelConfig, names: set[str]) -> Layout:
    """Our parameter name → the Hugging Face checkpoint tensors that fill it.

    `names` (the checkpoint's tensor names) picks the expert layout: released per-expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight` or fused `mlp.experts.gate_up_proj [E, 2I, D]`
    (gate rows first) / `mlp.experts.down_proj [E, D, I]`.
    """
    return decoder_layout(config, names, "model.", _linear_layout)


def decoder_layout(config: ModelConfig, names: set[str], prefix: str, linear_layout: LinearLayoutFn) -> Layout:
    """The layout of a Qwen3-Next-style decoder whose tensors are named `prefix` + `embed_tokens`,
    `layers.N.…`, `norm`; `linear_layout(config, hf)` maps a Gated DeltaNet layer's tensors."""
    c = config
    D, V = c.hidden_size, c.vocab_size
    layout: Layout = {
        "embed": [Piece(prefix + "embed_tokens.weight", (V, D))],
        "norm.weight": [Piece(prefix + "norm.weight", (D,), _zero_centred)],
    }
    if not c.tie_word_embeddings:
        layout["lm_head"] = _transposed([Piece("lm_head.weight", (V, D))])
    for i, kind in enumerate(c.layer_kinds):
        ours, hf = f"layers.{i}.", f"{prefix}layers.{i}."
        layout[ours + "input_norm.weight"] = [Piece(hf + "input_layernorm.weight", (D,), _zero_centred)]
        layout[ours + "post_norm.weight"] = [Piece(hf + "post_attention_layernorm.weight", (D,), _zero_centred)]
        mixer = linear_layout(c, hf + "linear_attn.") if kind == "linear" else _attention_layout(c, hf + "self_attn.")
        ffn = _moe_layout(c, hf + "mlp.", names) if c.moe_layers[i] else _mlp_layout(c, hf + "mlp.")
        layout.update({ours + "mixer." + k: v for k, v in mixer.items()})
        layout.update({ours + "ffn." + k: v for k, v in ffn.items()})
    return layout


def _linear_layout(c: ModelConfig, hf: str) -> Layout:
    D, Hk, Hv, dk, dv = (
        c.hidden_size,
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    r, C = c.value_heads_per_key_head, c.conv_channels

    def write_qkvz(param: torch.Tensor, t: torch.Tensor) -> None:
        # Checkpoint rows: per key head [q dk | k dk | v r·dv | z r·dv]; ours: [q | k | v | z] over all heads.
        q, k, v, z = t.view(Hk, 2 * dk + 2 * r * dv, D).split([dk, dk, r * dv, r * dv], dim=1)
        for part, start in ((q, 0), (k, Hk * dk), (v, 2 * Hk * dk), (z, C)):
            param[start : start + part.shape[0] * part.shape[1]].copy_(part.reshape(-1, D))

    def write_ba(param: torch.Tensor, t: torch.Tensor) -> None:
        # Checkpoint rows: per key head [b r | a r]; ours after z: [b Hv | a Hv].
        b, a = t.view(Hk, 2 * r, D).split([r, r], dim=1)
        param[C + Hv * dv : C + Hv * dv + Hv].copy_(b.reshape(Hv, D))
        param[C + Hv * dv + Hv :].copy_(a.reshape(Hv, D))

    in_proj = [
        Piece(hf + "in_proj_qkvz.weight", (2 * Hk * dk + 2 * Hv * dv, D), write_qkvz),
        Piece(hf + "in_proj_ba.weight", (2 * Hv, D), write_ba),
    ]
    return gdn_layout(c, hf, in_proj)


def gdn_layout(c: ModelConfig, hf: str, in_proj: list[Piece]) -> Layout:
    """A Gated DeltaNet layer's layout, given the checkpoint pieces that fill `in_proj` (the one
    place the families differ): each piece writes checkpoint rows of [q | k | v | z | b | a]."""
    D, Hv, dv = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim
    C, K = c.conv_channels, c.linear_conv_kernel_dim

    def write_conv(param: torch.Tensor, t: torch.Tensor) -> None:
        param.copy_(t[:, 0, :])

    return {
        "in_proj": _transposed(in_proj),
        "conv_weight": [Piece(hf + "conv1d.weight", (C, 1, K), write_conv)],
        "A_log": [Piece(hf + "A_log", (Hv,))],
        "dt_bias": [Piece(hf + "dt_bias", (Hv,))],
        "norm.weight": [Piece(hf + "norm.weight", (dv,))],
        "out_proj": _transposed([Piece(hf + "out_proj.weight", (D, Hv * dv))]),
    }


def _attention_layout(c: ModelConfig, hf: str) -> Layout:
    D, H, Hkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def write_q(param: torch.Tensor, t: torch.Tensor) -> None:
        # Checkpoint rows: per head [query hd | gate hd]; ours: [query all heads | gate all heads | k | v].
        query, gate = t.view(H, 2 * hd, D).split([hd, hd], dim=1)
        param[: H * hd].copy_(query.reshape(H * hd, D))
        param[H * hd : 2 * H * hd].copy_(gate.reshape(H * hd, D))

    kv_start = 2 * H * hd
    return {
        "qkv_proj": _transposed(
            [
                Piece(hf + "q_proj.weight", (2 * H * hd, D), write_q),
                Piece(hf + "k_proj.weight", (Hkv * hd, D), rows(kv_start, kv_start + Hkv * hd)),
                Piece(hf + "v_proj.weight", (Hkv * hd, D), rows(kv_start + Hkv * hd, kv_start + 2 * Hkv * hd)),
            ]
        ),
        "q_norm.weight": [Piece(hf + "q_norm.weight", (hd,), _zero_centred)],
        "k_norm.weight": [Piece(hf + "k_norm.weight", (hd,), _zero_centred)],
        "o_proj": _transposed([Piece(hf + "o_proj.weight", (D, H * hd))]),
    }


def _swiglu_layout(hf: str, I: int, D: int, first_row: int = 0) -> list[Piece]:
    return [
        Piece(hf + "gate_proj.weight", (I, D), rows(first_row, first_row + I)),
        Piece(hf + "up_proj.weight", (I, D), rows(first_row + I, first_row + 2 * I)),
    ]


def _mlp_layout(c: ModelConfig, hf: str) -> Layout:
    D, I = c.hidden_size, c.intermediate_size
    return {
        "gate_up": _transposed(_swiglu_layout(hf, I, D)),
        "down": _transposed([Piece(hf + "down_proj.weight", (D, I))]),
    }


def _moe_layout(c: ModelConfig, hf: str, names: set[str]) -> Layout:
    D, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    experts = hf + "experts."
    if experts + "gate_up_proj" in names:
        gate_up = [Piece(experts + "gate_up_proj", (E, 2 * I, D))]
    else:
        gate_up = [
            piece
            for e in range(E)
            for piece in (
                Piece(f"{experts}{e}.gate_proj.weight", (I, D), _expert(e, 0, I)),
                Piece(f"{experts}{e}.up_proj.weight", (I, D), _expert(e, I, 2 * I)),
            )
        ]
    if experts + "down_proj" in names:
        down = [Piece(experts + "down_proj", (E, D, I))]
    else:
        down = [Piece(f"{experts}{e}.down_proj.weight", (D, I), _expert(e)) for e in range(E)]
    gate_in = [
        Piece(hf + "gate.weight", (E, D), rows(0, E)),
        Piece(hf + "shared_expert_gate.weight", (1, D), rows(E, E + 1)),
        *_swiglu_layout(hf + "shared_expert.", Is, D, first_row=E + 1),
    ]
    return {
        "gate_in": _transposed(gate_in),
        "gate_up": _transposed(gate_up),
        "down": _transposed(down),
        "shared_down": _transposed([Piece(hf + "shared_expert.down_proj.weight", (D, Is))]),
    }
