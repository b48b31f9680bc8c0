"""The engine end to end: prefix reuse counted exactly, batching that does not change answers,
n > 1 forks, preemption, bad input. Greedy unless a test says otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def make_llm(chat_model: tuple[Path, Any], prefix_caching: bool = True, **cache: Any) -> LLM:
    settings: dict[str, Any] = dict(max_sequences=17, max_model_len=2048, snapshots_per_sequence=16)
    settings.update(cache)
    engine = EngineConfig(max_num_seqs=8, prefix_caching=prefix_caching)
    return LLM(chat_model[0], cache=CacheConfig(**settings), engine=engine)


def user(k: int) -> dict[str, str]:
    return {"role": "user", "content": f"Question number {k}: what comes next?"}


def test_greedy_output_equals_transformers_generate(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    ids = llm.encode("The function returns")
    out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    with torch.no_grad():
        want = chat_model[1].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert out.outputs[0].token_ids == want.tolist()


def test_eight_turn_chat_computes_only_the_new_tokens(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    previous: tuple[list[int], list[int]] | None = None  # (prompt ids, generated ids) of the last turn
    for k in range(8):
        messages.append(user(k))
        prompt, _ = llm.encode_chat(messages)
        out = llm.chat(messages, GREEDY)
        usage = out.usage
        if previous is None:
            assert usage.cached_tokens == 0
        else:
            last_prompt, last_generated = previous
            held = len(last_prompt) + len(last_generated) - 1  # the last sampled token was never fed
            assert prompt[:held] == last_prompt + last_generated[:-1]
            assert usage.cached_tokens == held
            # the last generated token, "<|im_end|>\n", the new message and the generation prompt
            assert usage.computed_tokens == len(prompt) - held
        previous = (prompt, out.outputs[0].token_ids)
        messages.append({"role": "assistant", "content": out.text})
    assert usage.computed_tokens < 60
    without = make_llm(chat_model, prefix_caching=False)
    assert without.chat(messages[:-1], GREEDY).text == messages[-1]["content"]


def test_regenerate_edit_and_branch_recompute_only_from_the_change(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    messages: list[dict[str, str]] = []
    for k in range(5):
        messages.append(user(k))
        messages.append({"role": "assistant", "content": llm.chat(messages, GREEDY).text})
    history = messages[:-1]  # up to the last user message

    regenerated = llm.chat(history, GREEDY)
    _, ends = llm.encode_chat(history)
    after_last_user = len(llm.encode_chat(history)[0]) - (ends[-2] + 1)
    assert 1 <= regenerated.usage.computed_tokens <= after_last_user
    assert regenerated.text == messages[-1]["content"]

    edited = [*history[:-1], {"role": "user", "content": "Something else entirely."}]
    ids, ends = llm.encode_chat(edited)
    out = llm.chat(edited, GREEDY)
    assert out.usage.computed_tokens == len(ids) - (ends[-3] + 1)  # from the edited message on

    branched = [*messages[:4], {"role": "user", "content": "Back three turns, then a new path."}]
    ids, ends = llm.encode_chat(branched)
    out = llm.chat(branched, GREEDY)
    assert out.usage.computed_tokens == len(ids) - (ends[-3] + 1)
    llm.cm.cache.check_integrity()


def system_prompt() -> dict[str, str]:
    return {"role": "system", "content": ("Follow these rules carefully. " * 34)[:1000]}


def test_shared_system_prompt_is_computed_once_sequentially_and_concurrently(chat_model: tuple[Path, Any]) -> None:
    for together in (False, True):
        llm = make_llm(chat_model)
        a = [system_prompt(), {"role": "user", "content": "First user here."}]
        b = [system_prompt(), {"role": "user", "content": "A second, different user."}]
        (ids_a, ends_a), (ids_b, ends_b) = llm.encode_chat(a), llm.encode_chat(b)
        assert ends_a[0] == ends_b[0] and ends_a[0] >= 1000
        if together:
            ra, rb = llm.submit(ids_a, GREEDY, ends_a), llm.submit(ids_b, GREEDY, ends_b)
            llm.engine.run_until_done()
            first, second = ra.usage, rb.usage
        else:
            first, second = llm.chat(a, GREEDY).usage, llm.chat(b, GREEDY).usage
        assert first.computed_tokens == len(ids_a)
        assert second.computed_tokens == len(ids_b) - (ends_b[0] + 1), f"together={together}"


def test_n4_computes_the_prompt_once_and_each_branch_equals_a_single_run(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model)
    ids = llm.encode("Once upon a time")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=4, ignore_eos=True)
    out = llm.generate(ids, params)[0]
    assert out.usage.computed_tokens == len(ids)
    texts = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in texts}) == 4
    for i, tokens in enumerate(texts):
        alone = make_llm(chat_model).generate(
            ids, SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True)
        )[0]
        assert alone.outputs[0].token_ids == tokens
    llm.cm.cache.check_integrity()


def test_32_concurrent_requests_under_a_tight_budget_match_running_alone(chat_model: tuple[Path, Any]) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(5, 120, (32,))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = make_llm(chat_model, prefix_caching=False)
    expected = [alone.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    # KV for 3 full sequences in small blocks: requests wait, decode growth preempts, they resume
    spec = alone.cm.cache.spec
    tight = make_llm(chat_model, max_model_len=160, block_size=4, kv_bytes=120 * 4 * spec.kv_bytes_per_token)
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    tight.engine.index.clear()
    tight.cm.cache.check_integrity()
    assert tight.cm.stats()["kv_bytes_used"] == 0
    assert tight.engine.metrics().get("preemptions", 0) >= 1  # the budget really was too small


def test_a_request_is_queued_exactly_while_it_waits_preempted_included(chat_model: tuple[Path, Any]) -> None:
    """`Request.queued` (what the server counts per API key) follows the engine's own waiting list."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(40, 120, (8,))]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = make_llm(chat_model).cm.cache.spec
    tight = make_llm(chat_model, max_model_len=160, block_size=4, kv_bytes=120 * 4 * spec.kv_bytes_per_token)
    requests = [tight.submit(p, params) for p in prompts]
    assert all(r.queued for r in requests)
    requeued = 0
    while not all(r.finished for r in requests):
        tight.engine.step()
        waiting = set(map(id, tight.engine.waiting))
        for r in requests:
            if not r.finished:
                assert r.queued == (id(r) in waiting), r.request_id
                requeued += r.queued and r.usage.preemptions > 0
    assert requeued > 0  # a preempted request was counted as waiting again


def test_tiny_snapshot_budget_degrades_to_recompute_never_to_wrong_answers(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model, snapshot_bytes=0)
    reference = make_llm(chat_model, prefix_caching=False)
    messages: list[dict[str, str]] = []
    for k in range(3):
        messages.append(user(k))
        out = llm.chat(messages, GREEDY)
        assert out.text == reference.chat(messages, GREEDY).text
        messages.append({"role": "assistant", "content": out.text})
    regenerated = llm.chat(messages[:-1], GREEDY)  # no snapshot to restore: recomputed, same answer
    assert regenerated.text == messages[-1]["content"]
    llm.cm.cache.check_integrity()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ([1] * 2048, GREEDY, "max_model_len"),
        ([300], GREEDY, "vocabulary"),
        ([1, 2], SamplingParams(n=9), "max_num_seqs"),
    ],
)
def test_bad_requests_are_refused_and_others_are_undisturbed(
    chat_model: tuple[Path, Any], prompt: list[int], params: SamplingParams, match: str
) -> None:
    llm = make_llm(chat_model)
    ok = llm.submit([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=match):
        llm.submit(prompt, params)
    llm.engine.run_until_done()
    assert ok.finished
    assert len(ok.output().outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "kwargs",
    [dict(stop=("",)), dict(temperature=-1.0), dict(top_p=0.0), dict(max_tokens=-3), dict(temperature=float("nan"))],
)
def test_absurd_sampling_values_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_cancel_releases_the_sequence_at_once(chat_model: tuple[Path, Any]) -> None:
    llm = make_llm(chat_model, prefix_caching=False)
    request = llm.submit(list(range(40)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    assert llm.cm.stats()["sequences"] == 1
    llm.engine.cancel(request.request_id)
    llm.engine.step()
    assert request.finished and request.output().outputs[0].finish_reason == "cancelled"
    assert llm.cm.stats()["sequences"] == 0
    llm.cm.cache.check_integrity()


def test_reuse_stops_where_retokenized_text_differs_unless_generated_ids_are_kept(
    chat_model: tuple[Path, Any],
) -> None:
    llm = make_llm(chat_model)
    messages = [user(0)]
    prompt, _ = llm.encode_chat(messages)
    out = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    generated = out.outputs[0].token_ids
    # The random model emits bytes that are not valid UTF-8: its text holds U+FFFD, which
    # re-encodes to other ids. This is where the two first differ:
    retokenized = llm.tokenizer.encode(out.text)
    differs = next(i for i, (a, b) in enumerate(zip(generated, retokenized, strict=False)) if a != b)
    follow = [*messages, {"role": "assistant", "content": out.text}, user(1)]

    llm._generated.clear()  # as a client that sends back only the text
    ids, _ = llm.encode_chat(follow)
    assert ids[: len(prompt) + differs] == prompt + generated[:differs]
    assert ids[len(prompt) + differs] != generated[differs]
    # reuse falls back to the last restore point before the difference: the end of the prompt
    assert llm.chat(follow, GREEDY).usage.cached_tokens == len(prompt)

    llm.remember(out)  # what the engine does for its own answers: the text maps back to its ids
    ids, _ = llm.encode_chat(follow)
    assert ids[: len(prompt) + len(generated)] == prompt + generated
    assert llm.chat(follow, GREEDY).usage.cached_tokens == len(prompt) + len(generated) - 1
