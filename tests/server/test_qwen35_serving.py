"""A released-style Qwen3.5 served and run as a user would: XML tool calls typed by the tool's
schema and reasoning split out, with thinking on and off, through the official openai and ollama
clients, streamed or not; image, video and audio inputs refused by name; and `hybridkv
generate`, `run` and `serve --model DIR` on the checkpoint."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import ollama
import openai
import pytest
import torch
from qwen35_weather import ANSWERS, ARGUMENTS, MESSAGES, REASONING, TOOLS, hf_prompt_ids, write_weather_model
from served import MODEL, Served, start, stop, wait_until_healthy

from hybridkv import CacheConfig, cli
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.tokenizer import Tokenizer

MAX_TOKENS = 200  # more than either answer needs: it must end by itself, with <|im_end|>
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def weather_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_weather_model(tmp_path_factory.mktemp("qwen35-weather"))


@pytest.fixture(scope="module")
def hf_tokenizer(weather_model: tuple[Path, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weather_model[0])


@pytest.fixture(scope="module")
def qwen35_server(weather_model: tuple[Path, Any]) -> Iterator[Served]:
    cache = CacheConfig(max_sequences=5, max_model_len=2048, snapshots_per_sequence=16)
    served, thread = start(LLM(weather_model[0], cache=cache, engine=EngineConfig(max_num_seqs=2)))
    yield served
    stop(served, thread)


def answer_tokens(hf_tokenizer: Any, thinking: bool) -> int:
    return len(hf_tokenizer.encode(ANSWERS[thinking], add_special_tokens=False))


# -- OpenAI ------------------------------------------------------------------------------------


class Answer(NamedTuple):
    content: str | None
    reasoning: str | None
    calls: list[tuple[str, str, str]]  # (id, name, arguments)
    finish: str | None
    usage: Any


def openai_answer(client: openai.OpenAI, stream: bool, model: str = MODEL, **kwargs: Any) -> Answer:
    """The answer to the weather question, assembled from the deltas when streamed."""
    request: dict[str, Any] = dict(model=model, messages=MESSAGES, tools=TOOLS, **GREEDY, **kwargs)
    if not stream:
        out = client.chat.completions.create(**request)
        [choice] = out.choices
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        reasoning = (message.model_extra or {}).get("reasoning_content")
        return Answer(message.content, reasoning, calls, choice.finish_reason, out.usage)
    content, reasoning, finish, usage = "", "", None, None
    pieces: dict[int, tuple[str, str, str]] = {}
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for delta_choice in chunk.choices:
            delta = delta_choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                id_, name, arguments = pieces.get(call.index, ("", "", ""))
                function = call.function
                pieces[call.index] = (
                    id_ + (call.id or ""),
                    name + ((function.name or "") if function else ""),
                    arguments + ((function.arguments or "") if function else ""),
                )
            finish = delta_choice.finish_reason or finish
    return Answer(content or None, reasoning or None, list(pieces.values()), finish, usage)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_openai_chat_returns_the_xml_tool_call_typed_by_its_schema(
    qwen35_server: Served, hf_tokenizer: Any, thinking: bool, stream: bool
) -> None:
    kwargs: dict[str, Any] = {} if thinking else {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    answer = openai_answer(qwen35_server.openai(), stream, **kwargs)
    [(call_id, name, arguments)] = answer.calls
    assert call_id.startswith("call_") and name == "get_weather"
    assert isinstance(arguments, str) and json.loads(arguments) == ARGUMENTS  # "2" became 2: an integer
    assert answer.finish == "tool_calls"
    assert answer.content is None
    assert answer.reasoning == (REASONING if thinking else None)
    usage = answer.usage
    assert usage.prompt_tokens == len(hf_prompt_ids(hf_tokenizer, thinking))  # as transformers renders it
    assert usage.completion_tokens == answer_tokens(hf_tokenizer, thinking)


# -- Ollama ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("think", [True, False], ids=["think", "no-think"])
def test_ollama_chat_returns_the_tool_call_with_arguments_as_an_object(
    qwen35_server: Served, hf_tokenizer: Any, think: bool, stream: bool
) -> None:
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    request: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, think=think, options=options)
    client = qwen35_server.ollama()
    chunks = list(client.chat(**request, stream=True)) if stream else [client.chat(**request)]
    *_, last = chunks
    calls = [call for c in chunks for call in c.message.tool_calls or []]
    [call] = calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == ARGUMENTS
    assert "".join(c.message.thinking or "" for c in chunks) == (REASONING if think else "")
    assert "".join(c.message.content or "" for c in chunks) == ""
    assert last.done and last.done_reason == "stop"
    assert last.prompt_eval_count == len(hf_prompt_ids(hf_tokenizer, think))
    assert last.eval_count == answer_tokens(hf_tokenizer, think)


# -- constrained answers: the grammar starts after </think> ------------------------------------

FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_forced_call_is_the_models_own_xml_call_after_its_reasoning(
    qwen35_server: Served, thinking: bool, stream: bool
) -> None:
    """The trained answer fits the grammar of a forced call in Qwen3.5's XML format, so forcing
    changes nothing: the reasoning (free) and the call come out as without the grammar."""
    kwargs: dict[str, Any] = {} if thinking else {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = openai_answer(qwen35_server.openai(), stream, tool_choice=choice, parallel_tool_calls=False, **kwargs)
    [(_, name, arguments)] = answer.calls
    assert name == "get_weather" and json.loads(arguments) == ARGUMENTS
    assert (answer.finish, answer.content) == ("tool_calls", None)
    assert answer.reasoning == (REASONING if thinking else None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_json_schema_output_follows_the_reasoning(qwen35_server: Served, thinking: bool, stream: bool) -> None:
    """With thinking on, the model reasons freely and the JSON comes after </think>: the trained
    reasoning is intact, the content (where the model would call the tool) is the schema's JSON."""
    kwargs: dict[str, Any] = {} if thinking else {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    client = qwen35_server.openai()
    answer = openai_answer(client, stream, response_format=response_format, tool_choice="none", **kwargs)
    assert answer.finish == "stop" and not answer.calls
    assert answer.content is not None and set(json.loads(answer.content)) == {"city", "days"}
    jsonschema.validate(json.loads(answer.content), FORECAST)
    assert answer.reasoning == (REASONING if thinking else None)


def test_with_tools_offered_a_json_schema_answer_may_be_a_call_instead(qwen35_server: Served) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    answer = openai_answer(qwen35_server.openai(), False, response_format=response_format)  # tool_choice auto
    [(_, name, arguments)] = answer.calls  # what the model was trained to answer
    assert name == "get_weather" and json.loads(arguments) == ARGUMENTS and answer.reasoning == REASONING


@pytest.mark.parametrize("think", [True, False], ids=["think", "no-think"])
def test_ollama_format_with_think(qwen35_server: Served, think: bool) -> None:
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    out = qwen35_server.ollama().chat(model=MODEL, messages=MESSAGES, think=think, format=FORECAST, options=options)
    assert out.done_reason == "stop" and (out.message.thinking or "") == (REASONING if think else "")
    jsonschema.validate(json.loads(out.message.content or ""), FORECAST)


# -- inputs a text model cannot take -----------------------------------------------------------

IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
PARTS = {
    "image_url": {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}},
    "video_url": {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},  # vLLM's
    "input_audio": {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
}


def still_serves(server: Served) -> None:
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1


@pytest.mark.parametrize("kind", PARTS)
def test_openai_media_parts_are_a_400_naming_them(qwen35_server: Served, kind: str) -> None:
    content = [{"type": "text", "text": "What is in this?"}, PARTS[kind]]
    with pytest.raises(openai.BadRequestError) as refused:
        qwen35_server.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            max_tokens=2,
        )
    assert refused.value.status_code == 400
    assert "messages[0].content[1].type" in refused.value.message and repr(kind) in refused.value.message
    still_serves(qwen35_server)


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_ollama_images_are_a_400_naming_them(qwen35_server: Served, endpoint: str) -> None:
    client = qwen35_server.ollama()
    with pytest.raises(ollama.ResponseError) as refused:
        if endpoint == "chat":
            client.chat(model=MODEL, messages=[{"role": "user", "content": "What is this?", "images": [IMAGE]}])
        else:
            client.generate(model=MODEL, prompt="What is this?", images=[IMAGE])
    assert refused.value.status_code == 400
    assert ("messages[0].images" if endpoint == "chat" else "images") in refused.value.error
    still_serves(qwen35_server)


# -- commands ----------------------------------------------------------------------------------


def test_generate_continues_the_text_as_transformers_does(
    weather_model: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path, hf = weather_model
    # its generation_config.json sets no sampling: like the server, generate would sample at temperature 1
    assert cli.main(["generate", "hello", "--model", str(path), "--max-tokens", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    tokenizer = Tokenizer.from_dir(path)
    prompt = tokenizer.encode("hello")
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    new = ids[0, len(prompt) :].tolist()
    ended = next((i for i, t in enumerate(new) if t in tokenizer.eos_token_ids), len(new))
    assert out == tokenizer.decode(new[:ended])
    assert f"{len(prompt)} prompt tokens, {ended} generated" in err


def test_run_answers_one_message_with_the_models_template(
    weather_model: tuple[Path, Any], hf_tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "hello", "--model", str(weather_model[0]), "--max-tokens", "4", "--temperature", "0"]
    assert cli.main(argv) == 0
    _, err = capsys.readouterr()
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    [prompt] = re.findall(r"\[prompt (\d+) tokens", err)
    assert int(prompt) == len(hf_tokenizer.encode(text, add_special_tokens=False))


def test_serve_command_answers_with_the_tool_call(weather_model: tuple[Path, Any]) -> None:
    path = weather_model[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--model", str(path), "--port", str(port)]
    command += ["--max-model-len", "2048", "--max-num-seqs", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [path.name]
        answer = openai_answer(
            client, False, path.name, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        [(_, name, arguments)] = answer.calls
        assert name == "get_weather" and json.loads(arguments) == ARGUMENTS
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr


def test_ollama_show_reports_tools_thinking_and_the_nested_text_config(qwen35_server: Served) -> None:
    shown = qwen35_server.ollama().show(MODEL)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities or [])
    info = shown.modelinfo or {}
    assert (info["qwen3_5.embedding_length"], info["qwen3_5.block_count"]) == (64, 4)  # from text_config
