"""A request as the engine tracks it, and what it reports back: stream events and the final output."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from hybridkv.engine.sampling import RequestSampler, SamplingParams, StopChecker, TokenLogprob
from hybridkv.engine.speculative import BranchDrafts
from hybridkv.engine.tokenizer import IncrementalDecoder

FinishReason = Literal["stop", "length", "cancelled"]
_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """New output of one completion (`index` < n). The last event of a completion has a
    `finish_reason`; the request's very last event is `done` and carries its counters."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...] | None], ...] = ()
    finish_reason: FinishReason | None = None
    done: bool = False


@dataclass(slots=True)
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...] | None]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class Usage:
    """Prompt tokens, how many came from the cache, how many were computed (including any
    recomputation after a preemption), and generated tokens."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # speculative drafts verified
    accepted_tokens: int = 0  # of those, accepted


@dataclass(eq=False, slots=True)
class Branch:
    """One of the n completions: its sequence, what it still has to feed, its sampling state.

    `backlog` are tokens to feed before `pending` (the sampled token not fed yet); a branch whose
    backlog is the prompt and whose `pending` is None samples from the prompt's last logits.
    `placed` is how many tokens `seq` held when the branch got it (reused, not computed);
    `intact` turns False when a forward feeding `seq` was interrupted: its cache state is then
    not trusted for reuse.
    """

    completion: Completion
    sampler: RequestSampler
    stop: StopChecker
    decoder: IncrementalDecoder
    seq: int | None = None
    backlog: list[int] = field(default_factory=list)
    pending: int | None = None
    placed: int = 0
    intact: bool = True
    spec: BranchDrafts | None = None  # speculative decoding state (None: this branch does not speculate)

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None


@dataclass(eq=False)
class Request:
    """A generation request: prompt ids, sampling parameters, where snapshots are wanted.

    With `params.prompt_logprobs`, `prompt_logprobs` fills up as the prompt is computed: entry p
    scores prompt token p given the tokens before it (entry 0 is None: nothing precedes it).
    """

    prompt_ids: list[int]
    params: SamplingParams
    cache_hint: tuple[int, ...] = ()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_event: Callable[[StreamEvent], None] | None = None
    arrival: float = field(default_factory=time.monotonic)
    branches: list[Branch] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    first_token_time: float | None = None
    finish_time: float | None = None
    queued: bool = True  # waiting to be admitted (again, once preempted); set by the engine, read by anyone
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    events: queue.SimpleQueue[StreamEvent] = field(default_factory=queue.SimpleQueue)

    @property
    def finished(self) -> bool:
        return self.finish_time is not None

    def emit(self, event: StreamEvent) -> None:
        self.events.put(event)
        if self.on_event is not None:
            self.on_event(event)

    @property
    def scoring_prompt(self) -> bool:
        """Does this request still need logits at prompt positions it has not scored yet?"""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def output(self) -> RequestOutput:
        prompt_logprobs = list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None
        completions = [b.completion for b in self.branches]
        return RequestOutput(self.request_id, self.prompt_ids, completions, self.usage, prompt_logprobs)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    outputs: list[Completion]
    usage: Usage
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text
