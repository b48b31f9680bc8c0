"""What the bench runs: the models it builds (`SHAPES`), the sizes of each scenario, the synthetic chat.

Every shape is built by transformers from a seed (`AutoModelForCausalLM.from_config`) and saved, so
both engines load the very same checkpoint: hybridkv through its model registry, transformers
through `AutoModelForCausalLM`. Where each dimension comes from is written beside it; the Qwen3.5
figures are those of /work/shared/reference/qwen3.5.md §1 and the sources it names.

The chat (token ids only, seeded) is laid out like a ChatML conversation; every message ends at a
*message boundary*, which hybridkv is told about (`snapshot_at`, the cache hint at this level):

    system (72) | user 1 (53) header (3) reply 1 (104) | user 2 (53) header (3) reply 2 (104) | ...

    header  = the generation prompt ("<|im_start|>assistant\\n"): the prompt ends with it
    turn t prompt = system + (t-1) * (53 + 3 + 104) + 53 + 3   →   turn 8 = 1,248 tokens

The edit scenario replaces the last 10 tokens of user message 8 before its closing framing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.errors import NotSupported
from hybridkv.models.config import ModelConfig

SEED = 0

# Issue 6's reference Qwen3-Next (~95M parameters, ~40M active per token).
BENCH_MODEL: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    intermediate_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _hybrid_layers(n: int) -> list[str]:
    """Every Qwen3.5: 3 Gated DeltaNet layers, then 1 attention layer (full_attention_interval 4)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


# Shared by every Qwen3.5 / 3.6 (reference §1 "All models share", and the released text_config
# keys of §2): vocab 248,320, attention heads of 256 with partial RoPE over a quarter (64 dims),
# theta 1e7, interleaved M-RoPE sections [11, 11, 10] (equal to 1-D RoPE for text), Gated
# DeltaNet heads of 128 / 128 with a conv kernel of 4, 262,144 positions.
_QWEN3_5: dict[str, Any] = dict(
    vocab_size=248320,
    head_dim=256,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
)

# Qwen3.5-0.8B, the real dimensions (reference §1 table; friendli.ai/models/Yuqi123/Qwen3.5-0.8B-
# modelopt-fp8-hflayout; llama.cpp src/models/qwen35.cpp: 24 layers of width 1024 is the 0.8B):
# 24 layers, hidden 1024, 8 query / 2 KV heads, 16 / 16 Gated DeltaNet heads, dense SwiGLU of
# 3584, the head tied to the embedding (as the small Qwen3.5s are: no lm_head in their files).
QWEN3_5_0_8B: dict[str, Any] = dict(
    _QWEN3_5,
    hidden_size=1024,
    num_hidden_layers=24,
    layer_types=_hybrid_layers(24),
    num_attention_heads=8,
    num_key_value_heads=2,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    intermediate_size=3584,
    tie_word_embeddings=True,
)

# Qwen3.5/3.6-35B-A3B's layer dimensions (reference §1 table; mera.a-ai.ru/en/industrial/submits/181;
# also transformers' Qwen3_5MoeTextConfig defaults): hidden 2048, 16 query / 2 KV heads, 16 key /
# 32 value Gated DeltaNet heads, experts of 512 with top-8 and a shared expert of 512, an untied
# head. Cut to 8 layers (of 40) and 64 experts (of 256) so that both engines hold it in memory:
# 2.9B parameters, 1.6B of them experts.
QWEN3_5_MOE_MINI: dict[str, Any] = dict(
    _QWEN3_5,
    hidden_size=2048,
    num_hidden_layers=8,
    layer_types=_hybrid_layers(8),
    num_attention_heads=16,
    num_key_value_heads=2,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
)


@dataclass(frozen=True, slots=True)
class Shape:
    """A model the bench builds: transformers' `model_type` (its config class) and the config keys."""

    name: str
    model_type: str
    config: Mapping[str, Any]
    about: str  # one line: what the shape is

    def model_config(self) -> ModelConfig:
        """The shape as hybridkv parses its config.json."""
        return ModelConfig.from_dict({"model_type": self.model_type, **self.config}, source=f"shape {self.name}")

    def hf_config(self) -> Any:
        """transformers' config object of the shape."""
        return require_transformers().AutoConfig.for_model(self.model_type, **self.config)

    def parameters(self) -> int:
        """transformers' parameter count, from a model on the meta device (nothing allocated)."""
        transformers = require_transformers()
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(self.hf_config())
        return sum(p.numel() for p in model.parameters())


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("qwen3-next-bench", "qwen3_next", BENCH_MODEL, "issue 6's random Qwen3-Next: 95M parameters"),
        Shape("qwen3.5-0.8b", "qwen3_5_text", QWEN3_5_0_8B, "Qwen3.5-0.8B's dimensions, random weights"),
        Shape(
            "qwen3.5-moe-mini",
            "qwen3_5_moe_text",
            QWEN3_5_MOE_MINI,
            "Qwen3.5-35B-A3B's layer dimensions, 8 layers and 64 experts, random weights",
        ),
    )
}
DEFAULT_SHAPE = "qwen3-next-bench"


@dataclass(frozen=True, slots=True)
class ChatLayout:
    """Token counts of the synthetic conversation (see the module docstring)."""

    system: int = 72
    user: int = 53
    header: int = 3
    reply: int = 104
    turns: int = 8
    edited: int = 10  # tokens of the last user message changed by the edit scenario

    def __post_init__(self) -> None:
        if self.user < self.edited + 2 or min(self.system, self.header, self.reply, self.turns) < 1:
            raise ValueError(f"ChatLayout: every part needs >= 1 token and user >= edited + 2, got {self}")

    def prompt_len(self, turn: int) -> int:
        """Tokens of the prompt of turn `turn` (1-based), ending with the generation header."""
        return self.system + (turn - 1) * (self.user + self.header + self.reply) + self.user + self.header


@dataclass(frozen=True, slots=True)
class Chat:
    """One conversation's token ids and message boundaries.

    tokens: the whole conversation, through the last turn's reply.
    boundaries: ascending positions of the last token of every message (system, user, reply).
    turn_starts[t-1]: where user message t starts; reply_starts[t-1]: where reply t starts.
    """

    layout: ChatLayout
    tokens: list[int]
    boundaries: list[int]
    turn_starts: list[int]
    reply_starts: list[int]

    @staticmethod
    def build(layout: ChatLayout, vocab_size: int, seed: int = SEED) -> Chat:
        gen = torch.Generator().manual_seed(seed)
        total = layout.system + layout.turns * (layout.user + layout.header + layout.reply)
        tokens = torch.randint(0, vocab_size, (total,), generator=gen).tolist()
        boundaries, turn_starts, reply_starts = [layout.system - 1], [], []
        pos = layout.system
        for _ in range(layout.turns):
            turn_starts.append(pos)
            boundaries.append(pos + layout.user - 1)
            pos += layout.user + layout.header
            reply_starts.append(pos)
            pos += layout.reply
            boundaries.append(pos - 1)
        return Chat(layout, tokens, boundaries, turn_starts, reply_starts)

    def edited_last_user(self, vocab_size: int) -> list[int]:
        """The last user message with `edited` tokens changed just before its 2 closing tokens."""
        start = self.turn_starts[-1]
        message = self.tokens[start : start + self.layout.user]
        cut = self.layout.user - 2 - self.layout.edited
        changed = [(t + 1 + i) % vocab_size for i, t in enumerate(message[cut : cut + self.layout.edited])]
        return message[:cut] + changed + message[cut + self.layout.edited :]

    def boundaries_in(self, start: int, stop: int) -> list[int]:
        return [p for p in self.boundaries if start <= p < stop]


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes and repetitions. The defaults are the issue's; `QUICK` and tests shrink repetitions.

    Scenario names are fixed (`prefill_512` ...); each JSON entry also records the sizes it ran.
    """

    prefill_lens: tuple[int, int] = (512, 2048)
    decode_prompt: int = 512
    decode_steps: int = 32  # timed steps per decode scenario (after `warmup` untimed ones)
    batch: int = 16  # hybridkv's decode batch
    peer_batch: int = 8  # transformers' decode batch
    chat: ChatLayout = field(default_factory=ChatLayout)
    fork_prompt: int = 1024
    forks: int = 8
    reps: int = 5  # timed repetitions of every other scenario; the median counts
    warmup: int = 1
    spec_methods: tuple[str, ...] = ("ngram", "mtp", "auto")  # the drafts spec_* measures (none: skipped)
    spec_k: int | None = None  # tokens drafted per verify in spec_* (None: each method's default)

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    @property
    def verify_k(self) -> int:
        """k of verify_w1..w(k+1): spec_k, or the largest default of the drafts measured (0: none)."""
        from hybridkv.engine.speculative import DEFAULT_TOKENS

        if not self.spec_methods:
            return 0
        return self.spec_k if self.spec_k is not None else max(DEFAULT_TOKENS[m] for m in self.spec_methods)


FULL = Plan()
QUICK = Plan(decode_steps=16, reps=3)


def require_transformers() -> Any:
    """transformers' module, or a clear error: the bench needs it as the peer it measures against."""
    try:
        import transformers
    except ImportError:
        raise NotSupported(
            "hybridkv bench runs transformers side by side and it is not installed: "
            "pip install 'transformers>=5.23,<6' (or hybridkv[test])"
        ) from None
    transformers.logging.set_verbosity_error()  # its "falling back to the PyTorch path" notices
    transformers.logging.disable_progress_bar()
    return transformers


def build_checkpoint(
    path: Path, shape: Shape = SHAPES[DEFAULT_SHAPE], seed: int = SEED, dtype: torch.dtype = torch.float32
) -> Path:
    """Write a seeded random checkpoint of `shape` (safetensors in `dtype`) with transformers."""
    transformers = require_transformers()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(shape.hf_config(), dtype=dtype)
    model.save_pretrained(path)
    return path


def cached_checkpoint(
    shape: Shape, dtype: torch.dtype, cache_dir: Path, log: Callable[[str], None] = print, seed: int = SEED
) -> Path:
    """`shape`'s checkpoint under `cache_dir`, built the first time (into a side directory that is
    renamed when complete, so an interrupted build is never taken for a checkpoint)."""
    path = cache_dir / f"{shape.name}-{str(dtype).removeprefix('torch.')}-seed{seed}"
    if (path / "config.json").is_file():
        log(f"using the {shape.name} checkpoint in {path}")
        return path
    log(f"building the {shape.name} checkpoint with transformers ({shape.about}) in {path}")
    partial = path.with_name(path.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    build_checkpoint(partial, shape, seed, dtype)
    partial.rename(path)
    return path


def load_peer(path: Path, dtype: torch.dtype) -> Any:
    """transformers' model of the checkpoint as a user loads it: `AutoModelForCausalLM`, eager
    attention, its PyTorch kernels."""
    transformers = require_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


# Qwen's first three added tokens, at Qwen3.5's ids (248044..) where the vocabulary reaches them.
BENCH_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN35_FIRST_ADDED_ID = 248_044


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, by byte value (byte-level BPE's alphabet)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def write_bench_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json for a random-weight shape, so that `hybridkv
    quantize` can write it as a GGUF file (whose readers, llama.cpp's included, need a vocabulary):
    a byte-level BPE with one token per byte, the merges spelling " the", and Qwen's
    <|endoftext|>, <|im_start|>, <|im_end|> (eos). The ids mean nothing to random weights: the
    bench feeds token ids, never text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(_byte_alphabet())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    first = QWEN35_FIRST_ADDED_ID if vocab_size >= QWEN35_FIRST_ADDED_ID + len(BENCH_SPECIAL_TOKENS) else len(vocab)
    vocab |= {token: first + i for i, token in enumerate(BENCH_SPECIAL_TOKENS)}
    if (needed := max(vocab.values()) + 1) > vocab_size:
        raise ValueError(f"a bench tokenizer needs a vocabulary of at least {needed}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BENCH_SPECIAL_TOKENS])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_prefix_space": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
