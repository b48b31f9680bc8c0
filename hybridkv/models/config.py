"""`ModelConfig`: a checkpoint's config.json, checked and reduced to what the forward pass needs.

Two families, found by `model_type`:

    qwen3_next                      Qwen3NextForCausalLM, flat config
    qwen3_5, qwen3_5_moe            Qwen3_5[Moe]ForConditionalGeneration (vision-language): the
                                    decoder's keys nested in `text_config`; the vision tower ignored
    qwen3_5_text, qwen3_5_moe_text  Qwen3_5[Moe]ForCausalLM (text-only fine-tunes), flat config

Both config styles of Hugging Face checkpoints are accepted:

    old (released Qwen3-Next):   top-level rope_theta, partial_rotary_factor, rope_scaling,
                                 full_attention_interval
    new (transformers >= 5):     rope_parameters {rope_type, rope_theta, partial_rotary_factor},
                                 layer_types ["linear_attention" | "full_attention", ...]

Missing keys take the defaults of transformers' config class of the family (`Qwen3NextConfig`,
`Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`; head_dim 256, not hidden/heads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hybridkv.errors import NotSupported

LayerKind = Literal["linear", "attention"]

Family = Literal["qwen3_next", "qwen3_5"]


@dataclass(frozen=True, slots=True)
class _ModelType:
    family: Family
    architectures: tuple[str, ...]  # the classes a config.json of this type may name
    nested: bool  # decoder keys under `text_config` (vision-language wrapper)
    moe: bool


_QWEN3_5_VLM = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
_QWEN3_5_MOE_VLM = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
MODEL_TYPES: dict[str, _ModelType] = {
    "qwen3_next": _ModelType("qwen3_next", ("Qwen3NextForCausalLM",), nested=False, moe=True),
    "qwen3_5": _ModelType("qwen3_5", _QWEN3_5_VLM, nested=True, moe=False),
    "qwen3_5_moe": _ModelType("qwen3_5", _QWEN3_5_MOE_VLM, nested=True, moe=True),
    "qwen3_5_text": _ModelType("qwen3_5", ("Qwen3_5ForCausalLM",), nested=False, moe=False),
    "qwen3_5_moe_text": _ModelType("qwen3_5", ("Qwen3_5MoeForCausalLM",), nested=False, moe=True),
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)

# transformers' Qwen3NextConfig defaults, for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "mlp_only_layers": (),
}

# Qwen3_5TextConfig / Qwen3_5MoeTextConfig differ from Qwen3NextConfig in these (transformers 5.24).
_QWEN3_5_DEFAULTS = {
    **_DEFAULTS,
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_key_value_heads": 4,
}
_QWEN3_5_MOE_DEFAULTS = {
    **_DEFAULTS,
    "vocab_size": 248320,
    "num_hidden_layers": 40,
    "num_experts": 256,
    "num_experts_per_tok": 8,
}
# Keys the Qwen3.5 families fix rather than read (transformers never reads them): MoE routing is
# renormalised top-k in every layer, and dense models have no experts.
_QWEN3_5_FIXED: dict[str, Any] = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": ()}

_LAYER_TYPE_NAMES: dict[str, LayerKind] = {"linear_attention": "linear", "full_attention": "attention"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What a Qwen3-Next or Qwen3.5 checkpoint's config.json says about the decoder, validated.

    Shape vocabulary: D hidden_size, H num_attention_heads, Hkv num_key_value_heads, hd head_dim,
    Hk/Hv linear_num_key_heads/linear_num_value_heads, dk/dv their head dims, K conv kernel, V vocab,
    E num_experts.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: tuple[LayerKind, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated attention layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    # Gated DeltaNet layers
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward: MoE or dense SwiGLU
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...] = ()
    # multi-token-prediction layers the checkpoint ships under `mtp.*` (loaded only on request)
    mtp_num_hidden_layers: int = 0
    family: Family = "qwen3_next"
    source: str = field(default="<dict>", compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json; is {model_dir} a Hugging Face checkpoint directory?")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "<dict>") -> ModelConfig:
        """Parse a config.json dict (old or new style); `source` names the file in error messages."""
        kind = MODEL_TYPES.get(raw.get("model_type"))  # type: ignore[arg-type]
        if kind is None:
            raise NotSupported(
                f"{source}: model_type {raw.get('model_type')!r} is not supported; hybridkv runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        architectures = raw.get("architectures") or list(kind.architectures)
        if not set(architectures) & set(kind.architectures):
            raise NotSupported(
                f"{source}: architectures {architectures} not supported for model_type {raw['model_type']!r}; "
                f"hybridkv runs {', '.join(kind.architectures)}"
            )
        _refuse_quantization(raw, source)
        defaults, fixed, outer = _DEFAULTS, {}, raw
        if kind.family == "qwen3_5":
            defaults = _QWEN3_5_MOE_DEFAULTS if kind.moe else _QWEN3_5_DEFAULTS
            fixed = {**_QWEN3_5_FIXED, **({} if kind.moe else {"num_experts": 0})}
        if kind.nested:
            # The wrapper's tie flag decides, as in transformers' VLM class (and the loader follows
            # the file: a missing lm_head.weight means tied).
            if raw.get("tie_word_embeddings") is not None:
                fixed["tie_word_embeddings"] = raw["tie_word_embeddings"]
            raw = _text_config(raw, source)
            _refuse_quantization(raw, source)

        def get(key: str) -> Any:
            value = fixed.get(key, raw.get(key))
            return defaults[key] if value is None else value

        if get("hidden_act") != "silu":
            raise NotSupported(f"{source}: hidden_act {raw['hidden_act']!r} not supported (only 'silu')")
        if get("attention_bias"):
            raise NotSupported(f"{source}: attention_bias=true not supported (these models have no biases)")

        rope_theta, partial_rotary_factor = _parse_rope(raw, defaults, source)
        num_layers = int(get("num_hidden_layers"))
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=num_layers,
            layer_kinds=_parse_layer_kinds(raw, num_layers, defaults, source),
            rms_norm_eps=float(get("rms_norm_eps")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim")),
            rope_theta=rope_theta,
            partial_rotary_factor=partial_rotary_factor,
            max_position_embeddings=int(get("max_position_embeddings")),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")),
            intermediate_size=int(get("intermediate_size")),
            num_experts=int(get("num_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=int(get("decoder_sparse_step")),
            mlp_only_layers=tuple(int(i) for i in get("mlp_only_layers") or ()),
            mtp_num_hidden_layers=_mtp_layers(raw) or _mtp_layers(outer),
            family=kind.family,
            source=source,
        )

    # -- derived sizes ----------------------------------------------------------------------

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Model layer index of attention layer a, for a = 0, 1, ... (the cache's numbering)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Model layer index of linear layer j, for j = 0, 1, ... (the cache's numbering)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: True for the sparse MoE block, False for a dense SwiGLU MLP of intermediate_size."""
        return tuple(
            i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_hidden_layers)
        )

    @property
    def mtp_is_moe(self) -> bool:
        """The MTP decoder layer's feed-forward: sparse MoE as the family's (layer index num_hidden_layers)."""
        i = self.num_hidden_layers
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def value_heads_per_key_head(self) -> int:
        """r = Hv / Hk."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def conv_channels(self) -> int:
        """C = 2·Hk·dk + Hv·dv: the channels of the causal conv (q, k and v)."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def rotary_dim(self) -> int:
        """rd: the leading head dims that RoPE rotates."""
        return int(self.partial_rotary_factor * self.head_dim)

    # -- validation -------------------------------------------------------------------------

    def _validate(self) -> None:
        where = f"{self.source}:"
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "decoder_sparse_step",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{where} {name} must be positive, got {getattr(self, name)}")
        if len(self.layer_kinds) != self.num_hidden_layers:
            raise ValueError(
                f"{where} layer_types has {len(self.layer_kinds)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; make them agree"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{where} num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"{where} linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"{where} linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        rd = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rd < 2 or rd % 2:
            raise ValueError(
                f"{where} partial_rotary_factor {self.partial_rotary_factor} × head_dim {self.head_dim} "
                f"gives rotary dim {rd}; it must be an even number in 2..head_dim"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"{where} mlp_only_layers {bad} outside 0..{self.num_hidden_layers - 1}")
        if any(self.moe_layers):
            if self.num_experts_per_tok < 1 or self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"{where} num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                    f"1..num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
                raise ValueError(f"{where} moe_intermediate_size and shared_expert_intermediate_size must be > 0")
        if not all(self.moe_layers) and self.intermediate_size <= 0:
            raise ValueError(f"{where} intermediate_size must be > 0: some layers use the dense MLP")


def _mtp_layers(raw: Mapping[str, Any]) -> int:
    """Qwen3.5 names it `mtp_num_hidden_layers`, Qwen3-Next `num_nextn_predict_layers`."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if raw.get(key) is not None:
            return int(raw[key])
    return 0


def _refuse_quantization(raw: Mapping[str, Any], source: str) -> None:
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, Mapping) else "?"
        raise NotSupported(
            f"{source}: quantized checkpoints (quantization_config, quant_method={method!r}) are not "
            "supported; use an unquantized bf16/fp32 checkpoint"
        )


def _text_config(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The decoder's keys of a vision-language config (its `text_config`)."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(
            f"{source}: model_type {raw['model_type']!r} keeps the decoder's settings in a 'text_config' "
            "object, and there is none; is this config.json complete?"
        )
    expected = f"{raw['model_type']}_text"
    if text.get("model_type", expected) != expected:
        raise NotSupported(f"{source}: text_config.model_type {text['model_type']!r}, expected {expected!r}")
    return dict(text)


def _parse_rope(raw: Mapping[str, Any], defaults: Mapping[str, Any], source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` (new) or top-level keys (old).

    Qwen3.5's interleaved M-RoPE (`mrope_section`, `mrope_interleaved`) rotates three position
    axes; for text they are all equal and it is exactly this 1-D partial RoPE.
    """
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else scaling
        if kind != "default":
            raise NotSupported(
                f"{source}: rope_scaling {scaling!r} is not supported yet (only plain RoPE); "
                "remove it or set it to null to run without context extension"
            )
    params = raw.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise NotSupported(f"{source}: rope_parameters.rope_type {kind!r} is not supported yet (only 'default')")

    def pick(key: str) -> float:
        for value in (params.get(key), raw.get(key)):
            if value is not None:
                return float(value)
        return float(defaults[key])

    return pick("rope_theta"), pick("partial_rotary_factor")


def _parse_layer_kinds(
    raw: Mapping[str, Any], num_layers: int, defaults: Mapping[str, Any], source: str
) -> tuple[LayerKind, ...]:
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPE_NAMES))
        if unknown:
            raise NotSupported(f"{source}: layer_types {unknown} not supported (only {sorted(_LAYER_TYPE_NAMES)})")
        return tuple(_LAYER_TYPE_NAMES[t] for t in layer_types)
    interval = raw.get("full_attention_interval") or defaults["full_attention_interval"]
    if int(interval) < 1:
        raise ValueError(f"{source}: full_attention_interval must be >= 1, got {interval}")
    return tuple("attention" if (i + 1) % int(interval) == 0 else "linear" for i in range(num_layers))
