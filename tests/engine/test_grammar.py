"""Grammar-constrained decoding in the engine, on the default model: every answer parses and
validates against its schema unless it ran out of tokens, greedy and sampled, with constrained
and free requests in the same batches; the mask is exactly the grammar's; what the engine cannot
enforce is refused by name."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import llguidance
import pytest
import torch
from byte_level import byte_token_ids
from json_schemas import SCHEMAS, check_answer
from qwen35_tokenizer import COMPACT_VOCAB, write_qwen35_tokenizer

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.grammar import Grammar, GrammarError, Grammars, allowed_tokens, json_value
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import Tokenizer

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    cache = CacheConfig(max_sequences=17, max_model_len=1024, snapshots_per_sequence=4)
    return LLM(cache=cache, engine=EngineConfig(max_num_seqs=8))


def schema_grammar(schema: dict[str, object]) -> Grammar:
    return Grammar(f"start: {json_value(schema)}\n")


def test_answers_validate_against_their_schemas_greedy_and_sampled(llm: LLM) -> None:
    prompt, _ = llm.encode_chat([{"role": "user", "content": "Answer in JSON."}])
    requests = []
    for schema in SCHEMAS:
        for seed in (None, 0, 1):  # None: greedy
            temperature = 0.0 if seed is None else 1.0
            params = SamplingParams(MAX_TOKENS, temperature, seed=seed, grammar=schema_grammar(schema))
            requests.append((schema, llm.engine.make_request(prompt, params)))
    outputs = llm._run([r for _, r in requests])
    finished = 0
    for (schema, _), output in zip(requests, outputs, strict=True):
        [completion] = output.outputs
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "stop":
            check_answer(completion.text, schema)
            finished += 1
    # The property was tested, not skipped by `length`: most answers end (a bare-number schema
    # may run on in digits; how many do depends on the CPU's kernel rounding: 22-24 of 30 seen).
    assert finished >= 2 * len(requests) // 3


def test_a_free_request_decodes_the_same_beside_constrained_ones(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    prompt = llm.encode("The function returns")
    [alone] = llm.generate(prompt, free)
    batch = [llm.engine.make_request(prompt, free)] + [
        llm.engine.make_request(prompt, SamplingParams(max_tokens=12, seed=s, grammar=schema_grammar(SCHEMAS[0])))
        for s in range(3)
    ]
    together = llm._run(batch)
    assert together[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for output in together[1:]:
        assert output.outputs[0].token_ids != alone.outputs[0].token_ids  # the grammar did act on those


def test_n_completions_each_follow_the_grammar(llm: LLM) -> None:
    prompt = llm.encode("Data:")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=3, grammar=schema_grammar(SCHEMAS[2]))
    [output] = llm.generate(prompt, params)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    for completion in output.outputs:
        if completion.finish_reason == "stop":
            check_answer(completion.text, SCHEMAS[2])


def test_the_mask_allows_exactly_the_tokens_the_grammar_accepts(llm: LLM) -> None:
    grammars = llm.engine.grammars
    matchers = [grammars.matcher(schema_grammar(SCHEMAS[0])) for _ in range(2)]
    for token in llm.tokenizer.encode('{"name": "'):
        matchers[1].consume(token)
    masks = allowed_tokens(matchers, llm.cm.vocab_size)
    assert masks.shape == (2, llm.cm.vocab_size) and masks.dtype == torch.bool
    for matcher, mask in zip(matchers, masks, strict=True):
        # The reference: llguidance's own one-token check, token by token.
        expected = [matcher.matcher.validate_tokens([t]) == 1 for t in range(llm.cm.vocab_size)]
        assert mask.tolist() == expected
    assert masks[0].sum() < masks[1].sum()  # "{" only, against any string character


def test_a_complete_answer_allows_only_end_of_sequence(llm: LLM) -> None:
    matcher = llm.engine.grammars.matcher(schema_grammar({"enum": ["yes"]}))
    for token in llm.tokenizer.encode('"yes"'):
        matcher.consume(token)
    [mask] = allowed_tokens([matcher], llm.cm.vocab_size)
    assert set(torch.nonzero(mask).flatten().tolist()) == set(llm.tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "string", "format": "regex"}, "regex"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ],
)
def test_a_keyword_the_engine_cannot_enforce_is_refused_by_name(llm: LLM, schema: dict, keyword: str) -> None:
    prompt = llm.encode("x")
    with pytest.raises(GrammarError, match=keyword):
        llm.engine.make_request(prompt, SamplingParams(grammar=schema_grammar(schema)))
    assert not llm.engine.waiting and not llm.engine.running


@pytest.mark.parametrize("field", ["stop", "stop_token_ids", "ignore_eos"])
def test_fields_that_would_cut_the_answer_cannot_go_with_a_grammar(field: str) -> None:
    value = {"stop": ("}",), "stop_token_ids": (5,), "ignore_eos": True}[field]
    with pytest.raises(ValueError, match=f"^{field} cannot be combined"):
        SamplingParams(grammar=schema_grammar({"type": "object"}), **{field: value})


def _accepts(grammars: Grammars, grammar: Grammar, ids: list[int]) -> bool:
    matcher = grammars.matcher(grammar).matcher
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_thinking_is_free_text_up_to_the_end_tag_then_the_grammar_holds(llm: LLM) -> None:
    """The default model's tokenizer has no </think> token: the tag is matched as text."""
    grammars = llm.engine.grammars
    grammar = Grammar(f"start: thinking {json_value({'type': 'integer'})}\n{grammars.thinking_rule()}\n")
    encode = llm.tokenizer.encode
    assert _accepts(grammars, grammar, encode("Two { and [ are fine here.\n</think>\n\n42"))
    assert not _accepts(grammars, grammar, encode("Reasoning\n</think>\n\nforty-two"))
    assert not _accepts(grammars, grammar, encode("42"))  # the answer comes after the reasoning


def test_thinking_ends_at_the_special_end_of_thinking_token() -> None:
    """Qwen3.5's </think> is one special token: the reasoning ends there and only there."""
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen35_tokenizer(Path(tmp), "3.5", compact=True)
        tokenizer = Tokenizer.from_dir(tmp)
    grammars = Grammars(tokenizer, COMPACT_VOCAB)
    assert grammars.tag("</think>") == "</think>" and grammars.tag("<not a token>") == json.dumps("<not a token>")
    grammar = Grammar(f"start: thinking {json_value({'type': 'integer'})}\n{grammars.thinking_rule()}\n")
    end = tokenizer.token_to_id("</think>")
    assert end is not None
    thought, answer = tokenizer.encode("The user wants a number.\n"), tokenizer.encode("\n\n7")
    assert _accepts(grammars, grammar, thought + [end] + answer)
    spelled = byte_token_ids(tokenizer, b"</think>")  # the tag written in bytes is not the token
    assert not _accepts(grammars, grammar, thought + spelled + answer)


def test_the_mask_covers_a_model_vocabulary_larger_than_the_tokenizer(llm: LLM) -> None:
    grammars = Grammars(llm.tokenizer, llm.cm.vocab_size + 100)  # padded rows, as real checkpoints have
    matcher = grammars.matcher(schema_grammar({"type": "boolean"}))
    [mask] = allowed_tokens([matcher], llm.cm.vocab_size + 100)
    assert mask.shape == (llm.cm.vocab_size + 100,) and not mask[llm.cm.vocab_size :].any()
    assert isinstance(grammars.ll_tokenizer, llguidance.LLTokenizer)
