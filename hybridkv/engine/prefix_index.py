"""Cross-request reuse: finished sequences kept in the cache, found by a radix tree over token ids.

Each entry is a live `CachedModel` sequence (KV blocks, the recurrent state at its full length,
its snapshots). A lookup finds, among the entries sharing a prefix with a prompt, the one whose
restore keeps the most tokens — the deepest point with a usable snapshot or live state — and the
engine forks it there: the KV blocks are shared, only the rest of the prompt is computed.

    root ─ [The quick] ─┬─ [brown fox]    entries {A}       A = "The quick brown fox"
                        └─ [red fox]      entries {B}       B = "The quick red fox"
    (a node lists every entry whose tokens cover its whole span: [The quick] lists {A, B})
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from hybridkv.cached_model import CachedModel


@dataclass(eq=False, slots=True)
class _Node:
    span: list[int]
    children: dict[int, _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)


class Match(NamedTuple):
    seq: int  # the cached sequence to fork
    length: int  # tokens it shares with the prompt (capped by the lookup's limit)
    keep: int  # tokens a fork at `length` keeps without recompute


class PrefixIndex:
    """Owns the sequences inserted into it (releases them on eviction). Lookups never mutate
    the tree; the sequences they return stay valid until the next insert, remove or evict."""

    def __init__(self, cm: CachedModel, max_entries: int) -> None:
        self.cm = cm
        self.max_entries = max_entries
        self._root = _Node([])
        self._tokens: dict[int, list[int]] = {}  # entry -> its tokens, in LRU order (oldest first)
        # Told of every entry kept and forgotten, in the thread that changes the index (the KV events).
        self.listeners: list[Callable[[Literal["insert", "remove"], list[int]], None]] = []

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, seq: int) -> bool:
        return seq in self._tokens

    def insert(self, seq: int) -> None:
        """Keep `seq` for reuse; an older entry with the same tokens is released. Evicts the least
        recently used entries beyond `max_entries` (0 keeps nothing)."""
        tokens = self.cm.tokens(seq)
        if not tokens or self.max_entries == 0:
            self.cm.release(seq)
            return
        for other, other_tokens in list(self._tokens.items()):
            if other_tokens == tokens:
                self.remove(other)
        node = self._root
        node.entries.add(seq)
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tokens[i:])
                node.children[tokens[i]] = child
            else:
                m = _common(child.span, tokens, i)
                if m < len(child.span):
                    child = self._split(node, child, m)
            child.entries.add(seq)
            node, i = child, i + len(child.span)
        self._tokens[seq] = tokens
        for listener in self.listeners:
            listener("insert", tokens)
        while len(self._tokens) > self.max_entries:
            self.evict_one()

    def _split(self, parent: _Node, child: _Node, m: int) -> _Node:
        head = _Node(child.span[:m], entries=set(child.entries))
        child.span = child.span[m:]
        head.children[child.span[0]] = child
        parent.children[head.span[0]] = head
        return head

    def lookup(self, prompt: list[int], limit: int) -> Match | None:
        """The entry whose fork at min(shared prefix, limit) keeps the most tokens, or None."""
        shared: dict[int, int] = {}
        node, depth = self._root, 0
        while depth < len(prompt):
            child = node.children.get(prompt[depth])
            if child is None:
                break
            m = _common(child.span, prompt, depth)
            for seq in child.entries:
                shared[seq] = depth + m
            if m < len(child.span):
                break
            node, depth = child, depth + m
        best: Match | None = None
        for seq, length in shared.items():
            length = min(length, limit)
            keep = self.cm.restore_point(seq, length) if length > 0 else 0
            if keep > 0 and (best is None or (keep, length) > (best.keep, best.length)):
                best = Match(seq, length, keep)
        if best is not None:  # most recently used goes last
            self._tokens[best.seq] = self._tokens.pop(best.seq)
        return best

    def remove(self, seq: int) -> None:
        """Forget `seq` and release it."""
        tokens = self._tokens.pop(seq)
        node, i = self._root, 0
        node.entries.discard(seq)
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.entries.discard(seq)
            if not child.entries:
                del node.children[tokens[i]]
                break
            node, i = child, i + len(child.span)
        self.cm.release(seq)
        for listener in self.listeners:
            listener("remove", tokens)

    def evict_one(self) -> bool:
        """Release the least recently used entry; False when there is none."""
        if not self._tokens:
            return False
        self.remove(next(iter(self._tokens)))
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass


def _common(span: list[int], tokens: list[int], start: int) -> int:
    n = min(len(span), len(tokens) - start)
    i = 0
    while i < n and span[i] == tokens[start + i]:
        i += 1
    return i
