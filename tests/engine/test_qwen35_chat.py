"""Qwen3.5 / 3.6 through the engine: generation equal to transformers, both end ids
stopping, and prefix reuse counted exactly although the template rewrites earlier assistant turns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from qwen35_reference import write_qwen35_chat_model
from qwen35_tokenizer import added_ids

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams
from hybridkv.server.parsing import Content, Reasoning, split_output

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module", params=["3.5", "3.6"])
def qwen35_chat(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_qwen35_chat_model(tmp_path_factory.mktemp(f"qwen{request.param}"), template=request.param)


def make_llm(model: tuple[Path, Any]) -> LLM:
    cache = CacheConfig(max_sequences=9, max_model_len=1024, snapshots_per_sequence=16)
    return LLM(model[0], cache=cache, engine=EngineConfig(max_num_seqs=4))


def answer_message(text: str) -> dict[str, str]:
    """The assistant message a client sends back: the server's split of the generated text (the
    prompt ended inside <think>)."""
    pieces = split_output(text, reasoning=True)
    return {
        "role": "assistant",
        "content": "".join(p.text for p in pieces if isinstance(p, Content)),
        "reasoning_content": "".join(p.text for p in pieces if isinstance(p, Reasoning)),
    }


def test_greedy_output_equals_transformers_generate_and_both_end_ids_stop(qwen35_chat):
    llm = make_llm(qwen35_chat)
    ids = added_ids(compact=True)
    assert llm.tokenizer.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    ids, _ = llm.encode_chat([{"role": "user", "content": "hello there"}])
    out = llm.generate(ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    with torch.no_grad():
        want = qwen35_chat[1].generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert out.outputs[0].token_ids == want[0, len(ids) :].tolist()


def test_the_prompt_opens_a_think_block_unless_thinking_is_off(qwen35_chat):
    llm = make_llm(qwen35_chat)
    ids = added_ids(compact=True)
    on, _ = llm.encode_chat([{"role": "user", "content": "hello"}])
    off, _ = llm.encode_chat([{"role": "user", "content": "hello"}], enable_thinking=False)
    assert on[-2:] == [ids["<think>"], llm.tokenizer.encode("\n")[0]]
    assert ids["</think>"] in off[-4:] and off[-1] != ids["<think>"]


def test_next_turn_computes_from_the_rewritten_assistant_message(qwen35_chat):
    """The template strips the reasoning of earlier answers, so turn 2 is no extension of turn 1:
    it must compute exactly from that answer's <|im_start|> (3.5), or — with Qwen3.6's
    preserve_thinking, which keeps the answer as generated — only what turn 1 never fed."""
    llm = make_llm(qwen35_chat)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    turn1 = [SYSTEM, {"role": "user", "content": "hello there, the weather in Paris?"}]
    first = llm.chat(turn1, params)
    generated = first.outputs[0]
    turn2 = [*turn1, answer_message(generated.text), {"role": "user", "content": "and you?"}]
    preserve = qwen35_chat[0].name.startswith("qwen3.6")
    kwargs = {"preserve_thinking": True} if preserve else {}
    prompt2, _ = llm.encode_chat(turn2, **kwargs)
    second = llm.chat(turn2, params, **kwargs)
    assert second.prompt_ids == prompt2
    if preserve:
        fed = first.prompt_ids + generated.token_ids[:-1]  # the last sampled token is never fed
        assert prompt2[: len(fed)] == fed  # the answer is re-encoded to its generated ids
        assert second.usage.cached_tokens == len(fed)
    else:
        history, _ = llm.encode_chat(turn1, add_generation_prompt=False)  # ends before the answer's <|im_start|>
        assert prompt2[: len(history)] == history and prompt2[len(history)] == added_ids(True)["<|im_start|>"]
        assert second.usage.cached_tokens == len(history)
    assert second.usage.computed_tokens == len(prompt2) - second.usage.cached_tokens
