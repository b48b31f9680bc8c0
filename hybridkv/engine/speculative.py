"""Speculative decoding: drafts that guess the next tokens, and how many to guess.

A speculating branch feeds [its pending token, d1..dm] in one forward (`CachedModel.feed(...,
verify=...)`); the engine samples the m+1 rows in order with the branch's own sampler and keeps
the tokens up to the first one that differs from its draft (`CachedModel.accept`). Drafts are
point guesses, so this *is* the standard rejection rule: accepting d with probability p(d) and
otherwise drawing from p without d, renormalised, is the same as drawing from p and comparing
with d. Every token therefore comes from exactly the distribution plain decoding samples from
(penalties, top-k/p, min-p and grammar masks applied at every position), drawn with the same
generator in the same order — a seeded request gives the same tokens with or without
speculation whenever the verify forward's logits equal the one-token forward's.

Drafts:
- `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of the last
  n tokens (n from `ngram_max` down to `ngram_min`) in the prompt and output.
- `mtp`: the checkpoint's multi-token-prediction block (`CachedModel.draft_mtp`).
- `auto`: ngram with `AdaptiveDraft` choosing k and pausing where drafts fail. (Not mtp: on the
  default model a draft step is a quarter of a forward, so k drafts cost about what the verify
  forward saves; see the README.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

SpecMethod = Literal["off", "ngram", "mtp", "auto"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("off", "ngram", "mtp", "auto")


# k when `num_tokens` is not given. Lookup drafts are free to make and a forward costs about the
# same at any width while few sequences verify, so long ones pay where the text is copied (the
# default model, code editing at batch 1, every lookup drafting k: 1.72x at k = 4, 1.87x at k = 8
# in one run); a lookup drafts up to k, as long as its copy so far (`NGRAM_MIN_DRAFT`). Each MTP
# draft is a decoder layer and the head, and its later positions are seldom accepted.
DEFAULT_TOKENS: dict[str, int] = {"ngram": 16, "auto": 16, "mtp": 4}
# The shortest lookup draft: `NgramIndex.propose` drafts as many tokens as the text has been
# copying its match, at least this many. The default model's spec prompts, each variant against
# plain decoding in one process, 8 repetitions: code editing 1.79-1.86x with k = 8 drafted
# always, 1.85-2.10x with k = 16 and this rule (floors 2 to 8); free text 1.20-1.49x
# against 1.29-1.59x (floor 4), where k = 16 always measured 1.38-1.44x: a long draft pays
# where the copy goes on, and the rule keeps 60-80% of the drafted tokens, not 30-70%.
NGRAM_MIN_DRAFT = 4
# Drafts one forward verifies in all. The default model, code editing, 8 sequences: 1.21x with 3
# drafts each, 1.13x with 4, 1.00x with 8 (one run): there the verify rows are compute.
DRAFT_BUDGET = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """method: the draft ("off" speculates nothing). num_tokens: k, the most drafts one forward
    verifies per sequence (None: the method's default, `DEFAULT_TOKENS`). draft_budget: the most
    drafts one forward verifies in all, shared by the sequences drafting in it (`per_sequence`):
    with many sequences the verify rows are compute the forward pays for, not free width.
    ngram_max / ngram_min: the n-gram lengths prompt lookup matches."""

    method: SpecMethod = "off"
    num_tokens: int | None = None
    ngram_max: int = 4
    ngram_min: int = 2
    draft_budget: int = DRAFT_BUDGET

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if self.num_tokens is not None and (not isinstance(self.num_tokens, int) or not 1 <= self.num_tokens <= 16):
            raise ValueError(f"num_speculative_tokens must be an int in 1..16, got {self.num_tokens!r}")
        if not isinstance(self.draft_budget, int) or self.draft_budget < 1:
            raise ValueError(f"speculative draft_budget must be a positive int, got {self.draft_budget!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int) and self.ngram_min >= 1):
            raise ValueError("ngram_min and ngram_max must be positive ints")
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max={self.ngram_max} is below ngram_min={self.ngram_min}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def k(self) -> int:
        """The most drafts per sequence: `num_tokens`, or the method's default (0 when off)."""
        if not self.enabled:
            return 0
        return self.num_tokens if self.num_tokens is not None else DEFAULT_TOKENS[self.method]

    def per_sequence(self, drafting: int) -> int:
        """The most drafts each of `drafting` sequences verifies in one forward: k, or an equal
        share of `draft_budget` (at least 1) when that is less."""
        return min(self.k, max(1, self.draft_budget // max(drafting, 1)))

    def verify_rows(self, max_num_seqs: int) -> int:
        """Verify rows (scratch recurrent states) enough for any forward of up to `max_num_seqs`
        sequences: one per draft, so k × sequences, or the budget (or one each) when smaller."""
        return min(self.k * max_num_seqs, max(self.draft_budget, max_num_seqs))


class NgramIndex:
    """Prompt lookup over one growing token list: for every n-gram (n_min <= n <= n_max) the
    position right after its latest occurrence that has a continuation. `extend` appends tokens
    (O(n_max) each); `propose(k)` is a few dict lookups and a backward comparison."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._follow: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending just before `token` now have a continuation
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._follow[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen before; [] when none was. The draft
        is as long as the present has been copying that occurrence (the tokens before both agree,
        the matched suffix included), at least `NGRAM_MIN_DRAFT`: a long copy tends to go on, a
        short match is often chance. A match p tokens back whose continuation runs into the
        present (a loop of period p shorter than the draft) continues periodically."""
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            start = self._follow.get(tuple(self.tokens[end - n :]))
            if start is not None:
                run = n
                while run < k and run < start and self.tokens[start - 1 - run] == self.tokens[end - 1 - run]:
                    run += 1
                length = min(k, max(NGRAM_MIN_DRAFT, run))
                drafts = self.tokens[start : start + length]
                period = end - start
                for j in range(len(drafts), length):
                    drafts.append(drafts[j - period])
                return drafts
        return []


@dataclass(slots=True)
class AdaptiveDraft:
    """How many tokens to draft next for one branch (`auto`): one more after a fully accepted
    draft, the accepted length plus one after a partial one; after `patience` verifies in a row
    that accepted nothing, drafting pauses for `pause` steps (doubling each time, up to 64), so a
    text the draft cannot guess costs almost nothing over plain decoding."""

    k_max: int
    k: int = 2
    patience: int = 3
    misses: int = 0
    pause: int = 4
    paused_for: int = 0

    def next_k(self) -> int:
        if self.paused_for > 0:
            self.paused_for -= 1
            return 0
        return min(self.k, self.k_max)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, self.k_max)
        else:
            self.k = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= self.patience:
            self.paused_for, self.pause, self.misses = self.pause, min(self.pause * 2, 64), 0
        elif accepted:
            self.pause = 4


@dataclass(slots=True)
class BranchDrafts:
    """A branch's speculation state: its lookup index, its k, and the verify in flight
    (`start`: the sequence length before it; `drafts`; `before`: outputs before it)."""

    index: NgramIndex | None
    adaptive: AdaptiveDraft | None
    seen: int = 0  # prompt + output tokens already in `index`
    start: int = -1
    drafts: list[int] = field(default_factory=list)
    before: int = 0

    @property
    def verifying(self) -> bool:
        return self.start >= 0

    def end_verify(self) -> None:
        self.start, self.drafts = -1, []
