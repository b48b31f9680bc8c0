"""The engine: continuous batching over a `CachedModel`, with prefix reuse and preemption.

One step = the scheduler picks what to feed (a decode token for every running completion, then
prompt chunks under the token budget), the model runs one forward for all of it, and the
results are sampled, checked for stops and streamed. Finished and cancelled sequences go into
the prefix index (and, with a disk tier, to disk: `disk_tier.py`), so the next request sharing a
prefix (the next turn of a chat, a shared system prompt, the same prompt sent again after a
disconnect or a restart) computes only what is new.

Prompt logprobs (`SamplingParams.prompt_logprobs`) are recomputed, never reused: a request that
asks for them computes its whole prompt in fresh forwards, because positions served from the
prefix cache have KV and recurrent state but no logits, and keeping per-position logprobs (and
top-k lists, for every k a later request might ask) beside every cached prefix would cost more
memory than the recompute costs time. Every figure then comes from one forward over exactly the
request's tokens. Its sequence still goes into the prefix index, so the requests after it reuse it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.cached_model import CachedModel, LogitsMode
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.engine.grammar import GrammarError, Grammars
from hybridkv.engine.prefix_index import PrefixIndex
from hybridkv.engine.request import Branch, Completion, FinishReason, Request, StreamEvent
from hybridkv.engine.sampling import RequestSampler, SamplingParams, StopChecker, sample_batch, score_tokens
from hybridkv.engine.speculative import AdaptiveDraft, BranchDrafts, NgramIndex, SpeculativeConfig
from hybridkv.engine.threads import IdleCores
from hybridkv.engine.tokenizer import IncrementalDecoder, Tokenizer
from hybridkv.errors import CacheFull

log = logging.getLogger("hybridkv.engine")
# Prompt tokens a scoring request (prompt logprobs) feeds per step: its logits are [rows, V]
# float32, 256 MB at a 248k vocabulary, whatever the token budget.
SCORED_ROWS_PER_STEP = 256


class QueueFull(RuntimeError):
    """The engine's queue bound is reached: retry later."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """max_num_seqs: completions decoding at once. max_num_batched_tokens: tokens per forward.
    max_cached_sequences: finished sequences kept for reuse (None: whatever the cache's
    `max_sequences` leaves beyond `max_num_seqs`). max_queue: waiting requests before refusing.
    speculative: drafts verified per step (`engine.speculative`; the cache needs
    `CacheConfig.verify_rows`)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 1024
    prefix_caching: bool = True
    max_cached_sequences: int | None = None
    max_queue: int = 256
    min_shared_prefix: int = 32
    adapt_threads: bool = False
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {getattr(self, name)!r}")


class Engine:
    """Thread-safe front (`add_request`, `cancel`, `metrics`) over a single-threaded core (`step`),
    driven either by the caller (`run_until_done`) or by a background thread (`start`)."""

    def __init__(
        self,
        cm: CachedModel,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        generation_config: Mapping[str, Any] | None = None,
        cores: IdleCores | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        """`cores`: the thread governor, made before the model was loaded (`LLM` does); with
        `adapt_threads` and none given, one is made here. `disk`: the tier under the prefix index
        (with prefix caching only)."""
        self.cm = cm
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.generation_config = dict(generation_config or {})
        self.grammars = Grammars(tokenizer, cm.vocab_size)
        self.cores = cores or (IdleCores() if config.adapt_threads else None)
        cache = cm.cache.config
        if cache.max_sequences < config.max_num_seqs + 1:
            raise ValueError(
                f"CacheConfig.max_sequences={cache.max_sequences} must exceed max_num_seqs={config.max_num_seqs}"
            )
        spec = config.speculative
        if spec.enabled and cache.verify_rows < spec.per_sequence(1) and cm.spec_needs_rows:
            raise ValueError(
                f"speculative decoding needs CacheConfig.verify_rows >= {spec.per_sequence(1)}, the drafts one "
                f"sequence verifies ({spec.verify_rows(config.max_num_seqs)} lets every sequence speculate), "
                f"got {cache.verify_rows}"
            )
        if spec.method == "mtp" and not cm.has_mtp:
            raise ValueError(
                "--speculative mtp needs a model with a multi-token-prediction block (mtp.* weights); "
                "this one has none: use ngram or auto"
            )
        cached = config.max_cached_sequences
        if cached is None:
            cached = cache.max_sequences - config.max_num_seqs
        self.index = PrefixIndex(cm, cached if config.prefix_caching else 0)
        self.disk = disk if config.prefix_caching else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters: Counter[str] = Counter()
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._plain_step = False  # the last forward with drafts did not fit: decode without them once

    # -- thread-safe API ----------------------------------------------------------------------

    def make_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        cache_hint: tuple[int, ...] | list[int] = (),
        on_event: Callable[[StreamEvent], None] | None = None,
    ) -> Request:
        """A validated request (ValueError naming what to fix); `add_request` queues it."""
        params = (params or SamplingParams()).with_defaults(self.generation_config)
        vocab, max_len = self.cm.vocab_size, self.cm.cache.config.max_model_len
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]!r} is outside the vocabulary 0..{vocab - 1}")
        if len(prompt_ids) >= max_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len={max_len} leaves no room to generate")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        hint = tuple(cache_hint)
        if any(not isinstance(p, int) or not 0 <= p < len(prompt_ids) for p in hint):
            raise ValueError(f"cache_hint positions must lie in 0..{len(prompt_ids) - 1}, got {list(hint)[:8]}")
        if params.grammar is not None:
            self.grammars.check(params.grammar)  # GrammarError (a ValueError) naming what cannot be enforced
        return Request(list(prompt_ids), params, hint, on_event=on_event)

    def add_request(self, request: Request) -> Request:
        with self._lock:
            if len(self._inbox) + len(self.waiting) >= self.config.max_queue:
                self.counters["requests_rejected"] += 1
                raise QueueFull(f"{self.config.max_queue} requests are waiting; retry later")
            self._inbox.append(request)
            self._lock.notify()
        return request

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step boundary; what it computed is kept for reuse (`_cancel`)."""
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify()

    def start(self) -> None:
        """Run steps in a background thread until `shutdown`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hybridkv-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Cancel everything and stop the background thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drain_inbox()
        for request in [*self.running, *self.waiting]:
            self._cancel(request)
        if self.disk is not None:  # what entered the index goes to disk before the process ends
            self.disk.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._cancels or self.running or self.waiting):
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug: fail what is running, keep serving
                log.exception("engine step failed; cancelling running requests")
                for request in list(self.running):
                    self._cancel(request, keep=False)

    def run_until_done(self) -> None:
        """Drive the engine in this thread until nothing is queued or running."""
        while True:
            with self._lock:
                idle = not (self._inbox or self._cancels or self.running or self.waiting)
            if idle:
                return
            self.step()

    def metrics(self) -> dict[str, int]:
        out = dict(self.counters)
        out["requests_running"] = len(self.running)
        out["requests_waiting"] = len(self.waiting) + len(self._inbox)
        out["cached_sequences"] = len(self.index)
        out.update(self.cm.cache.memory())
        if self.disk is not None:
            out.update(self.disk.metrics())  # type: ignore[arg-type]  # seconds are floats
        return out

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> None:
        if self.disk is not None:
            self.disk.release_written()
        self._drain_inbox()
        self._admit()
        feeds, plan, snapshots, modes = self._plan()
        if not feeds:
            return
        if self.cores is not None:
            self.cores.update()
        verify = [b.seq for _, b, *_ in plan if b.seq is not None and b.spec is not None and b.spec.verifying]
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = self.cm.feed(feeds, logits=modes, snapshot_at=snapshots, verify=verify)
        except CacheFull:
            self._drop_drafts(plan)
            if verify:  # drafts made it too big: the next step decodes plainly first
                self._plain_step = True
                return
            self._relieve_pressure()
            return
        except BaseException:  # interrupted or failed mid-forward: never reuse what it fed
            self._drop_drafts(plan)
            for _, branch, *_ in plan:
                branch.intact = False
            raise
        self._plain_step = False
        self.counters["steps"] += 1
        self.counters["forward_us"] += int(1e6 * (time.perf_counter() - start))
        sampling: list[tuple[Request, Branch, torch.Tensor]] = []
        verifying: list[tuple[Request, Branch, torch.Tensor]] = []
        for request, branch, fed_backlog, fed_pending, sample in plan:
            assert branch.seq is not None
            rows = logits.get(branch.seq)
            verifies = branch.spec is not None and branch.spec.verifying
            if modes[branch.seq] == "all" and not verifies:  # a scored prompt chunk
                assert rows is not None
                self._score_prompt(request, self.cm.length(branch.seq) - len(rows), rows)
            del branch.backlog[:fed_backlog]
            request.usage.computed_tokens += fed_backlog
            self.counters["prompt_tokens_computed"] += fed_backlog
            if fed_pending:
                branch.pending = None
            if sample and verifies:
                assert rows is not None
                verifying.append((request, branch, rows))
                sampling.append((request, branch, rows[0]))
            elif sample:
                assert rows is not None
                sampling += self._sampling_rows(request, branch, rows[-1])
        if sampling:
            self._sample(sampling)
        if verifying:
            self._verify(verifying)

    # -- speculative decoding -----------------------------------------------------------------

    def _drafts(self, decoding: list[tuple[Request, Branch]], budget: int) -> dict[int, list[int]]:
        """Drafts for the branches about to decode (sequence -> tokens after its pending one),
        within each one's share of the draft budget (`SpeculativeConfig.per_sequence` over the
        branches that have a draft), the step's token budget, the free verify rows, the context
        and each request's max_tokens."""
        config = self.config.speculative
        rows = self.cm.cache.verify_rows.num_free if self.cm.spec_needs_rows else 1 << 30
        budget -= len(decoding)  # every branch feeds its pending token anyway
        wanted: dict[int, int] = {}
        owner: dict[int, tuple[Request, Branch]] = {}
        for request, branch in decoding:
            spec = branch.spec
            if spec is None or branch.seq is None:
                continue
            k = spec.adaptive.next_k() if spec.adaptive is not None else config.k
            room = self.cm.cache.config.max_model_len - self.cm.length(branch.seq) - 1
            if request.params.max_tokens is not None:
                room = min(room, request.params.max_tokens - len(branch.completion.token_ids) - 1)
            k = min(k, room)
            if k > 0:
                wanted[branch.seq], owner[branch.seq] = k, (request, branch)
        # Lookups first (a few dict reads each): only the branches that found a draft share the budget.
        proposed: dict[int, list[int]] = {}
        for seq, k in wanted.items():
            request, branch = owner[seq]
            spec = branch.spec
            if spec is not None and spec.index is not None:
                _index_tokens(spec, request.prompt_ids, branch.completion.token_ids)
                proposed[seq] = spec.index.propose(k)
        drafting = [seq for seq in wanted if proposed.get(seq, True)]  # an MTP branch always drafts
        share = config.per_sequence(len(drafting))
        granted: dict[int, int] = {}
        for seq in drafting:
            k = min(wanted[seq], share, budget, rows)
            if k > 0:
                granted[seq] = k
                budget -= k
                rows -= k
        drafts = {seq: proposed[seq][:k] for seq, k in granted.items() if seq in proposed}
        mtp = {seq: k for seq, k in granted.items() if seq not in proposed}
        if mtp:
            pending = {seq: owner[seq][1].pending for seq in mtp}
            made = self.cm.draft_mtp({s: t for s, t in pending.items() if t is not None}, max(mtp.values()))
            drafts.update({seq: made[seq][:k] for seq, k in mtp.items()})
        return {seq: d for seq, d in drafts.items() if d}

    def _verify(self, verifying: list[tuple[Request, Branch, torch.Tensor]]) -> None:
        """Row 0 of every verify was sampled with the step's other rows; now rows 1.. in order,
        each while the tokens sampled before it were its drafts, then every verify is settled.
        A branch whose choice is a plain argmax (`RequestSampler.argmax_only`) takes all its rows'
        tokens from one argmax and records them in order while its drafts hold: the same tokens."""
        for request, branch, rows in verifying:
            if branch.sampler.argmax_only:  # in place: a copy of [k, V] rows would be MBs at 248k tokens
                for i, token in enumerate(rows[1:].argmax(1).tolist(), start=1):
                    if not _draft_holds(branch, i):
                        break
                    self._record(request, branch, token, None, None)
        sampled = [v for v in verifying if not v[1].sampler.argmax_only]
        for i in range(1, max((len(rows) for *_, rows in sampled), default=1)):
            holding = [(r, b, rows[i]) for r, b, rows in sampled if _draft_holds(b, i)]
            if not holding:
                break
            self._sample(holding)
        for request, branch, _ in verifying:
            if branch.spec is not None and branch.spec.verifying:
                self._settle(request, branch)

    def _settle(self, request: Request, branch: Branch) -> None:
        """Keep the verified tokens of `branch`'s sequence (the pending token and the drafts that
        were sampled again), count the acceptance, and end the verify."""
        spec = branch.spec
        assert spec is not None and spec.verifying and branch.seq is not None
        out = branch.completion.token_ids
        recorded = len(out) - spec.before
        accepted = 0
        while accepted < min(recorded, len(spec.drafts)) and out[spec.before + accepted] == spec.drafts[accepted]:
            accepted += 1
        self.cm.accept(branch.seq, spec.start + recorded)
        self.counters["spec_draft_tokens"] += len(spec.drafts)
        self.counters["spec_accepted_tokens"] += accepted
        request.usage.draft_tokens += len(spec.drafts)
        request.usage.accepted_tokens += accepted
        for position in range(1, accepted + 1):
            self.counters[f"spec_accepted_tokens_{position}"] += 1
        for position in range(1, len(spec.drafts) + 1):
            self.counters[f"spec_draft_tokens_{position}"] += 1
        if spec.adaptive is not None:
            spec.adaptive.update(len(spec.drafts), accepted)
        spec.end_verify()

    def _drop_drafts(self, plan: list[tuple[Request, Branch, int, bool, bool]]) -> None:
        """The forward did not run (or failed): its verifies never happened."""
        for _, branch, *_ in plan:
            if branch.spec is not None:
                branch.spec.end_verify()

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        self.waiting.extend(inbox)
        for request in [*self.running, *self.waiting]:
            if request.request_id in cancels:
                self._cancel(request)

    def _admit(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            in_use = sum(len(r.branches) if r.branches else 1 for r in self.running)
            if in_use + request.params.n > self.config.max_num_seqs or self._worth_waiting(request):
                return
            if not self._fits(request):
                return
            if not self._place(request):
                return
            self.waiting.popleft()
            self.running.append(request)
            request.queued = False

    def _fits(self, request: Request) -> bool:
        """Admit only what the free KV blocks can take after the running requests' own remaining
        prompts and next verify (evicting cached sequences to make room); an empty engine always
        admits."""
        bs = self.cm.cache.config.block_size
        spec = self.config.speculative
        ahead = 1 + spec.k  # tokens a step may feed past the backlog
        longest = len(request.prompt_ids) + max((len(b.completion.token_ids) for b in request.branches), default=0)
        need = request.params.n * math.ceil((longest + ahead) / bs)
        while self.running:
            reserved = 0
            for other in self.running:
                for branch in other.branches:
                    if branch.seq is not None and not branch.finished:
                        now = self.cm.length(branch.seq)
                        reserved += math.ceil((now + len(branch.backlog) + ahead) / bs) - math.ceil(now / bs)
            if self.cm.cache.blocks.num_free - reserved >= need:
                return True
            if not self._evict_one():
                return False
        return True

    def _worth_waiting(self, request: Request) -> bool:
        """True while a running request is still computing a prompt prefix this one shares
        (two requests with one system prompt arriving together): once it has passed that point,
        this request forks it there instead of computing the prefix a second time."""
        if not self.config.prefix_caching or request.branches or request.scoring_prompt:
            return False
        prompt = request.prompt_ids
        for other in self.running:
            head = other.branches[0]
            if head.seq is None or not head.backlog or head.completion.token_ids:
                continue
            shared = _common_prefix(other.prompt_ids, prompt)
            if shared > self.cm.length(head.seq) and shared >= self.config.min_shared_prefix:
                return True
        return False

    def _place(self, request: Request) -> bool:
        """Give every unfinished branch that needs one a sequence, reusing the longest cached prefix."""
        fresh = not request.branches
        if fresh:
            request.branches = [self._branch(request, i) for i in range(request.params.n)]
            request.usage.prompt_tokens = len(request.prompt_ids)
        resumed = [b for b in request.branches if not b.finished and b.completion.token_ids]
        todo = resumed or request.branches[:1]
        made: list[Branch] = []
        scoring = request.scoring_prompt  # needs logits at every prompt position: reuses nothing
        if scoring:
            request.prompt_logprobs.clear()  # scored again from the start (after a preemption)
        for branch in todo:
            ids = request.prompt_ids + branch.completion.token_ids[:-1]
            pending = branch.completion.token_ids[-1] if branch.completion.token_ids else None
            limit = 0 if scoring else len(ids) if pending is not None else len(ids) - 1
            placed = self._sequence_for(ids, limit)
            if placed is None:
                for undo in made:
                    assert undo.seq is not None
                    self.cm.release(undo.seq)
                    undo.seq = None
                return False
            branch.seq, keep, from_disk = placed
            branch.placed, branch.intact = keep, True
            branch.backlog, branch.pending = ids[keep:], pending
            made.append(branch)
            if fresh:
                request.usage.cached_tokens = keep
                self.counters["prompt_tokens_disk" if from_disk else "prompt_tokens_cached"] += keep
        return True

    def _sequence_for(self, ids: list[int], limit: int) -> tuple[int, int, bool] | None:
        """A sequence holding the longest restorable prefix of `ids` (at most `limit` tokens):
        forked from a finished sequence in the index or a running one, read from the disk tier,
        else new. Returns (sequence, tokens it holds, from disk), or None when the cache has no
        room even after evictions."""
        while True:
            try:
                source = self._best_source(ids, limit) if self.config.prefix_caching else None
                keep = self.cm.restore_point(*source) if source is not None else 0
                if self.disk is not None and limit > keep:
                    restored = self.disk.restore(ids, limit, better_than=keep)
                    if restored is not None:
                        return (*restored, True)
                if source is not None:
                    return (*self.cm.fork_prefix(*source), False)
                return self.cm.new_sequence(), 0, False
            except CacheFull:
                if not self._evict_one():
                    return None

    def _best_source(self, ids: list[int], limit: int) -> tuple[int, int] | None:
        match = self.index.lookup(ids, limit)
        best = (match.keep, match.seq, match.length) if match else (0, -1, 0)
        for request in self.running:
            for branch in request.branches:
                if branch.seq is not None:
                    length = min(_common_prefix(self.cm.tokens(branch.seq), ids), limit)
                    keep = self.cm.restore_point(branch.seq, length) if length else 0
                    if keep > best[0]:
                        best = (keep, branch.seq, length)
        return (best[1], best[2]) if best[0] > 0 else None

    def _branch(self, request: Request, index: int) -> Branch:
        params = request.params
        grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        return Branch(
            Completion(index),
            RequestSampler(params, request.prompt_ids, branch=index, grammar=grammar),
            StopChecker.from_params(params, self.tokenizer.eos_token_ids),
            IncrementalDecoder(self.tokenizer, context=request.prompt_ids),
            spec=self._branch_drafts(),
        )

    def _branch_drafts(self) -> BranchDrafts | None:
        spec = self.config.speculative
        if not spec.enabled:
            return None
        mtp = spec.method == "mtp"  # auto drafts by lookup: MTP drafting costs more than it saves so far
        return BranchDrafts(
            index=None if mtp else NgramIndex(spec.ngram_min, spec.ngram_max),
            adaptive=AdaptiveDraft(spec.k) if spec.method == "auto" else None,
        )

    def _plan(
        self,
    ) -> tuple[
        dict[int, list[int]],
        list[tuple[Request, Branch, int, bool, bool]],
        dict[int, list[int]],
        dict[int, LogitsMode],
    ]:
        """What to feed: (sequence -> tokens, plan rows, sequence -> snapshot positions, sequence ->
        logits wanted). A plan row is (request, branch, backlog tokens fed, pending fed, sample
        from its logits). A scoring request's prompt chunks want logits at every row ("all")."""
        feeds: dict[int, list[int]] = {}
        plan: list[tuple[Request, Branch, int, bool, bool]] = []
        snapshots: dict[int, list[int]] = {}
        modes: dict[int, LogitsMode] = {}
        budget = self.config.max_num_batched_tokens
        active = [(r, b) for r in self.running for b in r.branches if b.seq is not None and not b.finished]
        decoding = [(r, b) for r, b in active if not b.backlog and b.pending is not None]
        drafts: dict[int, list[int]] = {}
        if self.config.speculative.enabled and not self._plain_step:
            start = time.perf_counter()
            drafts = self._drafts(decoding, budget)
            self.counters["spec_draft_us"] += int(1e6 * (time.perf_counter() - start))
        for request, branch in decoding:  # decode tokens first: they are cheap and latency-bound
            assert branch.seq is not None and branch.pending is not None
            draft = drafts.get(branch.seq, [])
            feeds[branch.seq] = [branch.pending, *draft]
            plan.append((request, branch, 0, True, True))
            modes[branch.seq] = "all" if draft else "last"
            budget -= len(feeds[branch.seq])
            if draft and branch.spec is not None:  # a verify: [pending, drafts] kept up to `accept`
                branch.spec.start, branch.spec.drafts = self.cm.length(branch.seq), draft
                branch.spec.before = len(branch.completion.token_ids)
        for request, branch in active:  # then prompt chunks, oldest request first
            if branch.backlog and budget > 0:
                assert branch.seq is not None
                scoring = request.scoring_prompt
                chunk = branch.backlog[: min(budget, SCORED_ROWS_PER_STEP) if scoring else budget]
                done = len(chunk) == len(branch.backlog)
                with_pending = done and branch.pending is not None
                feeds[branch.seq] = chunk + ([branch.pending] if with_pending and branch.pending is not None else [])
                plan.append((request, branch, len(chunk), with_pending, done))
                modes[branch.seq] = "all" if scoring else "last" if done else "none"
                budget -= len(feeds[branch.seq])
                snapshots[branch.seq] = self._snapshot_positions(request)
        return feeds, plan, snapshots, modes

    @staticmethod
    def _snapshot_positions(request: Request) -> list[int]:
        # The end of the prompt, one before it (a repeated prompt recomputes only its last token,
        # which it needs for logits), and every boundary the request hinted (chat messages).
        n = len(request.prompt_ids)
        return sorted({*request.cache_hint, n - 1, *([n - 2] if n > 1 else [])})

    def _score_prompt(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """Prompt logprobs from the logits of prompt positions start.. (`[rows, V]`): row i
        scores the prompt token at start + i + 1 (the row after the prompt's end scores nothing)."""
        prompt = request.prompt_ids
        if start == 0:
            request.prompt_logprobs[:] = [None]  # nothing precedes the first token
        assert len(request.prompt_logprobs) == start + 1, "prompt chunks are scored in order"
        targets = prompt[start + 1 : start + 1 + len(logits)]
        assert request.params.prompt_logprobs is not None
        request.prompt_logprobs.extend(score_tokens(logits[: len(targets)], targets, request.params.prompt_logprobs))

    def _sampling_rows(
        self, request: Request, branch: Branch, logits: torch.Tensor
    ) -> list[tuple[Request, Branch, torch.Tensor]]:
        """The branches that sample from `branch`'s logits: itself, and on a request's first
        token its n - 1 siblings, each given a fork of the prompt computed once. None for a
        request that asked for the prompt only (scored): its branches end here."""
        if request.params.max_tokens == 0:
            for b in request.branches:
                if not b.finished:
                    b.completion.finish_reason = "length"
                    request.emit(StreamEvent(request.request_id, b.completion.index, "", (), (), "length"))
                    self._retire(request, b, keep=b.intact)
            return []
        siblings = [b for b in request.branches if b.seq is None and not b.finished and b is not branch]
        assert branch.seq is not None
        for sibling in siblings:
            sibling.seq = self._fork(branch.seq)
            sibling.placed, sibling.intact = self.cm.length(sibling.seq), True
        return [(request, b, logits) for b in (branch, *siblings)]

    def _fork(self, seq: int) -> int:
        while True:
            try:
                return self.cm.fork(seq)
            except CacheFull:
                if not self._evict_one():
                    raise

    def _sample(self, rows: list[tuple[Request, Branch, torch.Tensor]]) -> None:
        """One token for every row, in one batched sampler call (grammar masks included)."""
        samplers = [branch.sampler for _, branch, _ in rows]
        outputs = [branch.completion.token_ids for _, branch, _ in rows]
        results = sample_batch(samplers, torch.stack([logits for *_, logits in rows]), outputs)
        for (request, branch, _), result in zip(rows, results, strict=True):
            if isinstance(result, GrammarError):  # an llguidance limit or fault: end this branch only
                log.error("request %s: grammar failed, ending its output: %s", request.request_id, result)
                self._end(request, branch)
            else:
                self._record(request, branch, result.token_id, result.logprob, result.top_logprobs)

    def _record(
        self,
        request: Request,
        branch: Branch,
        token: int,
        logprob: float | None,
        top_logprobs: list[tuple[int, float]] | None,
    ) -> None:
        """A sampled token: into the completion, the stop checks and the stream."""
        completion = branch.completion
        completion.token_ids.append(token)
        logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...] | None], ...] = ()
        if request.params.logprobs is not None:
            assert logprob is not None
            top = tuple(top_logprobs) if top_logprobs is not None else None
            logprobs = ((token, logprob, top),)
            completion.logprobs.extend(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.usage.completion_tokens += 1
        self.counters["tokens_generated"] += 1
        text = branch.stop.push(branch.decoder.push(token), token)
        finish: FinishReason | None = branch.stop.finish_reason
        if finish is None and len(request.prompt_ids) + len(completion.token_ids) >= self.cm.cache.config.max_model_len:
            finish = "length"
        if finish == "length":  # nothing more comes: release held-back text and partial characters
            text += branch.stop.flush(branch.decoder.flush())
        completion.text += text
        branch.pending = token
        if finish is not None:
            completion.finish_reason = finish
            completion.stop_reason = branch.stop.stop_reason
        request.emit(StreamEvent(request.request_id, completion.index, text, (token,), logprobs, finish))
        if finish is not None:
            self._retire(request, branch, keep=branch.intact)

    def _retire(self, request: Request, branch: Branch, keep: bool) -> None:
        """A branch ended: its sequence (prompt + output fed so far) goes into the prefix index."""
        if branch.seq is not None and branch.spec is not None and branch.spec.verifying:
            self._settle(request, branch)  # only verified tokens stay in the sequence
        if branch.seq is not None:
            if keep and self.config.prefix_caching:
                if self.disk is not None:
                    self.disk.save(branch.seq)
                self.index.insert(branch.seq)
            else:
                self.cm.release(branch.seq)
            branch.seq = None
        branch.pending = None
        branch.backlog = []
        if all(b.finished for b in request.branches):
            self._finish(request)

    def _finish(self, request: Request) -> None:
        request.finish_time = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        cancelled = any(b.completion.finish_reason == "cancelled" for b in request.branches)
        self.counters["requests_cancelled" if cancelled else "requests_finished"] += 1
        request.emit(StreamEvent(request.request_id, 0, "", (), done=True))

    def _cancel(self, request: Request, keep: bool = True) -> None:
        """End a request's unfinished branches as "cancelled" (their held-back text is released).

        With `keep`, a branch's sequence goes into the prefix index exactly as a finished one's:
        the prompt and the answer tokens fed so far, i.e. every forward that completed (a prompt
        cut mid-prefill keeps its computed chunks; the sampled token not fed yet is not in it).
        A branch that computed nothing (still queued, or only holding the prefix it reused) and
        one whose last forward was interrupted insert nothing.
        """
        if request in self.waiting:
            self.waiting.remove(request)
        if not request.branches:
            request.branches = [self._branch(request, i) for i in range(request.params.n)]
        for branch in request.branches:
            if not branch.finished:
                self._end(request, branch, keep)
        if not request.finished:
            self._finish(request)

    def _end(self, request: Request, branch: Branch, keep: bool = True) -> None:
        """End one unfinished branch as "cancelled", releasing its held-back text (see `_cancel`)."""
        completion = branch.completion
        text = branch.stop.flush(branch.decoder.flush())
        completion.text += text
        completion.finish_reason = "cancelled"
        completion.stop_reason = branch.stop.stop_reason
        request.emit(StreamEvent(request.request_id, completion.index, text, (), (), "cancelled"))
        self._retire(request, branch, keep=keep and self._computed(branch))

    def _computed(self, branch: Branch) -> bool:
        """Did `branch`'s sequence compute tokens beyond what it reused, all forwards complete?"""
        return branch.seq is not None and branch.intact and self.cm.length(branch.seq) > branch.placed

    def _evict_one(self) -> bool:
        """Make room in the cache: unpin what the disk writer has copied, else drop a cached
        sequence, else cancel the disk writes still pending. False when nothing was freed."""
        if self.disk is not None and self.disk.release_written():
            return True
        return self.index.evict_one() or (self.disk is not None and self.disk.drop_pending())

    def _relieve_pressure(self) -> None:
        """The forward did not fit: drop a cached sequence, else preempt the newest request (its
        sequences are released; it resumes later by recomputing, sampling state intact)."""
        if self._evict_one():
            return
        victim = self.running[-1]
        if len(self.running) == 1:
            log.error("request %s does not fit in the cache on its own; ending it", victim.request_id)
            for branch in victim.branches:
                if not branch.finished:
                    branch.completion.finish_reason = "length"
                    self._retire(victim, branch, keep=False)
            return
        self.running.pop()
        for branch in victim.branches:
            if branch.seq is not None:
                self.cm.release(branch.seq)
                branch.seq = None
            branch.backlog, branch.pending = [], None
        victim.usage.preemptions += 1
        self.counters["preemptions"] += 1
        victim.queued = True
        self.waiting.appendleft(victim)


def _uses_mtp(branch: Branch) -> bool:
    return branch.spec is not None and branch.spec.index is None


def _draft_holds(branch: Branch, i: int) -> bool:
    """Is verify row i of `branch` still to be sampled: the i tokens sampled before it were all
    its drafts (the first being the pending token's row) and the branch goes on?"""
    spec = branch.spec
    if spec is None or not spec.verifying or branch.finished or i > len(spec.drafts):
        return False
    out = branch.completion.token_ids
    return len(out) - spec.before == i and out[-1] == spec.drafts[i - 1]


def _index_tokens(spec: BranchDrafts, prompt: list[int], output: list[int]) -> None:
    """Bring the branch's lookup index up to prompt + output."""
    assert spec.index is not None
    if spec.seen < len(prompt):
        spec.index.extend(prompt[spec.seen :])
        spec.seen = len(prompt)
    spec.index.extend(output[spec.seen - len(prompt) :])
    spec.seen = len(prompt) + len(output)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
