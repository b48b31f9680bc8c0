"""Constrained decoding: a request's `Grammar` is compiled against the model's tokenizer into one
matcher per completion, and the batched sampler masks every constrained row with it, so
constrained and free requests share each batch (`sampling.sample_batch`).

    Grammar (llguidance's Lark, JSON schemas inline as %json) ──Grammars.check──> error naming
            │                                                  what cannot be enforced, or fine
            └──Grammars.matcher──> GrammarMatcher per completion ──allowed_tokens──> bool [N, V]
                                        └── consume(token) after each sampled token

The engine is llguidance (`pip install llguidance`, 1.x): a Rust core in an abi3 wheel that
depends on nothing, so no transformers or triton at run time (xgrammar's wheel requires both;
outlines-core turns a schema into one regular expression, recursion unrolled to a fixed depth,
and has no context-free grammars for the tool-call formats). It refuses a JSON Schema keyword it cannot enforce
instead of ignoring it, which lets the server answer 400 naming the keyword. Its mask is cheap:
`hybridkv bench` (json_schema_b1 / _b8) measured 0.05 ms per step at batch 1 and 0.14 ms at
batch 8 for the default model's 4,096-token vocabulary, 0.3-0.5% of a decode step, on a 2-core
machine loaded by other jobs; the whole constrained steps were within the noise of the free ones.

JSON is written as `json.dumps` writes it (", " and ": ", no other whitespace): a model cannot then
fill its answer with endless newlines, and the output reads like any JSON it saw in training.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from hybridkv.engine.tokenizer import Tokenizer

# llguidance's JSON options, set on every inline schema (replacing any "x-guidance" a client sent,
# which could loosen what is enforced): compact separators as json.dumps writes them.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
THINK_END = "</think>"
COMPILED_KEPT = 64  # distinct grammars kept compiled (clients tend to send the same schema again)


class GrammarError(ValueError):
    """A grammar the engine cannot enforce (llguidance's reason, naming the keyword), or a
    matcher that failed while decoding."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a completion must be, as llguidance Lark source (`start` is the whole output; EOS
    is allowed once `start` is complete and is then the only token allowed)."""

    lark: str

    def __post_init__(self) -> None:
        if not isinstance(self.lark, str) or "start" not in self.lark:
            raise ValueError("grammar must be Lark source with a `start` rule")


def json_value(schema: Mapping[str, Any]) -> str:
    """Lark for one JSON value valid against `schema` (its $refs resolve from its own root)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def literal(text: str) -> str:
    """Lark for the exact text `text`."""
    return json.dumps(text)


class Grammars:
    """Grammars for one model: its tokenizer as llguidance sees it (built on first use, ~50 ms
    for a 4k vocabulary; the mask covers all `vocab_size` logits), checks, and matchers.

    A grammar is compiled once (a few ms for a typical schema) and kept, least recently used
    dropped past COMPILED_KEPT; each completion gets a copy of the compiled matcher (~20 µs)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.RLock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = sorted(self.tokenizer.eos_token_ids)
                if not eos:
                    raise GrammarError("this model's tokenizer names no end-of-sequence token: a grammar could not end")
                try:
                    self._ll = llguidance.LLTokenizer(
                        self.tokenizer.backend.to_str(),
                        n_vocab=max(self.vocab_size, self.tokenizer.vocab_size),
                        eos_token=eos,
                    )
                except Exception as e:  # a tokenizer llguidance cannot read
                    raise GrammarError(f"this model's tokenizer cannot be used for constrained decoding: {e}") from e
            return self._ll

    def tag(self, text: str) -> str:
        """Lark for `text` written the way the model writes it: a special token (llguidance's
        `<...>` syntax: only that token, never its spelling in bytes) where the tokenizer has
        one for it, else the literal text."""
        token = self.tokenizer.token_to_id(text)
        if token is not None and self.ll_tokenizer.is_special_token(token):
            return text
        return literal(text)

    def thinking_rule(self) -> str:
        """The Lark rule `thinking`: free reasoning up to and with `</think>`, then the blank
        line the chat templates put before the answer (for a prompt that opened a think block)."""
        end = self.tag(THINK_END)
        if end == THINK_END:  # a special token: reasoning text cannot contain it
            return f'thinking: /(.|\\n)*/ {end} "\\n\\n"'
        return 'thinking: thought "\\n\\n"\nthought[lazy]: /(?s:.*)<\\/think>/'

    def check(self, grammar: Grammar) -> None:
        """GrammarError with llguidance's reason ("failed to compile JSON schema: Unimplemented
        keys: [\"uniqueItems\"]") unless every part of `grammar` can be enforced."""
        self._compile(grammar)

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A matcher at the start of `grammar` (GrammarError if it cannot be enforced)."""
        return GrammarMatcher(self._compile(grammar).deep_copy(), self.ll_tokenizer.vocab_size)

    def _compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(grammar.lark)
            if compiled is not None:
                self._compiled.move_to_end(grammar.lark)
                return compiled
        text = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        compiled = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)  # releases the GIL
        if compiled.is_error():
            raise GrammarError(_reason(compiled.get_error()))
        with self._lock:
            self._compiled[grammar.lark] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled


def _reason(message: str) -> str:
    """llguidance's error without its position and its echo of the grammar source."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return re.sub(r"^at \d+\(\d+\): ", "", first)


class GrammarMatcher:
    """One completion's position in its grammar. `allowed_tokens` masks; `consume` advances.
    `mask_vocab` is the number of tokens llguidance's masks cover (>= the model's V)."""

    __slots__ = ("mask_vocab", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher, mask_vocab: int) -> None:
        self.matcher = matcher
        self.mask_vocab = mask_vocab

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def consume(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not fit the grammar: {self.matcher.get_error()}")


def allowed_tokens(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """`[N, vocab_size]` bool: the tokens each matcher allows next (`allowed_array` as a tensor)."""
    return torch.from_numpy(allowed_array(matchers, vocab_size))


def allowed_array(matchers: Sequence[GrammarMatcher], vocab_size: int) -> np.ndarray:
    """`[N, vocab_size]` NumPy bool: the tokens each matcher allows next.

    Computed in this thread, one matcher after the other (each call releases the GIL): not in
    llguidance's worker pool, whose threads must first be woken, which on cores busy with other
    work (the forward's own threads, other processes) costs more than the masks themselves. (Nor
    in a thread of ours during the forward: on 2 cores that measured slower, 0.79-0.81x free
    decoding against 0.85-0.87x, the default model at batch 8.)"""
    words = (max(m.mask_vocab for m in matchers) + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.int32)
    for row, m in zip(bits, matchers, strict=True):
        m.matcher.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)
    # Bit i of 32-bit word w is token 32 w + i; the words are little-endian in memory.
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return unpacked.view(np.bool_)
