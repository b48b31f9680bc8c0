"""The model hybridkv runs when none is named: a tiny random Qwen3-Next with a byte-level tokenizer.

It is built locally (no network, no transformers) from a seeded generator the first time it is
asked for, into `$HYBRIDKV_HOME` (default `~/.cache/hybridkv`). The files are exactly what a
Hugging Face checkpoint holds — `config.json` in transformers' Qwen3-Next format, one
`model.safetensors` under the released tensor names, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json` — so the same code path loads it and a real checkpoint.

Its output is noise, but harmless noise: only printable ASCII and newline have non-zero
`lm_head` rows, so it never prints control bytes or half characters, and (like a random model)
it hardly ever emits an end-of-sequence token.

Tokenizer convention (Qwen's): `<|endoftext|>` is the pad / document-end token, `<|im_end|>`
ends a turn. `tokenizer_config.json` names `<|im_end|>` as eos_token, `generation_config.json`
stops on both, `config.json` has bos `<|endoftext|>` and eos `<|im_end|>`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTES = 256
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(NUM_BYTES, VOCAB_SIZE)

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
CONFIG: dict[str, object] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "dtype": "float32",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "intermediate_size": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}


def default_model_dir() -> Path:
    """The default model's directory, built on first use under `$HYBRIDKV_HOME` or `~/.cache/hybridkv`."""
    home = os.environ.get("HYBRIDKV_HOME") or Path.home() / ".cache" / "hybridkv"
    return materialize(Path(home))


def materialize(root: Path) -> Path:
    """Build the default model in `root/<name>` unless it is there, and return that directory.

    The name carries a hash of this file, so any change to how the model is built makes a new
    directory. Files are written to a temporary directory that is renamed into place: a reader
    never sees a half-written model, and when two processes race the loser's copy is discarded.
    """
    source_hash = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    final = root / f"tiny-qwen3-next-{source_hash}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _write_model(tmp)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp made it private; it is a plain cache
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_model(out: Path) -> None:
    (out / "config.json").write_text(_dump(CONFIG))
    generation = {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }
    (out / "generation_config.json").write_text(_dump(generation))
    _build_tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config))
    save_file(dict(_random_weights()), str(out / "model.safetensors"), metadata={"format": "pt"})


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


# -- tokenizer -------------------------------------------------------------------------------


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the ByteLevel convention)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in visible}
    for b in range(NUM_BYTES):
        if b not in chars:  # unprintable bytes map past 255, in order
            chars[b] = NUM_BYTES + len(chars) - len(visible)
    return {b: chr(c) for b, c in sorted(chars.items())}


def _build_tokenizer():  # -> tokenizers.Tokenizer (untyped library)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # Token id == byte value; no merges, so every byte is its own token.
    vocab = {char: b for b, char in byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tokenizer


# -- weights ---------------------------------------------------------------------------------


def _random_weights() -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, drawn in a fixed order from one seeded generator.

    Projections are scaled 1/sqrt(fan_in) so every layer changes the residual stream by O(1):
    the output then depends on the whole context, which makes cache bugs visible. Norm weights,
    `A_log` and `dt_bias` are perturbed away from their usual init so that a wrong norm formula
    shows (see reference/qwen3-next.md, "Reference traps").
    """
    gen = torch.Generator().manual_seed(SEED)
    d, v = _int("hidden_size"), _int("vocab_size")
    hk, hv, dk, dv = (
        _int(f"linear_{k}") for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    kernel = _int("linear_conv_kernel_dim")
    h, hkv, hd = _int("num_attention_heads"), _int("num_key_value_heads"), _int("head_dim")
    experts, moe, shared = (
        _int("num_experts"),
        _int("moe_intermediate_size"),
        _int("shared_expert_intermediate_size"),
    )

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=1 / math.sqrt(in_features))

    def centred_norm(n: int) -> torch.Tensor:  # zero-centred RMSNorm: scale is (1 + w)
        return normal(n, std=0.1)

    yield "model.embed_tokens.weight", normal(v, d, std=1.0)
    conv_channels = 2 * hk * dk + hv * dv
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", centred_norm(d)
        if kind == "linear_attention":
            yield p + "linear_attn.in_proj_qkvz.weight", linear(2 * hk * dk + 2 * hv * dv, d)
            yield p + "linear_attn.in_proj_ba.weight", linear(2 * hv, d)
            yield p + "linear_attn.conv1d.weight", normal(conv_channels, 1, kernel, std=1 / math.sqrt(kernel))
            yield p + "linear_attn.dt_bias", normal(hv, std=0.5, mean=1.0)
            yield p + "linear_attn.A_log", torch.empty(hv).uniform_(1.0, 16.0, generator=gen).log()
            yield p + "linear_attn.norm.weight", normal(dv, std=0.1, mean=1.0)  # plain RMSNorm: scale is w
            yield p + "linear_attn.out_proj.weight", linear(d, hv * dv)
        else:
            yield p + "self_attn.q_proj.weight", linear(2 * h * hd, d)  # query and gate per head
            yield p + "self_attn.k_proj.weight", linear(hkv * hd, d)
            yield p + "self_attn.v_proj.weight", linear(hkv * hd, d)
            yield p + "self_attn.q_norm.weight", centred_norm(hd)
            yield p + "self_attn.k_norm.weight", centred_norm(hd)
            yield p + "self_attn.o_proj.weight", linear(d, h * hd)
        yield p + "post_attention_layernorm.weight", centred_norm(d)
        yield p + "mlp.gate.weight", linear(experts, d)
        for name, intermediate in [
            *((f"experts.{e}", moe) for e in range(experts)),
            ("shared_expert", shared),
        ]:
            yield p + f"mlp.{name}.gate_proj.weight", linear(intermediate, d)
            yield p + f"mlp.{name}.up_proj.weight", linear(intermediate, d)
            yield p + f"mlp.{name}.down_proj.weight", linear(d, intermediate)
        yield p + "mlp.shared_expert_gate.weight", linear(1, d)
    yield "model.norm.weight", centred_norm(d)
    yield "lm_head.weight", normal(v, d, std=3 / math.sqrt(d)) * _printable_rows(v).unsqueeze(1)


def _int(key: str) -> int:
    value = CONFIG[key]
    assert isinstance(value, int), key
    return value


def _printable_rows(vocab_size: int) -> torch.Tensor:
    """1.0 for tokens that are printable ASCII or newline, 0.0 for the rest (logit always 0)."""
    mask = torch.zeros(vocab_size)
    mask[ord(" ") : ord("~") + 1] = 1.0
    mask[ord("\n")] = 1.0
    return mask
