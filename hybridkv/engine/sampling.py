"""Per-request sampling: parameters, logits -> token id, and stop detection for streaming text.

Processing order, as in Hugging Face `generate` and vLLM:

    raw logits ──> penalties ──> grammar mask ──> temperature ──> top-k ──> top-p ──> min-p ──> sample
        │                             └──(temperature 0)──> argmax
        └──> reported logprobs

Logprobs are those of the raw model distribution (`log_softmax` of the logits as the model
returned them, before penalties, grammar mask and temperature), which is what vLLM reports by
default; prompt logprobs (`score_tokens`) are the same figure for the prompt's own tokens. A
request with a grammar (`grammar.py`) gets its mask inside `sample_batch`, computed for all
constrained rows of the batch at once.
Every request samples with its own `torch.Generator`, so a seeded request gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, cast

import numpy as np
import torch

from hybridkv.engine.grammar import Grammar, GrammarError, GrammarMatcher, allowed_array

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 16
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # temperatures this small are greedy: logits / T would overflow float32
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 0 <= seed < 2**64

# Neutral values: what an unset (None) field means when generation_config.json says nothing.
_NEUTRAL: dict[str, float | int] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Checked at construction; errors name the field.

    `None` in temperature, top_k, top_p, min_p or repetition_penalty means "the model's default":
    `with_defaults(generation_config)` fills them from `generation_config.json`, and whatever is
    still unset means off (temperature 1.0, top_k 0, top_p 1.0, min_p 0.0, repetition_penalty 1.0;
    unlike `transformers`, no implicit top_k=50).

    - temperature: 0 (or below 1e-5) is greedy: argmax after penalties; at most 100.
    - top_k: keep the k most likely tokens (ties at the k-th value kept); 0 = off.
    - top_p: keep the smallest most-likely set with probability mass >= top_p; in (0, 1].
    - min_p: drop tokens less likely than min_p times the most likely one; in [0, 1).
    - repetition_penalty: Hugging Face semantics: logits of tokens seen in prompt or output are
      divided by it when positive, multiplied when negative; > 0, 1 = off.
    - presence_penalty, frequency_penalty: OpenAI semantics, on output tokens only: subtract
      `presence * [count > 0] + frequency * count`; in [-2, 2].
    - seed: None draws a random seed per request.
    - stop: strings that end the output (not included in it); a single string is accepted.
    - stop_token_ids: tokens that end the output, besides EOS (unless ignore_eos).
    - logprobs: None, or how many most-likely alternatives (0..20) to report per token.
    - prompt_logprobs: None, or how many most-likely alternatives (0..20) to report for every
      prompt token besides its own logprob and rank (vLLM's extension; the first token has none).
    - n: independent completions of the same prompt (1..16).
    - max_tokens: 0 computes the prompt only (to score it with prompt_logprobs) and generates nothing.
    - grammar: the output must match it (structured output, forced tool calls); it ends the
      output itself (EOS once complete), so stop strings, stop_token_ids and ignore_eos, which
      could cut it or run past it, cannot be combined with it.
    """

    max_tokens: int = 256
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)):
                raise ValueError(f"{name} must be a tuple or list, got {value!r}")
            object.__setattr__(self, name, tuple(value))

        _check_int("max_tokens", self.max_tokens, low=0)
        _check_float("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0, high_open=True)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0, optional=False)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0, optional=False)
        _check_int("seed", self.seed, low=0, high=_SEED_LIMIT - 1)
        _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_N, optional=False)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for i, token_id in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token_id, low=0, optional=False)
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise ValueError(f"grammar must be a Grammar, got {self.grammar!r}")
            for name in ("stop", "stop_token_ids", "ignore_eos"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be combined with structured output: it would cut the output")

    def with_defaults(self, generation_config: Mapping[str, Any]) -> SamplingParams:
        """A copy with every unset (None) sampling field taken from a `generation_config.json`
        dict, else its neutral value; fields set here win. An explicit `"do_sample": false`
        makes the default temperature 0 (greedy), as it does in `transformers`."""
        filled: dict[str, Any] = {}
        for name, neutral in _NEUTRAL.items():
            if getattr(self, name) is not None:
                continue
            value = generation_config.get(name)
            if name == "temperature" and generation_config.get("do_sample") is False:
                value = 0.0
            filled[name] = neutral if value is None else value
        return dataclasses.replace(self, **filled)


def _check_int(name: str, value: object, low: int, high: int | None = None, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = True,
) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")


class SampleResult(NamedTuple):
    """The chosen token and, when the request asks for logprobs, its raw-model logprob and the
    most likely alternatives as `(token_id, logprob)` sorted from most likely (else None)."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class TokenLogprob(NamedTuple):
    """A given token's logprob under the model, its rank (1 = the most likely; ties share the
    better rank) and the `top` most likely tokens as `(token_id, logprob)`, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """How likely each row of `logits: [R, V]` made the token that came next (`token_ids`, R of
    them), with the `top` most likely alternatives. One `log_softmax` per row feeds every figure,
    so a token's logprob is bit-identical to its own entry in its `top` list."""
    if logits.dim() != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(f"need logits [R, V] with R = {len(token_ids)} tokens, got {tuple(logits.shape)}")
    log_probs = torch.log_softmax(logits.detach().to(torch.float32), dim=-1)
    targets = torch.tensor(list(token_ids), dtype=torch.long)[:, None]
    chosen = log_probs.gather(1, targets)
    ranks = (log_probs > chosen).sum(dim=1) + 1
    best = torch.topk(log_probs, min(top, log_probs.shape[1]), dim=1)
    best_ids, best_values = best.indices.tolist(), best.values.tolist()
    return [
        TokenLogprob(token_id, logprob, rank, tuple(zip(ids, values, strict=True)))
        for token_id, logprob, rank, ids, values in zip(
            token_ids, chosen[:, 0].tolist(), ranks.tolist(), best_ids, best_values, strict=True
        )
    ]


class RequestSampler:
    """Samples one request's tokens with its own generator.

    `branch` numbers the completions of an `n > 1` request; branch i of a seeded request uses
    seed + i (as vLLM does), so the branches differ and each is reproducible. `grammar`, the
    completion's own matcher for `params.grammar`, consumes every token sampled.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        branch: int = 0,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.params = params.with_defaults({})  # still-unset fields mean "off"
        self.grammar = grammar
        self.generator = torch.Generator()
        if params.seed is None:
            self.seed = self.generator.seed()  # a fresh non-deterministic seed, kept for reporting
        else:
            self.seed = (params.seed + branch) % _SEED_LIMIT
            self.generator.manual_seed(self.seed)
        self._prompt_ids = torch.tensor(list(prompt_ids), dtype=torch.long)
        self._prompt_seen: torch.Tensor | None = None  # bool [V], built on first use
        p = self.params
        self.penalises = not (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
        # Greedy with nothing else to apply or report: the token is the (masked) row's argmax, so
        # a batch of such rows (a verify's, or a decode step's) is one argmax, not a sampler call
        # a row. `argmax_only`: and no grammar either.
        self.plain_greedy = self.greedy and p.logprobs is None and not self.penalises
        self.argmax_only = self.plain_greedy and grammar is None

    @property
    def greedy(self) -> bool:
        assert self.params.temperature is not None
        return self.params.temperature < GREEDY_BELOW

    def sample(
        self, logits: torch.Tensor, output_ids: Sequence[int], allowed: torch.Tensor | None = None
    ) -> SampleResult:
        """Choose the next token from `logits: [V]` given this request's `output_ids` so far,
        among the `allowed: [V]` bool tokens (the grammar's mask; required with a grammar).
        Draws from the generator only when not greedy; never modifies `logits`."""
        raw = logits.detach().to(torch.float32)
        if self.grammar is None:
            return self._choose(raw, raw, output_ids)
        if allowed is None or not bool(allowed.any()):
            raise self._nothing_allowed()
        return self._choose(raw, raw.masked_fill(~allowed, -math.inf), output_ids)

    def _nothing_allowed(self) -> GrammarError:
        assert self.grammar is not None
        return GrammarError(f"the grammar allows no token here: {self.grammar.error or 'no mask given'}")

    def _choose(self, raw: torch.Tensor, masked: torch.Tensor, output_ids: Sequence[int]) -> SampleResult:
        """`sample` on float32 logits `raw` and `masked`, raw with the tokens the grammar forbids at
        -inf (raw itself without a grammar). The penalties keep -inf at -inf, so penalising the
        masked scores is masking the penalised ones."""
        scores = self._penalised(masked, output_ids)
        token_id = int(torch.argmax(scores)) if self.greedy else self._draw(scores)
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if self.params.logprobs is None:  # nobody reads it: skip a pass over the vocabulary per token
            return SampleResult(token_id, None, None)
        log_probs = torch.log_softmax(raw, dim=0)  # one tensor: the chosen token's figure is the one in the top list
        return SampleResult(token_id, float(log_probs[token_id]), self._top_logprobs(log_probs))

    def _penalised(self, logits: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor:
        p = self.params
        assert p.repetition_penalty is not None
        if not self.penalises:
            return logits
        out = torch.tensor(list(output_ids), dtype=torch.long)
        scores = logits.clone()
        if p.repetition_penalty != 1.0:
            if self._prompt_seen is None:
                self._prompt_seen = torch.zeros(logits.shape[0], dtype=torch.bool)
                self._prompt_seen[self._prompt_ids] = True
            seen = self._prompt_seen.clone()
            seen[out] = True
            penalised = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and len(out):
            counts = torch.bincount(out, minlength=logits.shape[0]).to(torch.float32)
            scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return scores

    def probabilities(self, logits: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor:
        """The distribution `sample` draws from, as `[V]` probabilities (one-hot when greedy)."""
        scores = self._penalised(logits.detach().to(torch.float32), output_ids)
        probs = torch.zeros_like(scores)
        if self.greedy:
            probs[torch.argmax(scores)] = 1.0
            return probs
        ids, values = self._candidates(scores)
        return probs.scatter_(0, ids, values.softmax(0)) if ids is not None else values.softmax(0)

    def _draw(self, scores: torch.Tensor) -> int:
        """Inverse-CDF draw: one uniform number from this request's generator per token."""
        ids, values = self._candidates(scores)
        cdf = values.softmax(0).double().cumsum(0)
        u = torch.rand((), dtype=torch.float64, generator=self.generator)
        choice = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(cdf) - 1)
        return choice if ids is None else int(ids[choice])

    def _candidates(self, scores: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Temperature, then top-k / top-p / min-p on a shrinking candidate set: returns the
        candidates' token ids (None: the whole vocabulary, in order) and their scaled logits."""
        p = self.params
        assert p.temperature is not None and p.top_k is not None
        assert p.top_p is not None and p.min_p is not None
        values = scores / p.temperature
        ids: torch.Tensor | None = None
        if 0 < p.top_k < values.shape[0]:
            kth = torch.topk(values, p.top_k).values[-1]
            ids = torch.nonzero(values >= kth).squeeze(1)  # ties at the k-th value stay, as in HF
            values = values[ids]
        if p.top_p < 1.0:
            # Tokens below `floor` hold less than 1 - top_p together, so top-p drops them all:
            # skip them before the sort (usually most of the vocabulary), keeping their mass.
            probs = values.softmax(0)
            floor = (1.0 - p.top_p) / len(probs)
            maybe = probs >= floor
            ids, values = _select(ids, values, maybe)
            ascending, order = torch.sort(probs[maybe])
            drop = ascending.cumsum(0) + (1.0 - ascending.sum()) <= 1.0 - p.top_p
            drop[-1] = False  # the most likely token always stays
            ids, values = _select(ids, values, torch.ones_like(drop).scatter_(0, order, ~drop))
        if p.min_p > 0.0:
            probs = values.softmax(0)
            ids, values = _select(ids, values, probs >= p.min_p * probs.max())
        return ids, values

    def _top_logprobs(self, log_probs: torch.Tensor) -> list[tuple[int, float]] | None:
        k = self.params.logprobs
        if k is None:
            return None
        top = torch.topk(log_probs, min(k, log_probs.shape[0]))
        return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


def _select(ids: torch.Tensor | None, values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.nonzero(keep).squeeze(1)
    return (positions if ids is None else ids[positions]), values[positions]


def sample_batch(
    samplers: Sequence[RequestSampler], logits: torch.Tensor, output_ids: Sequence[Sequence[int]]
) -> list[SampleResult | GrammarError]:
    """One token for each of N requests from `logits: [N, V]`; row i belongs to `samplers[i]`.
    Each row uses only its own sampler's generator, so results do not depend on the batch.
    The rows of samplers with a grammar are masked, all masks computed in one call. A row whose
    grammar fails gets its GrammarError in place of a result; the other rows are sampled."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers) or len(output_ids) != len(samplers):
        raise ValueError(
            f"need logits [N, V] with N = {len(samplers)} samplers and output lists, "
            f"got logits {tuple(logits.shape)} and {len(output_ids)} output lists"
        )
    if all(s.argmax_only for s in samplers):  # `sample`'s greedy choice for every row at once
        return [SampleResult(t, None, None) for t in logits.argmax(1).tolist()]
    constrained = [i for i, s in enumerate(samplers) if s.grammar is not None]
    # The constrained rows masked in one pass, not one by one (a few small ops a row cost more
    # than the masks at batch 8), in NumPy: on one thread, where torch's ops on batch 8's
    # [8, V] rows each woke the other threads (50-70 us an op after a forward, measured). The
    # plain greedy rows' choices are one argmax.
    allows: dict[int, bool] = {}  # constrained row -> does its mask allow any token
    masked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ... -> (raw, masked) for `_choose`
    picked: dict[int, int] = {}  # ... -> its argmax, for the plain greedy ones
    if constrained:
        matchers = [samplers[i].grammar for i in constrained]
        allowed = allowed_array([m for m in matchers if m is not None], logits.shape[1])
        raw = (logits if len(constrained) == len(samplers) else logits[constrained]).detach().to(torch.float32)
        rows = np.where(allowed, raw.numpy(), np.float32(-np.inf))
        allows = dict(zip(constrained, cast(list[bool], allowed.any(axis=1).tolist()), strict=True))
        if any(samplers[i].plain_greedy for i in constrained):
            picked = dict(zip(constrained, rows.argmax(1).tolist(), strict=True))
        masked = {
            i: (raw[j], torch.from_numpy(rows[j])) for j, i in enumerate(constrained) if not samplers[i].plain_greedy
        }
    results: list[SampleResult | GrammarError] = []
    for i, (sampler, row, out) in enumerate(zip(samplers, logits, output_ids, strict=True)):
        try:
            if i not in allows:
                results.append(sampler.sample(row, out))
            elif not allows[i]:
                raise sampler._nothing_allowed()
            elif i in masked:
                results.append(sampler._choose(*masked[i], out))
            else:  # plain greedy: `_choose`'s argmax, taken with the other rows'
                assert sampler.grammar is not None
                sampler.grammar.consume(picked[i])
                results.append(SampleResult(picked[i], None, None))
        except GrammarError as e:
            results.append(e)
    return results


FinishReason = Literal["stop", "length"]


class StopChecker:
    """Decides when a request's output ends, and which text is safe to stream so far.

    Feed each new token with the text it decoded to: `push(piece, token_id)` returns the text
    that can be sent now. Text that could be the start of a stop string is held back until it
    is known not to be one. Once `finish_reason` is set:

    - "stop" by a stop string: the output is cut just before it; the string is not emitted.
      `stop_reason` is the string.
    - "stop" by a token in `stop_token_ids` or `eos_ids` (unless `ignore_eos`): that token's own
      text is not emitted, held-back text is. `stop_reason` is the token id.
    - "length" after `max_tokens` tokens: everything held back is emitted.

    `text` is everything emitted. `flush(tail)` ends the stream early (or adds the decoder's
    last piece) and returns held-back text plus `tail`, cut at a stop string if one completes.
    """

    def __init__(
        self,
        stop_strings: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        self.stop_strings = tuple(stop_strings)
        if not all(self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_token_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self._held = ""

    @classmethod
    def from_params(cls, params: SamplingParams, eos_ids: Iterable[int]) -> StopChecker:
        return cls(params.stop, params.stop_token_ids, eos_ids, params.ignore_eos, params.max_tokens)

    def push(self, piece: str, token_id: int | None = None) -> str:
        """Add `piece` (the text `token_id` decoded to; `token_id` None adds text without
        counting a token) and return the text that is safe to emit now. Raises RuntimeError
        once the output has finished."""
        if self.finish_reason is not None:
            raise RuntimeError(f"output already finished ({self.finish_reason})")
        if token_id is not None:
            self.num_tokens += 1
            if token_id in self.stop_token_ids:
                self._finish("stop", token_id)
                return self._emit(self._take_held())
        emitted = self._scan(self._take_held() + piece)
        if self.finish_reason is None and self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            self._finish("length", None)
            emitted += self._take_held()
        return self._emit(emitted)

    def flush(self, tail: str = "") -> str:
        """Release held-back text plus `tail`; nothing after a stop."""
        if self.finish_reason == "stop":
            return ""
        window = self._take_held() + tail
        cut = self._find_stop(window)
        if cut is not None:
            window = window[: cut[0]]
            if self.finish_reason is None:
                self._finish("stop", cut[1])
        return self._emit(window)

    def _scan(self, window: str) -> str:
        """Emit what precedes a stop string (and finish), or all but a possible stop prefix."""
        cut = self._find_stop(window)
        if cut is not None:
            self._finish("stop", cut[1])
            return window[: cut[0]]
        hold = self._partial_stop_length(window)
        self._held = window[len(window) - hold :]
        return window[: len(window) - hold]

    def _find_stop(self, window: str) -> tuple[int, str] | None:
        """Earliest stop string in `window` (ties: first listed), as (start, string)."""
        found = [(i, s) for s in self.stop_strings if (i := window.find(s)) >= 0]
        return min(found, key=lambda hit: hit[0]) if found else None

    def _partial_stop_length(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(window)), longest, -1):
                if window.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _take_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def _emit(self, text: str) -> str:
        self.text += text
        return text

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
