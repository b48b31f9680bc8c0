"""The multi-token-prediction (MTP) block of Qwen3-Next and Qwen3.5 checkpoints (`mtp.*`).

Row i pairs the main model's hidden state h_i with the next token t_{i+1} and predicts t_{i+2}:

    x   = fc(cat[pre_fc_norm_embedding(E(t_{i+1})), pre_fc_norm_hidden(h_i)])    fc: [2D → D]
    x   = x + attn(input_norm(x))       gated attention at RoPE position i, its own K/V
    x   = x + ffn(post_norm(x))         the family's MLP: sparse MoE + shared expert, or dense SwiGLU
    out = norm(x);  logits = the main model's head(out)

Embeddings and head are the main model's; every norm is zero-centred (stored 1 + w).

Cache layout. The MTP layer's K/V is one more attention layer (index = the number of main
attention layers) in the same blocks, shifted so a block stays a function of the tokens it covers:

    MTP slot p  holds the row (h_{p-1}, t_p) at RoPE position p-1     (p >= 1)
    MTP slot 0  holds nothing usable and is never attended

so every main forward writes the MTP K/V of the slots it feeds (`catch_up`), pairing its first
token with the hidden state carried from the sequence's previous forward (`ForwardBatch.hidden_carry`),
and keeps its last hidden row as the new carry (and the rows at its snapshots in the snapshots).
Only K and V are needed there, so the catch-up stops at the K/V projection. Drafting (`draft`)
runs the whole layer for temporary rows, never written to the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.cache.batch import CacheView, ForwardBatch
from hybridkv.models.config import ModelConfig
from hybridkv.models.qwen3_next import (
    DenseMLP,
    GatedAttention,
    RMSNorm,
    SparseMoE,
    _attention_layout,
    _mlp_layout,
    _moe_layout,
    _transposed,
    _weight,
    _zero_centred,
)
from hybridkv.models.weights import Layout, Piece
from hybridkv.ops import native
from hybridkv.ops.matmul import FEW_ROWS, Weight, linear

MTPHidden = Literal["post_norm", "pre_norm"]
"""Which main hidden state feeds the block: after the model's final norm (what the released
checkpoints were trained on) or before it."""

RopeFn = Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
HeadFn = Callable[[torch.Tensor], torch.Tensor]
AttendFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]
"""A draft step's attention: (fused rows x, step s) → (attention output, its gate or None if applied)."""


class MTPBlock(nn.Module):
    """One MTP layer (`mtp.layers.0`) with its input fc and output norm; see the module docstring."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, hidden: MTPHidden = "post_norm") -> None:
        super().__init__()
        c, D = config, config.hidden_size
        if hidden not in ("post_norm", "pre_norm"):
            raise ValueError(f'mtp hidden must be "post_norm" or "pre_norm", got {hidden!r}')
        self.hidden = hidden
        self.pre_fc_norm_embedding = RMSNorm(D, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(D, c.rms_norm_eps)
        self.fc: Weight = _weight(2 * D, D, dtype=dtype)  # [in, out]: embedding half first
        self.input_norm = RMSNorm(D, c.rms_norm_eps)
        self.attn = GatedAttention(c, len(c.attention_layers), dtype)  # the cache's last attention layer
        self.post_norm = RMSNorm(D, c.rms_norm_eps)
        self.ffn = SparseMoE(c, dtype) if c.mtp_is_moe else DenseMLP(c, dtype)
        self.norm = RMSNorm(D, c.rms_norm_eps)

    @property
    def kv_layer(self) -> int:
        """The cache's attention-layer index of the MTP layer's K/V."""
        return self.attn.index

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x [T, D] = fc(cat[norm(E(t_{i+1})), norm(h_i)]) for embeds, hidden [T, D]."""
        both = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))], -1)
        return linear(both, self.fc)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's q [T, H, hd], gate, k, v [T, Hkv, hd] for the fused rows x [T, D]."""
        return self.attn.split_heads(linear(self.input_norm(x), self.attn.qkv_proj), cos, sin)

    def finish(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer after attention (o [T, H, hd], or [T, H·hd] already gated when `gate`
        is None): (post-`mtp.norm`, pre-norm) outputs [T, D]."""
        attended = linear(o.to(x.dtype), self.attn.o_proj) if gate is None else self.attn.output(o, gate)
        x = x + attended
        x = x + self.ffn(self.post_norm(x))
        return self.norm(x), x

    # -- with the cache -----------------------------------------------------------------------

    def catch_up(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, rope: RopeFn) -> None:
        """Write the MTP K/V of every slot this forward feeds and keep the hidden carry.

        embeds [T, D]: the fed tokens' embeddings; hidden [T, D]: the main model's hidden rows
        (the kind `self.hidden` names). Row j of a sequence (slot L + j) pairs the hidden of slot
        L + j - 1: the carry for j = 0, this forward's row before it otherwise.
        """
        previous = hidden.roll(1, 0)
        previous[batch.cu_seqlens[:-1]] = batch.hidden_carry().to(previous.dtype)
        cos, sin = rope((batch.positions - 1).clamp(min=0), embeds.dtype)
        _, _, k, v = self.qkv(self.fuse(embeds, previous), cos, sin)
        batch.store_kv(self.kv_layer, k, v)
        batch.store_hidden_carry(hidden)

    def draft(
        self, tokens: torch.Tensor, view: CacheView, steps: int, embed: HeadFn, rope: RopeFn, head: HeadFn
    ) -> torch.Tensor:
        """Greedy drafts for sequences whose next token `tokens` [N] is known but not yet fed:
        logits [N, steps, V] float32, step s scoring the token after draft s (draft 0 = `tokens`).

        Step 0 is the row (carried h_{L-1}, t_L) at slot L, RoPE position L-1, attending MTP
        slots 1..L; step s + 1 feeds back step s's output with its argmax. Nothing is written.
        """
        N = tokens.shape[0]
        native_step = N <= FEW_ROWS and native.enabled(self.attn.q_norm.weight, self.attn.k_norm.weight)
        attend = self._native_attention(view, steps, rope) if native_step else self._eager_attention(view, rope)
        hidden = view.hidden_carry()
        out = []
        for s in range(steps):
            x = self.fuse(embed(tokens), hidden)
            o, gate = attend(x, s)
            normed, raw = self.finish(x, o, gate)
            logits = head(normed)
            out.append(logits)
            tokens = logits.argmax(-1)
            hidden = normed if self.hidden == "post_norm" else raw
        return torch.stack(out, 1)

    def _native_attention(self, view: CacheView, steps: int, rope: RopeFn) -> AttendFn:
        """Draft step s's attention on the C++ kernels: the main model's decode step
        (`native.attention_decode`) over a private copy of the sequences' MTP K/V, into which the
        draft rows are written (the cache is not touched); gated in the kernel (gate None)."""
        attn, N = self.attn, view.kv_lens.shape[0]
        k_rows, v_rows, tables, slots = _scratch_kv(view, self.kv_layer, steps)
        lens = view.kv_lens  # draft s attends the history (slots 1..L-1) and drafts 0..s: L + s rows
        positions = (view.kv_lens - 1)[:, None] + torch.arange(steps)  # [N, steps]
        cos, sin = (t.view(N, steps, -1) for t in rope(positions.flatten(), torch.float32))

        def attend(x: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            qkv = linear(self.input_norm(x), attn.qkv_proj)
            o = native.attention_decode(
                qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos[:, s], sin[:, s], (k_rows, v_rows),
                slots + s, tables, lens + s, attn.scale, attn.H,
            )  # fmt: skip
            return o, None

        return attend

    def _eager_attention(self, view: CacheView, rope: RopeFn) -> AttendFn:
        """Draft step s's attention in PyTorch (many sequences, or no kernels): SDPA over a gathered
        copy of the cached MTP K/V and the draft rows so far; the gate is applied in `finish`."""
        k_cache, v_cache, visible = _gather_kv(view, self.kv_layer)
        stored = view.kv_pools(self.kv_layer)[0].dtype  # draft rows rounded as the kernel's scratch pool holds them
        N = visible.shape[0]
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []

        def attend(x: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            cos, sin = rope(view.kv_lens - 1 + s, x.dtype)
            q, gate, k, v = self.qkv(x, cos, sin)
            new_k.append(k.to(stored).float())
            new_v.append(v.to(stored).float())
            keys = torch.cat([k_cache, torch.stack(new_k, 2)], 2)  # [N, Hkv, S + s + 1, hd]
            values = torch.cat([v_cache, torch.stack(new_v, 2)], 2)
            mask = torch.cat([visible, visible.new_ones(N, s + 1)], 1)[:, None, None, :]
            o = _attend(q.float()[:, :, None], keys, values, mask, self.attn.scale)  # [N, H, hd]
            return o.to(x.dtype), gate

        return attend


def _scratch_kv(
    view: CacheView, layer: int, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A private pool for drafting with `native.attention_decode`: one block per sequence, row j
    holding the cached MTP slot j + 1 (slot 0 is never attended), `steps` more rows for the drafts.
    Returns keys, values [N, S + steps, Hkv, hd] (the cache's dtype), block tables [N, 1] and the
    row of draft 0 per sequence [N] (flat, as a slot mapping)."""
    k_pool, v_pool = view.kv_pools(layer)
    N = view.block_tables.shape[0]
    cached = int(view.kv_lens.max()) - 1  # slots 1..L-1 of the longest sequence
    blocks = view.block_tables[:, : -(-(cached + 1) // k_pool.shape[1])].flatten()

    def copy(pool: torch.Tensor) -> torch.Tensor:
        rows = pool.new_empty(N, cached + steps, *pool.shape[2:])
        rows[:, :cached] = pool.index_select(0, blocks).view(N, -1, *pool.shape[2:])[:, 1 : cached + 1]
        return rows

    width = cached + steps
    first = torch.arange(N) * width + view.kv_lens - 1
    return copy(k_pool), copy(v_pool), torch.arange(N)[:, None], first


def _gather_kv(view: CacheView, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cached MTP K/V of each sequence, padded: keys, values [N, Hkv, S, hd] float32 and the
    visible slots [N, S] bool (1..L-1: slot 0 holds nothing, slot L is the first draft row)."""
    k_pool, v_pool = view.kv_pools(layer)
    N, bs = view.block_tables.shape[0], k_pool.shape[1]

    def gather(pool: torch.Tensor) -> torch.Tensor:
        rows = pool.index_select(0, view.block_tables.flatten()).view(N, -1, *pool.shape[2:])
        return rows.transpose(1, 2).float()

    slots = torch.arange(view.block_tables.shape[1] * bs)
    visible = (slots >= 1) & (slots[None] < view.kv_lens[:, None])
    return gather(k_pool), gather(v_pool), visible


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, 1, hd] over k, v [N, Hkv, S, hd] where mask [N, 1, 1, S] allows: [N, H, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[:, :, 0]


# -- checkpoint mapping -----------------------------------------------------------------------


def mtp_layout(config: ModelConfig, names: set[str], prefix: str = "mtp.") -> Layout:
    """Our MTP parameters (under `mtp.`) → the checkpoint's `mtp.*` tensors. The layer's experts
    may be fused or per expert, as in the decoder (`names` decides)."""
    c, D = config, config.hidden_size
    hf = prefix + "layers.0."
    ffn = _moe_layout(c, hf + "mlp.", names) if c.mtp_is_moe else _mlp_layout(c, hf + "mlp.")
    layout: Layout = {
        "fc": _transposed([Piece(prefix + "fc.weight", (D, 2 * D))]),
        "pre_fc_norm_embedding.weight": [Piece(prefix + "pre_fc_norm_embedding.weight", (D,), _zero_centred)],
        "pre_fc_norm_hidden.weight": [Piece(prefix + "pre_fc_norm_hidden.weight", (D,), _zero_centred)],
        "input_norm.weight": [Piece(hf + "input_layernorm.weight", (D,), _zero_centred)],
        "post_norm.weight": [Piece(hf + "post_attention_layernorm.weight", (D,), _zero_centred)],
        "norm.weight": [Piece(prefix + "norm.weight", (D,), _zero_centred)],
    }
    layout.update({"attn." + k: v for k, v in _attention_layout(c, hf + "self_attn.").items()})
    layout.update({"ffn." + k: v for k, v in ffn.items()})
    return {"mtp." + k: v for k, v in layout.items()}
