"""Scoring prompts over HTTP: completions `echo` with `logprobs` (what lm-evaluation-harness's
`local-completions` sends for every log-likelihood task) and vLLM's `prompt_logprobs`, through the
official `openai` client; every figure equals transformers' log-softmax over the same tokens."""

from __future__ import annotations

from operator import itemgetter
from pathlib import Path
from typing import Any

import pytest
import torch
from served import MODEL, Served
from transformers import Qwen3NextForCausalLM

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Qwen3NextForCausalLM:
    return Qwen3NextForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def log_probs(model: Qwen3NextForCausalLM, ids: list[int]) -> torch.Tensor:
    """transformers' no-cache log-softmax for `ids`: [n, V], row p predicting token p + 1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_scores_the_prompt_as_transformers_does(served: Served, reference: Qwen3NextForCausalLM) -> None:
    prompt = "The cache keeps every prefix it has seen."
    ids = served.llm.tokenizer.encode(prompt)
    out = served.openai().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=5, max_tokens=0)
    [choice] = out.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens == [served.llm.tokenizer.decode([t]) for t in ids]
    assert logprobs.text_offset == list(range(len(ids)))  # one byte per token here
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = log_probs(reference, ids)
    texts = [served.llm.tokenizer.decode([t]) for t in range(want.shape[1])]  # several bytes decode to "\ufffd"
    for p in range(1, len(ids)):
        logprob, top = logprobs.token_logprobs[p], logprobs.top_logprobs[p]
        row = want[p - 1]
        assert logprob == pytest.approx(float(row[ids[p]]), abs=TOL)
        assert top[logprobs.tokens[p]] == logprob  # its own entry, exactly
        assert len(top) <= 6  # the five likeliest and the token itself, keyed by text
        values, likeliest = torch.topk(row, 6)
        for token, value in zip(likeliest[:5].tolist(), values[:5].tolist(), strict=True):
            if value > values[5] + TOL:  # clearly among the five
                assert texts[token] in top
        for text, value in top.items():
            assert any(abs(float(row[t]) - value) < TOL for t in range(len(texts)) if texts[t] == text)


def test_lm_eval_local_completions_loglikelihood_call(served: Served, reference: Qwen3NextForCausalLM) -> None:
    """The request lm-evaluation-harness sends (token ids, max_tokens 1, echo, logprobs 1) and the
    way it reads the answer: sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs."""
    encode = served.llm.tokenizer.encode
    pairs = [("Question: what is two plus two?\nAnswer:", " four"), ("The sky is", " green today")]
    requests = [(encode(context), encode(context + continuation)) for context, continuation in pairs]
    body = {
        "model": MODEL,
        "prompt": [full for _, full in requests],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    answer = served.http().post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    choices = sorted(answer.json()["choices"], key=itemgetter("index"))
    assert len(choices) == 2
    for choice, (context, full) in zip(choices, requests, strict=True):
        ctxlen = len(context)
        token_logprobs = choice["logprobs"]["token_logprobs"]
        top_logprobs = choice["logprobs"]["top_logprobs"]
        assert len(token_logprobs) == len(full) + 1  # the prompt, then the one generated token
        got = sum(token_logprobs[ctxlen:-1])
        scored = zip(token_logprobs[ctxlen:-1], top_logprobs[ctxlen:-1], strict=True)
        is_greedy = all(tok == max(top.values()) for tok, top in scored)
        want = log_probs(reference, full)
        targets = torch.tensor(full[ctxlen:])
        assert got == pytest.approx(float(want[ctxlen - 1 : -1].gather(1, targets[:, None]).sum()), abs=1e-3)
        assert is_greedy == bool((want[ctxlen - 1 : -1].argmax(-1) == targets).all())
        assert token_logprobs[-1] == pytest.approx(float(want[-1].max()), abs=TOL)  # greedy: the likeliest


def test_a_prompt_in_the_prefix_cache_is_scored_from_a_fresh_forward(
    served: Served, reference: Qwen3NextForCausalLM
) -> None:
    client = served.openai()
    ids = served.llm.tokenizer.encode("A prompt sent twice, the second time to be scored.")
    client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # it is cached

    scored = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert scored.usage is not None and scored.usage.prompt_tokens_details is not None
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # recomputed for its logits
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    want = log_probs(reference, ids)
    got = torch.tensor(logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=TOL, rtol=0)


def assert_vllm_prompt_logprobs(entries: list[Any], ids: list[int], want: torch.Tensor, k: int, decode: Any) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        keys = list(entry)
        assert keys[0] == str(ids[p])  # the prompt token first
        own = entry[str(ids[p])]
        assert own["logprob"] == pytest.approx(float(want[p - 1, ids[p]]), abs=TOL)
        assert own["decoded_token"] == decode([ids[p]])
        top = sorted((v["rank"], int(t), v["logprob"]) for t, v in entry.items() if t != str(ids[p]) or v["rank"] <= k)
        assert [r for r, _, _ in top][:k] == list(range(1, k + 1))
        assert len(entry) in (k, k + 1)
        for rank, token, logprob in top:
            assert logprob == pytest.approx(float(want[p - 1, token]), abs=TOL)
            assert rank == int((want[p - 1] > want[p - 1, token] + TOL).sum()) + 1


def test_vllm_prompt_logprobs_on_completions_and_chat(served: Served, reference: Qwen3NextForCausalLM) -> None:
    client = served.openai()
    decode = served.llm.tokenizer.decode
    ids = served.llm.tokenizer.encode("Score me, token by token.")
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    [choice] = out.choices
    assert choice.text and choice.logprobs is None
    assert_vllm_prompt_logprobs(choice.prompt_logprobs, ids, log_probs(reference, ids), 2, decode)  # type: ignore[attr-defined]

    messages = [{"role": "user", "content": "Score this message."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    chat_ids, _ = served.llm.encode_chat(messages)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
    entries = chat.prompt_logprobs  # type: ignore[attr-defined]
    assert_vllm_prompt_logprobs(entries, chat_ids, log_probs(reference, chat_ids), 0, decode)
    assert all(entry is None or len(entry) == 1 for entry in entries)


def test_echo_streamed_equals_echo_answered_whole(served: Served) -> None:
    client = served.openai()
    request: dict[str, Any] = dict(model=MODEL, prompt="Echo, then four more", echo=True, logprobs=2, max_tokens=4)
    whole = client.completions.create(**request, temperature=0)
    chunks = list(client.completions.create(**request, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].text.startswith("Echo, then four more")
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs or []]
    assert whole.choices[0].logprobs is not None
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []]
    assert offsets == whole.choices[0].logprobs.text_offset

    plain = client.completions.create(model=MODEL, prompt=[72, 105], echo=True, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith("Hi") and plain.choices[0].logprobs is None
