"""Test helpers: a minimal stand-in for the cache (the transformers side lives in hf_reference).

`TinyCache` allocates pools for a few fresh sequences and builds `ForwardBatch`es by hand, so the
model can be tested without the real cache: sequence i owns state slot i and blocks
i, i + N, i + 2N, ... (interleaved, so a sequence's K/V is spread over non-adjacent blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hf_reference import TINY, hf_logits, make_hf_model, save_checkpoint

from hybridkv.cache.batch import CacheTensors, ForwardBatch
from hybridkv.models import ModelConfig, Qwen3NextModel

__all__ = ["TINY", "TinyCache", "hf_logits", "make_hf_model", "save_checkpoint"]


class TinyCache:
    """Pools for `num_seqs` fresh sequences of up to `max_len` tokens, and batches over them."""

    def __init__(
        self,
        config: ModelConfig,
        num_seqs: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        block_size: int = 4,
        num_snapshots: int = 0,
    ) -> None:
        c = config
        blocks_per_seq = math.ceil(max_len / block_size)
        num_blocks = blocks_per_seq * num_seqs
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        conv_shape = (c.conv_channels, c.linear_conv_kernel_dim - 1)
        delta_shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        n_att, n_lin = len(c.attention_layers), len(c.linear_layers)
        self.tensors = CacheTensors(
            key=[torch.zeros(kv_shape, dtype=dtype) for _ in range(n_att)],
            value=[torch.zeros(kv_shape, dtype=dtype) for _ in range(n_att)],
            conv=[torch.zeros(num_seqs, *conv_shape) for _ in range(n_lin)],
            delta=[torch.zeros(num_seqs, *delta_shape) for _ in range(n_lin)],
            snap_conv=[torch.zeros(num_snapshots, *conv_shape) for _ in range(n_lin)],
            snap_delta=[torch.zeros(num_snapshots, *delta_shape) for _ in range(n_lin)],
        )
        self.block_size, self.max_len = block_size, max_len
        self.block_tables = torch.tensor(
            [[b * num_seqs + i for b in range(blocks_per_seq)] for i in range(num_seqs)], dtype=torch.long
        )
        self.lens = [0] * num_seqs

    def batch(
        self,
        feeds: Sequence[tuple[int, int]],
        snapshot_at: Sequence[int] = (),
        snapshot_ids: Sequence[int] = (),
    ) -> ForwardBatch:
        """A batch feeding `n` new tokens to sequence `seq` for each `(seq, n)` in `feeds`."""
        seq_ids = tuple(seq for seq, _ in feeds)
        q_lens = tuple(n for _, n in feeds)
        start_lens = tuple(self.lens[seq] for seq in seq_ids)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_lens, q_lens, strict=True)])
        seq_of_token = torch.repeat_interleave(torch.tensor(seq_ids), torch.tensor(q_lens))
        blocks = self.block_tables[seq_of_token, positions // self.block_size]
        kv_lens = torch.tensor([s + n for s, n in zip(start_lens, q_lens, strict=True)])
        assert int(kv_lens.max()) <= self.max_len
        return ForwardBatch(
            seq_ids=seq_ids,
            q_lens=q_lens,
            start_lens=start_lens,
            cu_seqlens=torch.tensor([0, *q_lens]).cumsum(0),
            positions=positions,
            block_tables=self.block_tables[list(seq_ids)],
            kv_lens=kv_lens,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            state_slots=torch.tensor(seq_ids),
            snapshot_at=torch.tensor(snapshot_at, dtype=torch.long),
            snapshot_ids=torch.tensor(snapshot_ids, dtype=torch.long),
            tensors=self.tensors,
        )

    def run(
        self,
        model: Qwen3NextModel,
        feeds: Sequence[tuple[int, Sequence[int]]],
        snapshot_at: Sequence[int] = (),
        snapshot_ids: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """One forward feeding `tokens` to `seq` for each `(seq, tokens)`; returns each feed's logits."""
        batch = self.batch([(seq, len(tokens)) for seq, tokens in feeds], snapshot_at, snapshot_ids)
        input_ids = torch.tensor([t for _, tokens in feeds for t in tokens])
        logits = model(input_ids, batch)
        for seq, tokens in feeds:
            self.lens[seq] += len(tokens)
        return list(logits.split(list(batch.q_lens)))
