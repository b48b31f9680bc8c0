"""What the user sets (`CacheConfig`), what the model dictates (`CacheSpec`), and the pool sizes
that follow from both (`PoolSizes`), computed before anything is allocated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


class BudgetTooSmall(ValueError):
    """A byte budget cannot hold one max-length sequence: `field` names the `CacheConfig` budget,
    `needed` is the fewest bytes that would (a command line rewords it in its own flags)."""

    def __init__(self, message: str, field: str, needed: int) -> None:
        super().__init__(message)
        self.field = field
        self.needed = needed


# What attention K/V blocks may be stored in (`CacheConfig.kv_dtype`), by name.
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Cache settings; every field has a working default.

    kv_bytes / state_bytes / snapshot_bytes: byte budgets of the attention KV blocks, the live
        recurrent state slots and the snapshot pool. `None` sizes the pool for `max_sequences`
        sequences of `max_model_len` tokens (and `snapshots_per_sequence` snapshots each).
    max_sequences: live sequences at once (each holds at most one recurrent state slot).
    snapshot_interval: keep a snapshot whenever a sequence's length reaches a multiple of it
        (after positions interval-1, 2*interval-1, ...); 0 turns interval snapshots off.
    verify_rows: scratch recurrent states for speculative verification: a forward verifying k
        drafts keeps the state after each of its first k positions in one row each until
        `HybridCache.accept` picks one (k per speculating sequence; 0: no speculation).
    kv_dtype: what the attention K/V blocks are stored in: None (the model's compute dtype),
        torch.float32, torch.bfloat16 or torch.float16. A narrower type holds twice the tokens in
        the same bytes; every read of the cache sees the stored (rounded) values, so results do
        not depend on how a sequence was chunked, cached or restored. Recurrent states stay float32.
    """

    kv_bytes: int | None = None
    state_bytes: int | None = None
    snapshot_bytes: int | None = None
    max_sequences: int = 16
    max_model_len: int = 4096
    block_size: int = 16
    snapshot_interval: int = 256
    snapshots_per_sequence: int = 8
    verify_rows: int = 0
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES.values():
            raise ValueError(
                f"CacheConfig.kv_dtype must be None or one of torch.{', torch.'.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        for name in ("max_sequences", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        for name in ("snapshot_interval", "snapshots_per_sequence", "verify_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CacheConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("kv_bytes", "state_bytes", "snapshot_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"CacheConfig.{name} must be None or an int >= 0 (bytes), got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Shapes and dtypes of what the cache stores for one model, and what they cost in bytes."""

    num_attention_layers: int
    num_kv_heads: int  # Hkv
    head_dim: int  # hd
    kv_dtype: torch.dtype
    num_linear_layers: int
    conv_channels: int  # C
    conv_kernel: int  # K
    num_value_heads: int  # Hv
    key_head_dim: int  # dk
    value_head_dim: int  # dv
    # D when the model drafts with its MTP block: the main model's last hidden state is carried per
    # sequence (live slots and snapshots) so the MTP layer can pair it with the next token.
    hidden_carry_dim: int = 0

    @property
    def has_state(self) -> bool:
        """Whether sequences hold a state slot (recurrent layers, or the MTP hidden carry)."""
        return self.num_linear_layers > 0 or self.hidden_carry_dim > 0

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.num_attention_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def state_bytes_per_sequence(self) -> int:
        """One slot or one snapshot: conv `[C, K-1]` + delta `[Hv, dk, dv]` float32 per linear layer,
        plus the hidden carry `[D]` float32 when there is one."""
        per_layer = self.conv_channels * (self.conv_kernel - 1)
        per_layer += self.num_value_heads * self.key_head_dim * self.value_head_dim
        return (self.num_linear_layers * per_layer + self.hidden_carry_dim) * 4


@dataclass(frozen=True, slots=True)
class PoolSizes:
    num_blocks: int
    num_slots: int
    num_snapshots: int
    kv_bytes: int
    state_bytes: int
    snapshot_bytes: int
    num_verify_rows: int = 0
    verify_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.snapshot_bytes + self.verify_bytes

    @staticmethod
    def plan(spec: CacheSpec, config: CacheConfig) -> PoolSizes:
        """Turn budgets into pool sizes; refuse a budget that cannot hold one max-length sequence."""
        blocks_per_sequence = math.ceil(config.max_model_len / config.block_size)
        block_bytes = spec.kv_bytes_per_token * config.block_size
        if config.kv_bytes is None or block_bytes == 0:
            num_blocks = config.max_sequences * blocks_per_sequence
        else:
            num_blocks = config.kv_bytes // block_bytes
        if num_blocks < blocks_per_sequence:
            raise BudgetTooSmall(
                f"CacheConfig.kv_bytes={config.kv_bytes} holds {num_blocks * config.block_size} tokens of KV "
                f"({block_bytes} bytes per {config.block_size}-token block), but one sequence of "
                f"max_model_len={config.max_model_len} needs {blocks_per_sequence * block_bytes} bytes: "
                "raise kv_bytes or lower max_model_len",
                "kv_bytes",
                blocks_per_sequence * block_bytes,
            )
        slot_bytes = spec.state_bytes_per_sequence
        if config.state_bytes is None or slot_bytes == 0:
            num_slots = config.max_sequences
        else:
            num_slots = min(config.max_sequences, config.state_bytes // slot_bytes)
        if num_slots < 1:
            raise BudgetTooSmall(
                f"CacheConfig.state_bytes={config.state_bytes} cannot hold one sequence's recurrent state "
                f"({slot_bytes} bytes): raise state_bytes",
                "state_bytes",
                slot_bytes,
            )
        if config.snapshot_bytes is None:
            num_snapshots = config.max_sequences * config.snapshots_per_sequence
        else:
            num_snapshots = config.snapshot_bytes // slot_bytes if slot_bytes else 0
        return PoolSizes(
            num_blocks=num_blocks,
            num_slots=num_slots,
            num_snapshots=num_snapshots,
            kv_bytes=num_blocks * block_bytes,
            state_bytes=num_slots * slot_bytes,
            snapshot_bytes=num_snapshots * slot_bytes,
            num_verify_rows=config.verify_rows if spec.has_state else 0,
            verify_bytes=config.verify_rows * slot_bytes,
        )


def fit_pools(spec: CacheSpec, config: CacheConfig, room: int) -> tuple[CacheConfig, float]:
    """`config` with its default-sized KV and snapshot pools (budget None) scaled down by one
    factor until the plan takes at most `room` bytes, and that factor (1.0: it fits as it is, or
    every pool has a budget). The state slots and verify rows keep their size; the KV pool keeps
    at least one `max_model_len` sequence, so a room too small for that leaves a plan over it
    (the memory check then refuses it). Scaled together, the cache holds fewer sequences' worth
    of tokens, each with its full ring of snapshots; the engine preempts and the snapshot pool
    evicts as they do with any budget."""
    sizes = PoolSizes.plan(spec, config)
    scalable = (sizes.kv_bytes if config.kv_bytes is None else 0) + (
        sizes.snapshot_bytes if config.snapshot_bytes is None else 0
    )
    if sizes.total_bytes <= room or scalable == 0:
        return config, 1.0
    factor = max(0.0, (room - (sizes.total_bytes - scalable)) / scalable)
    kv_bytes, snapshot_bytes = config.kv_bytes, config.snapshot_bytes
    block_bytes = spec.kv_bytes_per_token * config.block_size
    if kv_bytes is None and block_bytes:
        least = math.ceil(config.max_model_len / config.block_size) * block_bytes
        kv_bytes = max(least, int(sizes.kv_bytes * factor) // block_bytes * block_bytes)
    if snapshot_bytes is None:
        snapshot_bytes = int(sizes.snapshot_bytes * factor)
    return dataclasses.replace(config, kv_bytes=kv_bytes, snapshot_bytes=snapshot_bytes), factor
