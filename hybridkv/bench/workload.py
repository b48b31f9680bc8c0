"""What the bench runs: the model it builds, the sizes of each scenario, and the synthetic chat.

The model (`BENCH_MODEL`, ~95M parameters, ~40M active per token) is the issue's reference: vocab
32000, hidden 512, 8 layers with attention at layers 3 and 7, 8 query / 2 KV heads of dim 64,
linear attention with 4 key / 8 value heads of dim 64 and a conv kernel of 4, 16 experts top-4
of intermediate 256 plus a shared expert of 256. transformers builds it from a seed and saves it,
so both engines load the very same checkpoint.

The chat (token ids only, seeded) is laid out like a ChatML conversation; every message ends at a
*message boundary*, which hybridkv is told about (`snapshot_at`, the cache hint at this level):

    system (72) | user 1 (53) header (3) reply 1 (104) | user 2 (53) header (3) reply 2 (104) | ...

    header  = the generation prompt ("<|im_start|>assistant\\n"): the prompt ends with it
    turn t prompt = system + (t-1) * (53 + 3 + 104) + 53 + 3   →   turn 8 = 1,248 tokens

The edit scenario replaces the last 10 tokens of user message 8 before its closing framing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.errors import NotSupported

SEED = 0

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

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)


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


def build_checkpoint(path: Path, config: dict[str, Any] = BENCH_MODEL, seed: int = SEED) -> Path:
    """Write a seeded random Qwen3-Next checkpoint (float32 safetensors) with transformers."""
    transformers = require_transformers()
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config))
    model.save_pretrained(path)
    return path


def load_peer(path: Path, dtype: torch.dtype) -> Any:
    """transformers' Qwen3-Next as a user loads it: eager attention, its PyTorch kernels."""
    transformers = require_transformers()
    model = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
