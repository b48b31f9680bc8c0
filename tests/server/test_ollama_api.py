"""The Ollama-compatible API through the official `ollama` client: generate and chat, streamed (the
default) or not, options, `context` round trips, durations in nanoseconds, model information."""

from __future__ import annotations

import ollama
import pytest
from served import MAX_MODEL_LEN, MODEL, Served

GREEDY = {"temperature": 0, "num_predict": 8}


def test_generate_streamed_equals_generate_answered_whole(served: Served) -> None:
    client = served.ollama()
    whole = client.generate(model=MODEL, prompt="Why is the sky blue?", options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.model == MODEL
    assert whole.eval_count == 8 and whole.prompt_eval_count == len(whole.context or []) - 8
    for duration in (whole.total_duration, whole.prompt_eval_duration, whole.eval_duration):
        assert isinstance(duration, int) and 0 < duration < 60e9  # nanoseconds
    assert whole.total_duration >= whole.eval_duration  # type: ignore[operator]

    chunks = list(client.generate(model=f"{MODEL}:latest", prompt="Why is the sky blue?", options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.response or "" for c in chunks) == whole.response
    assert chunks[-1].context == whole.context


def test_context_continues_a_generation_from_the_cache(served: Served) -> None:
    client = served.ollama()
    first = client.generate(model=MODEL, prompt="Tell me a story", options=GREEDY)
    assert first.context is not None
    before = served.metrics()['hybridkv_prompt_tokens_total{source="cache"}']
    second = client.generate(model=MODEL, prompt="Go on", context=first.context, options=GREEDY)
    cached = served.metrics()['hybridkv_prompt_tokens_total{source="cache"}'] - before
    assert second.context is not None and second.context[: len(first.context)] == first.context
    assert second.prompt_eval_count is not None and second.prompt_eval_count > len(first.context)
    assert cached == len(first.context) - 1  # all but the last token, which was sampled, never fed


def test_chat_streamed_equals_chat_answered_whole(served: Served) -> None:
    client = served.ollama()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.done_reason == "length" and whole.eval_count == 8
    chunks = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].done and chunks[-1].prompt_eval_count == whole.prompt_eval_count


def test_seeded_options_reproduce_and_stop_cuts(served: Served) -> None:
    client = served.ollama()
    options = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.01, "seed": 3, "num_predict": 16}
    options |= {"repeat_penalty": 1.1, "num_ctx": 4096, "num_thread": 2}  # num_ctx is capped to the server's
    first = client.generate(model=MODEL, prompt="Seeded", options=options)
    assert client.generate(model=MODEL, prompt="Seeded", options=options).response == first.response
    assert client.generate(model=MODEL, prompt="Seeded", options=options | {"seed": 4}).response != first.response
    text = first.response or ""
    cut = client.generate(model=MODEL, prompt="Seeded", options=options | {"stop": [text[6:8]]})
    assert cut.response == text[: text.index(text[6:8])] and cut.done_reason == "stop"


def test_num_predict_minus_one_runs_to_the_context_end(served: Served) -> None:
    out = served.ollama().generate(
        model=MODEL, prompt="x", options={"temperature": 0, "num_predict": -1, "num_ctx": 40}
    )
    assert out.done_reason == "length"
    assert (out.prompt_eval_count or 0) + (out.eval_count or 0) == 40


def test_logprobs(served: Served) -> None:
    out = served.ollama().generate(model=MODEL, prompt="Logprobs", options=GREEDY, logprobs=True, top_logprobs=2)
    assert out.logprobs is not None and len(out.logprobs) == 8
    assert all(len(entry.top_logprobs or []) == 2 for entry in out.logprobs)


def test_model_information(served: Served) -> None:
    client = served.ollama()
    shown = client.show(MODEL)
    assert shown.details is not None and shown.details.family == "qwen3_next"
    assert shown.modelinfo is not None and shown.modelinfo["qwen3_next.context_length"] == MAX_MODEL_LEN
    assert "<|im_start|>" in (shown.template or "")
    [running] = client.ps().models
    assert (running.model, running.name, running.context_length) == (MODEL, MODEL, MAX_MODEL_LEN)
    assert served.http().get("/api/version").json()["version"]


def test_empty_prompt_loads_the_model(served: Served) -> None:
    assert served.ollama().generate(model=MODEL).done_reason == "load"
    assert served.ollama().chat(model=MODEL, messages=[]).done_reason == "load"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"mirostat": 2}, "options.mirostat"),
        ({"repeat_penalty": 1.2, "repeat_last_n": 64}, "options.repeat_last_n"),
        ({"n": 2}, "options.n"),
        ({"num_predict": -7}, "options.num_predict"),
        ({"temperature": "warm"}, "options.temperature"),
        ({"top_p": 0}, "options.top_p"),
    ],
)
def test_unsupported_or_bad_options_are_400_naming_the_option(
    served: Served, options: dict[str, object], field: str
) -> None:
    with pytest.raises(ollama.ResponseError) as error:
        served.ollama().generate(model=MODEL, prompt="hi", options=options)
    assert error.value.status_code == 400 and field in error.value.error


def test_unsupported_request_fields_are_400(served: Served) -> None:
    client = served.ollama()
    for call, field in [
        (lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], think="high"), "think"),
        (lambda: client.generate(model=MODEL, prompt="hi", images=[b"\x89PNG"]), "images"),
    ]:
        with pytest.raises(ollama.ResponseError) as error:
            call()
        assert error.value.status_code == 400 and field in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(model="llama3", prompt="hi")
    assert error.value.status_code == 404
