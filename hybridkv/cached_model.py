"""`CachedModel`: a model and its hybrid cache behind one small API of sequences and tokens."""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch

from hybridkv.cache.config import CacheConfig, CacheSpec, PoolSizes, fit_pools
from hybridkv.cache.hybrid import HybridCache
from hybridkv.errors import NotSupported
from hybridkv.models import ModelConfig, Qwen3NextModel, load_model, read_checkpoint, weights_nbytes
from hybridkv.models.mtp import MTPHidden
from hybridkv.models.sources import ResolvedModel, resolve_model
from hybridkv.models.weights import MemoryShare, cache_room, check_memory_fit, format_bytes
from hybridkv.ops import native
from hybridkv.ops.malloc import keep_freed_memory
from hybridkv.ops.quant import stream

log = logging.getLogger("hybridkv")
LogitsMode = Literal["all", "last", "none"]
_DTYPES = {torch.float32, torch.bfloat16}


def cache_spec(
    config: ModelConfig, dtype: torch.dtype, mtp: bool = False, kv_dtype: torch.dtype | None = None
) -> CacheSpec:
    """What the cache holds for `config` computed in `dtype` (K/V in `kv_dtype`, default `dtype`);
    with `mtp`, the MTP layer's K/V as one more attention layer (the last) and the hidden carry in
    every state slot and snapshot (`models.mtp`)."""
    return CacheSpec(
        num_attention_layers=len(config.attention_layers) + int(mtp),
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        kv_dtype=kv_dtype or dtype,
        num_linear_layers=len(config.linear_layers),
        conv_channels=config.conv_channels,
        conv_kernel=config.linear_conv_kernel_dim,
        num_value_heads=config.linear_num_value_heads,
        key_head_dim=config.linear_key_head_dim,
        value_head_dim=config.linear_value_head_dim,
        hidden_carry_dim=config.hidden_size if mtp else 0,
    )


def _fitted_message(full: PoolSizes, sizes: PoolSizes, cache: CacheConfig, room: int, share: MemoryShare) -> str:
    """What a cache shrunk to fit (`fit_pools`) holds, and the setting that sizes it instead."""
    tokens = sizes.num_blocks * cache.block_size
    where = "the memory the weights leave"
    if share.shared:
        where = f"the memory {share.copies} copies of the weights leave, split between {share.caches} replicas"
    return (
        f"the default cache ({format_bytes(full.total_bytes)}) does not fit in half of {where} "
        f"({format_bytes(room)}): sized to {format_bytes(sizes.total_bytes)}, KV for {tokens:,} tokens "
        f"({tokens / cache.max_model_len:.1f} sequences of {cache.max_model_len:,}) and {sizes.num_snapshots:,} "
        "snapshots; --cache-memory sets its size"
    )


class CachedModel:
    """Sequences of tokens whose logits always equal a fresh no-cache recompute.

    `feed` appends tokens (one forward for the whole batch); `fork` and `truncate` restore from
    snapshots and re-feed whatever the snapshots do not cover themselves. Every call validates
    its whole input before anything changes.
    """

    def __init__(self, model: Qwen3NextModel, config: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.cache = HybridCache(cache_spec(config, dtype, model.mtp is not None, cache.kv_dtype), cache)
        self._tokens: dict[int, list[int]] = {}
        self._counters: Counter[str] = Counter()

    @classmethod
    def load(
        cls,
        model: str | Path | ResolvedModel | None = None,
        dtype: torch.dtype = torch.float32,
        cache: CacheConfig | None = None,
        quantize: str | None = None,
        mtp: bool = False,
        mtp_hidden: MTPHidden = "post_norm",
        memory: MemoryShare | None = None,
    ) -> CachedModel:
        """Load a model with a cache: a checkpoint directory, a .gguf file, an ollama name or a
        Hugging Face repo id (`resolve_model`; default: the embedded default model).

        The pool sizes and the RAM they need with the weights are checked before loading. Pools
        without a byte budget shrink together until the cache takes at most half of the memory the
        weights leave (`fit_pools`, `cache_room`), with a warning that says what it holds.
        `quantize` ('q8_0') quantizes the weights into GGUF blocks after loading (`models.quantize`;
        the check counts the float weights, which are held until each is quantized). `mtp` loads
        the checkpoint's multi-token-prediction block for `draft_mtp`, fed the main model's hidden
        state after its final norm or before it (`mtp_hidden`); NotSupported when there is none.
        `memory`: this process's share of the machine's memory when others load the same model
        (`serve --replicas`); default all of it.
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        if model is None:
            from hybridkv.default_model import default_model_dir

            model = default_model_dir()
        source = model if isinstance(model, ResolvedModel) else resolve_model(model)
        cache = cache or CacheConfig()
        model_dir = source.path  # a checkpoint directory, or the (first) GGUF file
        config, _ = read_checkpoint(model_dir)
        spec, cache_in = cache_spec(config, dtype, mtp, cache.kv_dtype), cache
        weight_bytes = weights_nbytes(model_dir, dtype, mtp=mtp)
        memory = (memory or MemoryShare()).measure()  # MemAvailable read once, for the room and the check
        room = cache_room(weight_bytes, memory)
        cache, factor = fit_pools(spec, cache, room)
        sizes = PoolSizes.plan(spec, cache)
        if factor < 1.0:
            log.warning(_fitted_message(PoolSizes.plan(spec, cache_in), sizes, cache, room, memory))
        check_memory_fit(weight_bytes, sizes.total_bytes, memory)
        loaded = load_model(model_dir, dtype, quantize=quantize, mtp=mtp_hidden if mtp else None)
        native.enabled()  # the C++ kernels built (first time on this machine, ~10 s) or loaded now, not mid-request
        stream.tune(stream.held_weights(loaded))  # decode's weight streams: fetched ahead or not, as is faster here
        keep_freed_memory()  # each step's large buffers reused, not faulted in and zeroed again
        return cls(loaded, loaded.config, cache, dtype)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def has_mtp(self) -> bool:
        """Does the loaded model carry a multi-token-prediction block to draft with?"""
        return getattr(self.model, "mtp", None) is not None

    @property
    def spec_needs_rows(self) -> bool:
        """Does verifying drafts take verify rows (`CacheConfig.verify_rows`): recurrent layers?"""
        return self.cache.spec.num_linear_layers > 0

    # -- sequences ----------------------------------------------------------------------------

    def new_sequence(self) -> int:
        seq = self.cache.add_sequence()
        self._tokens[seq] = []
        return seq

    def tokens(self, seq: int) -> list[int]:
        return list(self._known(seq))

    def length(self, seq: int) -> int:
        return len(self._known(seq))

    def release(self, seq: int) -> None:
        self._known(seq)
        self.cache.release(seq)
        del self._tokens[seq]

    def can_resume(self, seq: int, p: int) -> bool:
        self._known(seq)
        return self.cache.can_resume(seq, p)

    def _known(self, seq: int) -> list[int]:
        try:
            return self._tokens[seq]
        except (KeyError, TypeError):
            raise ValueError(f"unknown sequence {seq!r}") from None

    # -- forward ------------------------------------------------------------------------------

    def feed(
        self,
        tokens: Mapping[int, Sequence[int]],
        logits: LogitsMode | Mapping[int, LogitsMode] = "all",
        snapshot_at: Mapping[int, Iterable[int]] | None = None,
        verify: Iterable[int] = (),
    ) -> dict[int, torch.Tensor]:
        """Append tokens to sequences in one forward; returns float32 CPU logits per sequence fed:
        `[n, V]` for "all", `[1, V]` for "last", nothing for "none". `logits` is one mode for the
        whole batch or a mode per sequence (a sequence not in the mapping gets "none").

        `snapshot_at` asks for extra snapshots after the given absolute positions (on top of the
        `snapshot_interval` policy). Sequences in `verify` feed [last token, drafts...]: their
        tokens are provisional until `accept` says how many to keep. Raises ValueError (bad
        input) or CacheFull with nothing changed.
        """
        if not isinstance(tokens, Mapping):
            raise ValueError(f"feed takes {{sequence: [token ids]}}, got {type(tokens).__name__}: {tokens!r:.80}")
        modes = {seq: logits for seq in tokens} if isinstance(logits, str) else dict(logits)
        for mode in modes.values():
            if mode not in ("all", "last", "none"):
                raise ValueError(f'logits must be "all", "last" or "none", got {mode!r}')
        if not tokens:
            raise ValueError("feed needs at least one sequence with tokens")
        if unfed := [seq for seq in modes if seq not in tokens]:
            raise ValueError(f"logits asked for sequence {unfed[0]!r}, which is not fed")
        batch = {seq: self._validate_ids(seq, ids) for seq, ids in tokens.items()}
        return self._forward(batch, {seq: modes.get(seq, "none") for seq in batch}, snapshot_at, verify)

    def accept(self, seq: int, length: int) -> None:
        """After a `feed` that verified drafts for `seq`: keep its first `length` tokens, exactly
        as if only those had been fed (`HybridCache.accept`; nothing is recomputed)."""
        history = self._known(seq)
        self.cache.accept(seq, length)
        del history[length:]

    def _validate_ids(self, seq: int, ids: Sequence[int]) -> list[int]:
        self._known(seq)
        try:
            checked = [operator.index(t) for t in ids]
        except TypeError:
            raise ValueError(f"sequence {seq}: token ids must be ints, got {list(ids)[:8]!r}") from None
        if not checked:
            raise ValueError(f"sequence {seq}: empty token list")
        bad = [t for t in checked if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"sequence {seq}: token id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}")
        return checked

    def _forward(
        self,
        batch: dict[int, list[int]],
        logits: Mapping[int, LogitsMode],
        snapshot_at: Mapping[int, Iterable[int]] | None = None,
        verify: Iterable[int] = (),
    ) -> dict[int, torch.Tensor]:
        fb = self.cache.begin_forward({seq: len(ids) for seq, ids in batch.items()}, snapshot_at, verify)
        input_ids = torch.tensor([t for ids in batch.values() for t in ids], dtype=torch.int64)
        rows: dict[int, range] = {}  # sequence -> its rows in the flat token order, where logits are wanted
        for start, (seq, ids) in zip(fb.cu_seqlens[:-1].tolist(), batch.items(), strict=True):
            end = start + len(ids)
            if logits[seq] != "none":
                rows[seq] = range(start, end) if logits[seq] == "all" else range(end - 1, end)
        every = sum(len(r) for r in rows.values()) == len(input_ids)
        indices = None if every else torch.tensor([i for r in rows.values() for i in r], dtype=torch.int64)
        try:
            with torch.inference_mode():
                out = self.model(input_ids, fb, indices)
        except BaseException:
            self.cache.abort_forward(fb)
            raise
        self.cache.end_forward(fb)
        for seq, ids in batch.items():
            self._tokens[seq].extend(ids)
        self._counters["tokens_computed"] += len(input_ids)
        self._counters["forwards"] += 1
        result, at = {}, 0
        for seq, r in rows.items():
            result[seq] = out[at : at + len(r)]
            at += len(r)
        return result

    # -- drafting -----------------------------------------------------------------------------

    def draft_mtp(self, pending: Mapping[int, int], k: int) -> dict[int, list[int]]:
        """Greedy MTP drafts: sequence -> its next token (sampled, not yet fed) gives the k tokens
        the MTP block predicts after it. Reads the cache and changes nothing (see `draft_mtp_logits`)."""
        return {seq: rows.argmax(-1).tolist() for seq, rows in self.draft_mtp_logits(pending, k).items()}

    def draft_mtp_logits(self, pending: Mapping[int, int], k: int) -> dict[int, torch.Tensor]:
        """The MTP block's logits [k, V] float32 per sequence: row s scores draft s + 1, where
        draft 1 follows the pending token and each later step feeds back the argmax of the one
        before. One batched pass per step over all sequences; nothing in the cache changes.
        Raises ValueError for bad input, NotSupported when the model was loaded without MTP."""
        mtp = self.model.mtp
        if mtp is None:
            raise NotSupported("draft_mtp needs the MTP block: load with CachedModel.load(..., mtp=True)")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k (tokens to draft) must be an int >= 1, got {k!r}")
        if not pending:
            raise ValueError("draft_mtp needs at least one sequence")
        tokens = [self._validate_ids(seq, [token])[0] for seq, token in pending.items()]
        for seq in pending:
            if not self._tokens[seq]:
                raise ValueError(f"sequence {seq} is empty: MTP drafts follow a fed token")
        view = self.cache.view(list(pending))
        with torch.inference_mode():
            ids = torch.tensor(tokens, dtype=torch.int64)
            m = self.model
            logits = mtp.draft(ids, view, k, m.embed_tokens, m.rope, m.head)
        return dict(zip(pending, logits, strict=True))

    # -- fork / truncate ----------------------------------------------------------------------

    def fork(self, seq: int, length: int | None = None) -> int:
        """A new sequence with `seq`'s first `length` tokens (default all). O(1) for the whole
        history; otherwise restores the best snapshot and re-feeds the gap."""
        history = self._known(seq)
        target = len(history) if length is None else length
        child, keep = self.cache.fork(seq, target)
        self._tokens[child] = history[:keep]
        self._count_restore(needed=0 < target < len(history), keep=keep)
        self._refeed(child, history[keep:target])
        return child

    def fork_prefix(self, seq: int, length: int) -> tuple[int, int]:
        """Like `fork`, without the re-feed: returns (child, keep) with the child holding only
        `keep` tokens; the caller feeds the rest (the engine does, inside its batches)."""
        history = self._known(seq)
        child, keep = self.cache.fork(seq, length)
        self._tokens[child] = history[:keep]
        self._count_restore(needed=0 < length < len(history), keep=keep)
        return child, keep

    def restore_point(self, seq: int, p: int) -> int:
        """How many of `seq`'s first `p` tokens a fork or truncate would keep without recompute."""
        self._known(seq)
        return self.cache.restore_point(seq, p)

    def truncate(self, seq: int, p: int) -> int:
        """Keep the first `p` tokens; returns keep, the tokens the restore kept before re-feeding."""
        history = self._known(seq)
        needed = 0 < p < len(history)
        keep = self.cache.truncate(seq, p)
        self._tokens[seq] = history[:keep]
        self._count_restore(needed=needed, keep=keep)
        self._refeed(seq, history[keep:p])
        return keep

    def import_prefix(self, tokens: list[int], rows: list[list[torch.Tensor]], states: list[torch.Tensor]) -> int:
        """A new sequence holding `tokens` from saved K/V rows and recurrent states (the disk
        tier; `HybridCache.import_sequence` says the layout). CacheFull before any change."""
        seq = self.cache.import_sequence(len(tokens), rows, states)
        self._tokens[seq] = list(tokens)
        return seq

    def _refeed(self, seq: int, ids: list[int]) -> None:
        if ids:
            self._counters["tokens_recomputed"] += len(ids)
            self._forward({seq: ids}, {seq: "none"})

    def _count_restore(self, needed: bool, keep: int) -> None:
        if needed:
            self._counters["snapshot_hits" if keep > 0 else "snapshot_misses"] += 1

    # -- accounting ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        out = {
            name: self._counters[name]
            for name in (
                "tokens_computed",
                "tokens_recomputed",
                "snapshot_hits",
                "snapshot_misses",
                "forwards",
            )
        }
        out["snapshot_evictions"] = self.cache.snapshots.evictions
        out["sequences"] = len(self._tokens)
        out.update(self.cache.memory())
        return out
