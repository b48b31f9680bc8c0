"""The OpenAI-compatible API through the official `openai` client: chat and completions, streamed
or not, n = 2, stop strings, seeds, logprobs, and usage that counts prompt tokens from the cache."""

from __future__ import annotations

from served import MODEL, Served


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_the_model_is_listed_under_one_id(served: Served) -> None:
    client = served.openai()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert [m.model for m in served.ollama().list().models] == [MODEL]
    tags = served.http().get("/api/tags").json()["models"]
    assert [(m["name"], m["model"]) for m in tags] == [(MODEL, MODEL)]


def test_chat_streamed_equals_chat_answered_whole(served: Served) -> None:
    client = served.openai()
    request = dict(model=MODEL, messages=chat("Streamed or not?"), max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.model == MODEL and whole.usage is not None and whole.usage.completion_tokens == 12

    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage  # the last chunk: no choices, the usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 12)


def test_completion_streamed_equals_completion_answered_whole(served: Served) -> None:
    client = served.openai()
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.usage is not None and whole.usage.prompt_tokens == len("Once upon a time")  # bytes


def test_n_2_gives_two_reproducible_samples(served: Served) -> None:
    client = served.openai()
    request = dict(model=MODEL, messages=chat("Two answers"), max_tokens=10, temperature=1.0, seed=7, n=2)
    first = client.chat.completions.create(**request)  # type: ignore[call-overload]
    again = client.chat.completions.create(**request)  # type: ignore[call-overload]
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts[0] != texts[1]  # branch i samples with seed + i
    assert [c.message.content for c in again.choices] == texts
    assert first.usage is not None and first.usage.completion_tokens == 20

    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**request, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


def test_same_seed_same_text_other_seed_other_text(served: Served) -> None:
    client = served.openai()

    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt="Roll the dice:", max_tokens=16, temperature=1.0, seed=seed)
        return out.choices[0].text

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_stop_string_ends_the_output_before_it(served: Served) -> None:
    client = served.openai()
    request = dict(model=MODEL, prompt="Where does it stop?", max_tokens=24, temperature=0)
    full = client.completions.create(**request).choices[0].text  # type: ignore[call-overload]
    stop = full[8:10]
    cut = client.completions.create(**request, stop=[stop]).choices[0]  # type: ignore[call-overload]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


def test_logprobs_for_chosen_and_top_tokens(served: Served) -> None:
    client = served.openai()
    out = client.chat.completions.create(
        model=MODEL, messages=chat("Logprobs"), max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        top = entry.top_logprobs[0]  # greedy: the chosen token is the likeliest
        assert (top.token, round(top.logprob, 4)) == (entry.token, round(entry.logprob, 4)) and entry.logprob < 0
    legacy = client.completions.create(model=MODEL, prompt="Logprobs", max_tokens=3, temperature=0, logprobs=2)
    assert legacy.choices[0].logprobs is not None and len(legacy.choices[0].logprobs.top_logprobs or []) == 3


def test_second_turn_takes_the_first_from_the_cache(served: Served) -> None:
    client = served.openai()
    messages = [{"role": "system", "content": "Cache test."}, *chat("First question")]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert first.usage is not None
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, *chat("Second question")]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token was sampled, not fed
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert second.usage.prompt_tokens > held
