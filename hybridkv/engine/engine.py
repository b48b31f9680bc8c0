"""The engine: continuous batching over a `CachedModel`, with prefix reuse and preemption.

One step = the scheduler picks what to feed (a decode token for every running completion, then
prompt chunks under the token budget), the model runs one forward for all of it, and the
results are sampled, checked for stops and streamed. Finished and cancelled sequences go into
the prefix index, so the next request sharing a prefix (the next turn of a chat, a shared system
prompt, the same prompt sent again after a disconnect) computes only what is new.
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

from hybridkv.cached_model import CachedModel
from hybridkv.engine.prefix_index import PrefixIndex
from hybridkv.engine.request import Branch, Completion, FinishReason, Request, StreamEvent
from hybridkv.engine.sampling import RequestSampler, SamplingParams, StopChecker
from hybridkv.engine.threads import IdleCores
from hybridkv.engine.tokenizer import IncrementalDecoder, Tokenizer
from hybridkv.errors import CacheFull

log = logging.getLogger("hybridkv.engine")


class QueueFull(RuntimeError):
    """The engine's queue bound is reached: retry later."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """max_num_seqs: completions decoding at once. max_num_batched_tokens: tokens per forward.
    max_cached_sequences: finished sequences kept for reuse (None: whatever the cache's
    `max_sequences` leaves beyond `max_num_seqs`). max_queue: waiting requests before refusing."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 1024
    prefix_caching: bool = True
    max_cached_sequences: int | None = None
    max_queue: int = 256
    min_shared_prefix: int = 32
    adapt_threads: bool = False

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
    ) -> None:
        """`cores`: the thread governor, made before the model was loaded (`LLM` does); with
        `adapt_threads` and none given, one is made here."""
        self.cm = cm
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.generation_config = dict(generation_config or {})
        self.cores = cores or (IdleCores() if config.adapt_threads else None)
        cache = cm.cache.config
        if cache.max_sequences < config.max_num_seqs + 1:
            raise ValueError(
                f"CacheConfig.max_sequences={cache.max_sequences} must exceed max_num_seqs={config.max_num_seqs}"
            )
        cached = config.max_cached_sequences
        if cached is None:
            cached = cache.max_sequences - config.max_num_seqs
        self.index = PrefixIndex(cm, cached if config.prefix_caching else 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters: Counter[str] = Counter()
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

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
        return out

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> None:
        self._drain_inbox()
        self._admit()
        feeds, plan, snapshots = self._plan()
        if not feeds:
            return
        if self.cores is not None:
            self.cores.update()
        try:
            with torch.inference_mode():
                logits = self.cm.feed(feeds, logits="last", snapshot_at=snapshots)
        except CacheFull:
            self._relieve_pressure()
            return
        except BaseException:  # interrupted or failed mid-forward: never reuse what it fed
            for _, branch, *_ in plan:
                branch.intact = False
            raise
        self.counters["steps"] += 1
        for request, branch, fed_backlog, fed_pending, sample in plan:
            del branch.backlog[:fed_backlog]
            request.usage.computed_tokens += fed_backlog
            self.counters["prompt_tokens_computed"] += fed_backlog
            if fed_pending:
                branch.pending = None
            if sample:
                assert branch.seq is not None
                self._on_logits(request, branch, logits[branch.seq][0])

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

    def _fits(self, request: Request) -> bool:
        """Admit only what the free KV blocks can take after the running requests' own remaining
        prompts (evicting cached sequences to make room); an empty engine always admits."""
        bs = self.cm.cache.config.block_size
        longest = len(request.prompt_ids) + max((len(b.completion.token_ids) for b in request.branches), default=0)
        need = request.params.n * math.ceil((longest + 1) / bs)
        while self.running:
            reserved = 0
            for other in self.running:
                for branch in other.branches:
                    if branch.seq is not None and not branch.finished:
                        now = self.cm.length(branch.seq)
                        reserved += math.ceil((now + len(branch.backlog) + 1) / bs) - math.ceil(now / bs)
            if self.cm.cache.blocks.num_free - reserved >= need:
                return True
            if not self.index.evict_one():
                return False
        return True

    def _worth_waiting(self, request: Request) -> bool:
        """True while a running request is still computing a prompt prefix this one shares
        (two requests with one system prompt arriving together): once it has passed that point,
        this request forks it there instead of computing the prefix a second time."""
        if not self.config.prefix_caching or request.branches:
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
        for branch in todo:
            ids = request.prompt_ids + branch.completion.token_ids[:-1]
            pending = branch.completion.token_ids[-1] if branch.completion.token_ids else None
            placed = self._sequence_for(ids, limit=len(ids) if pending is not None else len(ids) - 1)
            if placed is None:
                for undo in made:
                    assert undo.seq is not None
                    self.cm.release(undo.seq)
                    undo.seq = None
                return False
            branch.seq, keep = placed
            branch.placed, branch.intact = keep, True
            branch.backlog, branch.pending = ids[keep:], pending
            made.append(branch)
            if fresh:
                request.usage.cached_tokens = keep
                self.counters["prompt_tokens_cached"] += keep
        return True

    def _sequence_for(self, ids: list[int], limit: int) -> tuple[int, int] | None:
        """A sequence holding the longest restorable prefix of `ids` (at most `limit` tokens):
        forked from a finished sequence in the index or a running one, else new. Returns
        (sequence, tokens it holds), or None when the cache has no room even after evictions."""
        while True:
            try:
                source = self._best_source(ids, limit) if self.config.prefix_caching else None
                if source is not None:
                    return self.cm.fork_prefix(*source)
                return self.cm.new_sequence(), 0
            except CacheFull:
                if not self.index.evict_one():
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
        return Branch(
            Completion(index),
            RequestSampler(params, request.prompt_ids, branch=index),
            StopChecker.from_params(params, self.tokenizer.eos_token_ids),
            IncrementalDecoder(self.tokenizer, context=request.prompt_ids),
        )

    def _plan(
        self,
    ) -> tuple[dict[int, list[int]], list[tuple[Request, Branch, int, bool, bool]], dict[int, list[int]]]:
        """What to feed: (sequence -> tokens, plan rows, sequence -> snapshot positions).
        A plan row is (request, branch, backlog tokens fed, pending fed, sample from its logits)."""
        feeds: dict[int, list[int]] = {}
        plan: list[tuple[Request, Branch, int, bool, bool]] = []
        snapshots: dict[int, list[int]] = {}
        budget = self.config.max_num_batched_tokens
        active = [(r, b) for r in self.running for b in r.branches if b.seq is not None and not b.finished]
        for request, branch in active:  # decode tokens first: they are cheap and latency-bound
            if not branch.backlog and branch.pending is not None:
                assert branch.seq is not None
                feeds[branch.seq] = [branch.pending]
                plan.append((request, branch, 0, True, True))
                budget -= 1
        for request, branch in active:  # then prompt chunks, oldest request first
            if branch.backlog and budget > 0:
                assert branch.seq is not None
                chunk = branch.backlog[:budget]
                done = len(chunk) == len(branch.backlog)
                with_pending = done and branch.pending is not None
                feeds[branch.seq] = chunk + ([branch.pending] if with_pending and branch.pending is not None else [])
                plan.append((request, branch, len(chunk), with_pending, done))
                budget -= len(feeds[branch.seq])
                snapshots[branch.seq] = self._snapshot_positions(request)
        return feeds, plan, snapshots

    @staticmethod
    def _snapshot_positions(request: Request) -> list[int]:
        # The end of the prompt, one before it (a repeated prompt recomputes only its last token,
        # which it needs for logits), and every boundary the request hinted (chat messages).
        n = len(request.prompt_ids)
        return sorted({*request.cache_hint, n - 1, *([n - 2] if n > 1 else [])})

    def _on_logits(self, request: Request, branch: Branch, logits: torch.Tensor) -> None:
        siblings = [b for b in request.branches if b.seq is None and not b.finished and b is not branch]
        assert branch.seq is not None
        for sibling in siblings:  # n > 1: the prompt was computed once, fork it for every branch
            sibling.seq = self._fork(branch.seq)
            sibling.placed, sibling.intact = self.cm.length(sibling.seq), True
        for b in (branch, *siblings):
            self._sample(request, b, logits)

    def _fork(self, seq: int) -> int:
        while True:
            try:
                return self.cm.fork(seq)
            except CacheFull:
                if not self.index.evict_one():
                    raise

    def _sample(self, request: Request, branch: Branch, logits: torch.Tensor) -> None:
        completion = branch.completion
        result = branch.sampler.sample(logits, completion.token_ids)
        token = result.token_id
        completion.token_ids.append(token)
        logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...] | None], ...] = ()
        if request.params.logprobs is not None:
            top = tuple(result.top_logprobs) if result.top_logprobs is not None else None
            logprobs = ((token, result.logprob, top),)
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
        if branch.seq is not None:
            if keep and self.config.prefix_caching:
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
                completion = branch.completion
                text = branch.stop.flush(branch.decoder.flush())
                completion.text += text
                completion.finish_reason = "cancelled"
                completion.stop_reason = branch.stop.stop_reason
                request.emit(StreamEvent(request.request_id, completion.index, text, (), (), "cancelled"))
                self._retire(request, branch, keep=keep and self._computed(branch))
        if not request.finished:
            self._finish(request)

    def _computed(self, branch: Branch) -> bool:
        """Did `branch`'s sequence compute tokens beyond what it reused, all forwards complete?"""
        return branch.seq is not None and branch.intact and self.cm.length(branch.seq) > branch.placed

    def _relieve_pressure(self) -> None:
        """The forward did not fit: drop a cached sequence, else preempt the newest request (its
        sequences are released; it resumes later by recomputing, sampling state intact)."""
        if self.index.evict_one():
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
        self.waiting.appendleft(victim)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
