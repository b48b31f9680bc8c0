"""A cancelled request keeps what it computed: its prompt and the answer tokens fed so far go into
the prefix index like a finished request's, so sending it again computes only what is new.
Counted exactly through the usage counters; logits after reuse equal transformers' own forward."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv import CacheConfig
from hybridkv.chat import answer
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.request import Request
from hybridkv.engine.sampling import SamplingParams

CHUNK = 16
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def make_llm(chat_model: tuple[Path, Any], chunk: int = 1024) -> LLM:
    cache = CacheConfig(max_sequences=17, max_model_len=2048, snapshots_per_sequence=16)
    return LLM(chat_model[0], cache=cache, engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=chunk))


def prompt_of(llm: LLM, n: int) -> list[int]:
    ids = llm.encode(" ".join(f"line {i} of a long shared document." for i in range(n)))
    assert len(ids) >= n
    return ids[:n]


def steps(llm: LLM, count: int) -> None:
    for _ in range(count):
        llm.engine.step()


def cancel(llm: LLM, request: Request) -> None:
    llm.engine.cancel(request.request_id)
    llm.engine.run_until_done()
    assert request.finished and request.output().outputs[0].finish_reason == "cancelled"
    llm.cm.cache.check_integrity()


def run(llm: LLM, ids: list[int], params: SamplingParams = ONE) -> Request:
    request = llm.submit(ids, params)
    llm.engine.run_until_done()
    llm.cm.cache.check_integrity()
    return request


def assert_reused_logits_match_transformers(llm: LLM, chat_model: tuple[Path, Any], ids: list[int]) -> None:
    """Fork the index's best entry for `ids` where a request would, feed the rest: the logits are a
    fresh forward's."""
    match = llm.engine.index.lookup(ids, len(ids) - 1)
    assert match is not None
    seq, keep = llm.cm.fork_prefix(match.seq, match.length)
    try:
        got = llm.cm.feed({seq: ids[keep:]}, logits="all")[seq]
    finally:
        llm.cm.release(seq)
    with torch.no_grad():
        want = chat_model[1](torch.tensor([ids])).logits[0, keep:].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    llm.cm.cache.check_integrity()


def test_cancel_mid_prefill_keeps_exactly_the_computed_chunks(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model, chunk=CHUNK)
    prompt = prompt_of(llm, 100)
    first = llm.submit(prompt, LONG)
    steps(llm, 3)  # three chunks of 16 computed, the fourth not started
    cancel(llm, first)
    assert first.usage.computed_tokens == 3 * CHUNK and first.usage.completion_tokens == 0
    assert len(llm.engine.index) == 1 and llm.cm.stats()["sequences"] == 1
    assert_reused_logits_match_transformers(llm, chat_model, prompt)

    again = run(llm, prompt)
    assert again.usage.cached_tokens == 3 * CHUNK
    assert again.usage.computed_tokens == len(prompt) - 3 * CHUNK
    # the re-sent prompt finished: the end-of-prompt snapshots are there now, as for any prompt
    assert run(llm, prompt).usage.cached_tokens == len(prompt) - 1


def test_cancel_mid_decode_keeps_the_prompt_and_the_fed_answer(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    prompt = prompt_of(llm, 60)
    first = llm.submit(prompt, LONG)
    steps(llm, 5)  # the prompt and 4 answer tokens fed; a 5th sampled, not fed
    cancel(llm, first)
    generated = first.output().outputs[0].token_ids
    assert len(generated) == 5
    (entry,) = llm.engine.index._tokens.values()
    assert entry == prompt + generated[:-1]  # never the sampled token that was not fed

    same = run(llm, prompt)  # restores the end-of-prompt snapshot; computes the last token for its logits
    assert (same.usage.cached_tokens, same.usage.computed_tokens) == (len(prompt) - 1, 1)
    longer = [*prompt, *generated, 7, 8]
    assert_reused_logits_match_transformers(llm, chat_model, longer)
    onward = run(llm, longer)
    assert onward.usage.cached_tokens == len(prompt) + len(generated) - 1
    assert onward.usage.computed_tokens == 3


def test_the_answer_after_reuse_equals_transformers_generate(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model, chunk=CHUNK)
    prompt = prompt_of(llm, 40)
    cancel_after_two = llm.submit(prompt, LONG)
    steps(llm, 2)
    cancel(llm, cancel_after_two)
    out = run(llm, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out.usage.cached_tokens == 2 * CHUNK
    with torch.no_grad():
        want = chat_model[1].generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert out.output().outputs[0].token_ids == want.tolist()


def test_a_request_cancelled_while_queued_inserts_nothing(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    request = llm.submit(prompt_of(llm, 30), LONG)
    cancel(llm, request)
    assert request.usage.computed_tokens == 0
    assert len(llm.engine.index) == 0 and llm.cm.stats()["sequences"] == 0


def test_shutdown_keeps_what_running_requests_computed(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    prompt = prompt_of(llm, 50)
    request = llm.submit(prompt, LONG)
    steps(llm, 3)
    llm.engine.shutdown()
    assert request.output().outputs[0].finish_reason == "cancelled"
    llm.cm.cache.check_integrity()
    generated = request.output().outputs[0].token_ids
    assert list(llm.engine.index._tokens.values()) == [prompt + generated[:-1]]


def test_an_interrupted_forward_is_never_reused(chat_model: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm(chat_model, chunk=CHUNK)
    request = llm.submit(prompt_of(llm, 60), LONG)
    steps(llm, 2)
    model_forward = llm.cm.model.forward

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.cm.model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.engine.step()
    monkeypatch.setattr(llm.cm.model, "forward", model_forward)
    cancel(llm, request)
    assert len(llm.engine.index) == 0 and llm.cm.stats()["sequences"] == 0


def ctrl_c_after(llm: LLM, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Press Ctrl-C once, right after the engine's `count`-th step from now."""
    step = llm.engine.step
    done = [0]

    def stepping() -> None:
        step()
        done[0] += 1
        if done[0] == count:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(llm.engine, "step", stepping)


def usage_line(err: str) -> tuple[int, int, int, int, str]:
    """(prompt, reused, computed, generated, finish reason) from `answer`'s last summary line."""
    found = re.findall(r"\[prompt (\d+) tokens: (\d+) reused, (\d+) computed; (\d+) generated .*; (\w+)\]", err)
    prompt, reused, computed, generated, finish = found[-1]
    return int(prompt), int(reused), int(computed), int(generated), finish


def test_run_continues_and_regenerates_after_ctrl_c_from_the_cache(
    chat_model: tuple[Path, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(chat_model)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a long story."}]
    prompt, _ = llm.encode_chat(messages)
    handler = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as patch:
        ctrl_c_after(llm, 6, patch)
        partial = answer(llm, messages, LONG)
    n, reused, computed, generated, finish = usage_line(capsys.readouterr().err)
    assert (n, reused, computed, generated, finish) == (len(prompt), 0, len(prompt), 6, "cancelled")
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    llm.cm.cache.check_integrity()

    messages.append({"role": "assistant", "content": partial})
    answer(llm, [*messages, {"role": "user", "content": "Go on."}], ONE)
    # the conversation is reused up to the last answer token, which was sampled but never fed
    assert usage_line(capsys.readouterr().err)[1] == len(prompt) + generated - 1

    answer(llm, messages[:-1], ONE)  # /regenerate: the same prompt again
    assert usage_line(capsys.readouterr().err)[1:3] == (len(prompt) - 1, 1)
    llm.cm.cache.check_integrity()


def test_ctrl_c_during_a_forward_lets_it_finish_and_keeps_it(
    chat_model: tuple[Path, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(chat_model)
    messages = [{"role": "user", "content": "Count to a thousand."}]
    prompt, _ = llm.encode_chat(messages)
    model_forward = llm.cm.model.forward
    calls = [0]

    def pressed_during_the_third(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return model_forward(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(llm.cm.model, "forward", pressed_during_the_third)
        answer(llm, messages, LONG)
    generated = usage_line(capsys.readouterr().err)[3]
    assert generated == 3  # the third forward (prompt, 2 answer tokens fed) finished and sampled
    (entry,) = llm.engine.index._tokens.values()
    assert len(entry) == len(prompt) + generated - 1
    llm.cm.cache.check_integrity()
