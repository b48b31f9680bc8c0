"""What one forward pass reads from and writes to the cache.

The cache builds a `ForwardBatch` in `begin_forward`; the model only indexes the tensors it
carries. Token layout of a batch (flat, `T` tokens, `N` sequences):

    tokens:   | seq 0: q_lens[0] tokens | seq 1: q_lens[1] tokens | ... |
    cu_seqlens: 0 ........................ q0 ....................... T

Sequence i's new tokens sit at positions `start_lens[i] .. start_lens[i] + q_lens[i] - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _f32(x: torch.Tensor) -> torch.Tensor:
    # States are float32; skip the dispatch of the usual no-op cast.
    return x if x.dtype == torch.float32 else x.float()


@dataclass(slots=True)
class CacheTensors:
    """The preallocated pools. Attention layer `a` and linear layer `j` are numbered in layer order
    among layers of their own kind.

    key[a], value[a]:   [num_blocks, block_size, Hkv, hd]   (`CacheSpec.kv_dtype`: the compute dtype
                        unless `CacheConfig.kv_dtype` says otherwise)
    conv[j]:            [num_slots, C, K-1]                 float32, last column = newest input
    delta[j]:           [num_slots, Hv, dk, dv]             float32
    snap_conv[j]:       [num_snapshots, C, K-1]             float32
    snap_delta[j]:      [num_snapshots, Hv, dk, dv]         float32
    hidden, snap_hidden: [num_slots | num_snapshots, D]      float32, one tensor each when the model
                        drafts with its MTP block (the hidden carry, `CacheSpec.hidden_carry_dim`),
                        else empty
    """

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    conv: list[torch.Tensor]
    delta: list[torch.Tensor]
    snap_conv: list[torch.Tensor]
    snap_delta: list[torch.Tensor]
    hidden: list[torch.Tensor] = field(default_factory=list)
    snap_hidden: list[torch.Tensor] = field(default_factory=list)

    def live_states(self) -> list[torch.Tensor]:
        """Every per-slot state pool, in the order `snapshot_states` pairs them."""
        return [*self.conv, *self.delta, *self.hidden]

    def snapshot_states(self) -> list[torch.Tensor]:
        return [*self.snap_conv, *self.snap_delta, *self.snap_hidden]


@dataclass(slots=True)
class ForwardBatch:
    """One forward's view of the cache; valid only until the next cache operation.

    seq_ids:        the sequences, in token order
    q_lens:         new tokens per sequence (>= 1)
    start_lens:     tokens already cached per sequence before this forward
    cu_seqlens:     [N+1] int64, cumulative q_lens
    positions:      [T] int64, absolute position of every new token
    block_tables:   [N, max_blocks] int64, block ids covering positions 0..kv_len-1 (padded with 0)
    kv_lens:        [N] int64, start_lens + q_lens
    slot_mapping:   [T] int64, row of each new token in the flat [num_blocks * block_size] K/V view
    state_slots:    [N] int64, recurrent state slot of each sequence (private: copy-on-write done)
    snapshot_at:    [S] int64, ascending flat token indices after which the recurrent state is kept
    snapshot_ids:   [S] int64, snapshot pool rows receiving those states
    """

    seq_ids: tuple[int, ...]
    q_lens: tuple[int, ...]
    start_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    snapshot_at: torch.Tensor
    snapshot_ids: torch.Tensor
    tensors: CacheTensors

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    is_decode: bool = field(init=False)
    """Every sequence feeds exactly one token: the recurrent step forms apply."""
    _token_tables: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.is_decode = all(n == 1 for n in self.q_lens)

    # -- attention layers -------------------------------------------------------------------

    def store_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this batch's key/value rows `[T, Hkv, hd]` of attention layer `layer`."""
        k_pool, v_pool = self.tensors.key[layer], self.tensors.value[layer]
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, self.slot_mapping, key.to(k_pool.dtype))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, self.slot_mapping, value.to(v_pool.dtype))

    def kv_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors.key[layer], self.tensors.value[layer]

    def token_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: its sequence's block table row [T, max_blocks] and the positions it sees,
        kv length position + 1 [T]: a batch of few tokens (a verify, short chunks) attends token
        by token as a decode step does, every row of the batch already written. The same tensors
        as `block_tables`, `kv_lens` when every sequence feeds one token. Built once a forward,
        for its first attention layer."""
        if self.is_decode:
            return self.block_tables, self.kv_lens
        if self._token_tables is None:
            owner = torch.repeat_interleave(torch.arange(len(self.q_lens)), torch.tensor(self.q_lens))
            self._token_tables = self.block_tables.index_select(0, owner), self.positions + 1
        return self._token_tables

    # -- linear-attention layers ------------------------------------------------------------

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the live states of linear layer `layer`: conv `[N, C, K-1]`, delta `[N, Hv, dk, dv]`."""
        return (
            self.tensors.conv[layer].index_select(0, self.state_slots),
            self.tensors.delta[layer].index_select(0, self.state_slots),
        )

    def linear_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The state pools of linear layer `layer`, for kernels that update `state_slots` in place:
        conv, delta, snap_conv, snap_delta (see `CacheTensors`)."""
        t = self.tensors
        return t.conv[layer], t.delta[layer], t.snap_conv[layer], t.snap_delta[layer]

    def store_linear_state(
        self,
        layer: int,
        conv: torch.Tensor,
        delta: torch.Tensor,
        conv_snapshots: torch.Tensor,
        delta_snapshots: torch.Tensor,
    ) -> None:
        """Write the final states `[N, ...]` and the states after `snapshot_at` `[S, ...]`."""
        t = self.tensors
        t.conv[layer].index_copy_(0, self.state_slots, _f32(conv))
        t.delta[layer].index_copy_(0, self.state_slots, _f32(delta))
        if self.snapshot_ids.numel():
            t.snap_conv[layer].index_copy_(0, self.snapshot_ids, _f32(conv_snapshots))
            t.snap_delta[layer].index_copy_(0, self.snapshot_ids, _f32(delta_snapshots))

    # -- the MTP hidden carry -----------------------------------------------------------------

    def hidden_carry(self) -> torch.Tensor:
        """The carried hidden state `[N, D]` float32 of each sequence: the main model's hidden after
        its last cached token (zeros for an empty sequence)."""
        return self.tensors.hidden[0].index_select(0, self.state_slots)

    def store_hidden_carry(self, hidden: torch.Tensor) -> None:
        """Keep this forward's hidden rows `[T, D]`: the last row of each sequence as its carry, and
        the rows at `snapshot_at` in the snapshots beside the recurrent states."""
        t = self.tensors
        last = self.cu_seqlens[1:] - 1
        t.hidden[0].index_copy_(0, self.state_slots, _f32(hidden.index_select(0, last)))
        if self.snapshot_ids.numel():
            t.snap_hidden[0].index_copy_(0, self.snapshot_ids, _f32(hidden.index_select(0, self.snapshot_at)))


@dataclass(slots=True)
class CacheView:
    """Where some sequences' cached K/V and live states are, for a pass that reads the cache and
    writes nothing (MTP drafting); valid only until the next cache operation.

    seq_ids:        the sequences, in row order
    block_tables:   [N, max_blocks] int64, block ids covering positions 0..kv_lens-1 (padded with 0)
    kv_lens:        [N] int64, each sequence's length
    state_slots:    [N] int64, each sequence's live state slot
    """

    seq_ids: tuple[int, ...]
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    state_slots: torch.Tensor
    tensors: CacheTensors

    def kv_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors.key[layer], self.tensors.value[layer]

    def hidden_carry(self) -> torch.Tensor:
        """`[N, D]` float32: see `ForwardBatch.hidden_carry`."""
        return self.tensors.hidden[0].index_select(0, self.state_slots)
