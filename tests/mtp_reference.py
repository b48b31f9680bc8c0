"""A plain PyTorch twin of the multi-token-prediction block, written from the checkpoint's
definition (tensor names and shapes as released, no cache, full causal attention over rows), and
random `mtp.*` tensors to put in test checkpoints. transformers has no MTP module, so this is the
reference the cached block is tested against; the main model's hidden states come from transformers.

    x_i = fc(cat[norm_e(E(t_{i+1})), norm_h(h_i)]);  row i at RoPE position i
    x_i += gated_attention(input_norm(x)), causal over rows;  x_i += mlp(post_norm(x));  out = norm(x)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]


def mtp_tensors(text: Any, seed: int, moe: bool, fused_experts: bool = False) -> Tensors:
    """Random `mtp.*` tensors for a text config (transformers' config object), as checkpoints name
    them; norms around 0 (they are zero-centred: the scale is 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    D, H, Hkv, hd = text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim

    def w(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    p = "mtp.layers.0."
    out = {
        "mtp.fc.weight": w(D, 2 * D),
        "mtp.pre_fc_norm_embedding.weight": w(D, std=0.3),
        "mtp.pre_fc_norm_hidden.weight": w(D, std=0.3),
        "mtp.norm.weight": w(D, std=0.3),
        p + "input_layernorm.weight": w(D, std=0.3),
        p + "post_attention_layernorm.weight": w(D, std=0.3),
        p + "self_attn.q_proj.weight": w(2 * H * hd, D),
        p + "self_attn.k_proj.weight": w(Hkv * hd, D),
        p + "self_attn.v_proj.weight": w(Hkv * hd, D),
        p + "self_attn.o_proj.weight": w(D, H * hd),
        p + "self_attn.q_norm.weight": w(hd, std=0.3),
        p + "self_attn.k_norm.weight": w(hd, std=0.3),
    }
    if not moe:
        I = text.intermediate_size
        return out | {
            p + "mlp.gate_proj.weight": w(I, D),
            p + "mlp.up_proj.weight": w(I, D),
            p + "mlp.down_proj.weight": w(D, I),
        }
    E, I, Is = text.num_experts, text.moe_intermediate_size, text.shared_expert_intermediate_size
    m = p + "mlp."
    out |= {
        m + "gate.weight": w(E, D),
        m + "shared_expert_gate.weight": w(1, D),
        m + "shared_expert.gate_proj.weight": w(Is, D),
        m + "shared_expert.up_proj.weight": w(Is, D),
        m + "shared_expert.down_proj.weight": w(D, Is),
    }
    if fused_experts:
        return out | {m + "experts.gate_up_proj": w(E, 2 * I, D), m + "experts.down_proj": w(E, D, I)}
    for e in range(E):
        out |= {f"{m}experts.{e}.{n}_proj.weight": w(I, D) for n in ("gate", "up")}
        out[f"{m}experts.{e}.down_proj.weight"] = w(D, I)
    return out


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x: torch.Tensor, positions: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first rd dims of x [T, heads, hd]."""
    inv = 1.0 / theta ** (torch.arange(0, rd, 2).float() / rd)
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    r, rest = x[..., :rd], x[..., rd:]
    rotated = torch.cat([-r[..., rd // 2 :], r[..., : rd // 2]], -1)
    return torch.cat([r * cos + rotated * sin, rest], -1)


def _mlp(t: Tensors, x: torch.Tensor, text: Any, moe: bool) -> torch.Tensor:
    m = "mtp.layers.0.mlp."

    def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    if not moe:
        return swiglu(x, t[m + "gate_proj.weight"], t[m + "up_proj.weight"], t[m + "down_proj.weight"])
    E, I = text.num_experts, text.moe_intermediate_size
    if m + "experts.gate_up_proj" in t:
        gate_up, down = t[m + "experts.gate_up_proj"], t[m + "experts.down_proj"]
        experts = [(gate_up[e, :I], gate_up[e, I:], down[e]) for e in range(E)]
    else:
        experts = [tuple(t[f"{m}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")) for e in range(E)]
    probs = F.softmax(x @ t[m + "gate.weight"].T, -1)
    top, chosen = probs.topk(text.num_experts_per_tok, -1)
    top = top / top.sum(-1, keepdim=True)  # norm_topk_prob
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for weight, e in zip(top[row], chosen[row].tolist(), strict=True):
            out[row] += weight * swiglu(x[row : row + 1], *experts[e])[0]
    s = "mtp.layers.0.mlp.shared_expert."
    shared = swiglu(x, t[s + "gate_proj.weight"], t[s + "up_proj.weight"], t[s + "down_proj.weight"])
    return out + torch.sigmoid(x @ t[m + "shared_expert_gate.weight"].T) * shared


def twin_rows(
    t: Tensors, text: Any, moe: bool, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (embeds[i] = E(t_{i+1}), hidden[i] = h_i) at RoPE `positions`, causal over all rows:
    (post-`mtp.norm` out, pre-norm out), both [T, D]."""
    eps, D = text.rms_norm_eps, text.hidden_size
    H, Hkv, hd = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    rope = text.rope_parameters
    rd, theta = int(rope.get("partial_rotary_factor", 0.25) * hd), rope["rope_theta"]
    p, T = "mtp.layers.0.", embeds.shape[0]
    both = torch.cat(
        [
            _norm(embeds, t["mtp.pre_fc_norm_embedding.weight"], eps),
            _norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps),
        ],
        -1,
    )
    x = both @ t["mtp.fc.weight"].T
    a = _norm(x, t[p + "input_layernorm.weight"], eps)
    q_gate = (a @ t[p + "self_attn.q_proj.weight"].T).view(T, H, 2 * hd)
    q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(T, H * hd)
    k = (a @ t[p + "self_attn.k_proj.weight"].T).view(T, Hkv, hd)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).view(T, Hkv, hd)
    q = _rope(_norm(q, t[p + "self_attn.q_norm.weight"], eps), positions, rd, theta)
    k = _rope(_norm(k, t[p + "self_attn.k_norm.weight"], eps), positions, rd, theta)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * hd**-0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * hd)
    x = x + (o * torch.sigmoid(gate)) @ t[p + "self_attn.o_proj.weight"].T
    x = x + _mlp(t, _norm(x, t[p + "post_attention_layernorm.weight"], eps), text, moe)
    assert x.shape == (T, D)
    return _norm(x, t["mtp.norm.weight"], eps), x


def hf_hidden(hf: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' hidden states of the main model for one sequence, no cache: (after the final
    norm, before it), both [len(tokens), D]."""
    base = hf.model.language_model if hasattr(hf.model, "language_model") else hf.model
    seen: dict[str, torch.Tensor] = {}
    hook = base.norm.register_forward_hook(lambda m, args, out: seen.update(pre=args[0][0], post=out[0]))
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([list(tokens)]), use_cache=False)
    finally:
        hook.remove()
    return seen["post"].float(), seen["pre"].float()


def twin_draft(
    t: Tensors, hf: Any, moe: bool, tokens: Sequence[int], pending: int, k: int, hidden: str = "post_norm"
) -> torch.Tensor:
    """Fresh no-cache MTP draft logits [k, V] after `tokens` with `pending` next: the rows
    (h_{p-1}, t_p) for p = 1..L, then each draft step appends (its output, its argmax)."""
    text = hf.config.get_text_config()
    post, pre = hf_hidden(hf, tokens)
    h = post if hidden == "post_norm" else pre
    embed, head = hf.get_input_embeddings().weight.float(), hf.get_output_embeddings().weight.float()
    ids = [*tokens[1:], pending]
    hiddens = list(h)
    out = []
    with torch.no_grad():
        for _ in range(k):
            L = len(ids)
            normed, raw = twin_rows(t, text, moe, embed[ids], torch.stack(hiddens), torch.arange(L))
            logits = normed[-1] @ head.T
            out.append(logits)
            ids.append(int(logits.argmax()))
            hiddens.append(normed[-1] if hidden == "post_norm" else raw[-1])
    return torch.stack(out)


def add_mtp(path: Path, tensors: Tensors) -> Path:
    """Add `tensors` to the checkpoint in `path` (one model.safetensors) and say in config.json
    that it has one MTP layer, where each family says it."""
    file = path / "model.safetensors"
    save_file(load_file(file) | tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] == "qwen3_next":
        config["num_nextn_predict_layers"] = 1
    else:
        config.get("text_config", config)["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path
