"""A GGUF model behind both APIs: its tokenizer and chat template come from the file, and the
model listings say what the file is (format gguf, its quantization, its architecture)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from served import MODEL, Served, make_llm, start, stop

FIXTURE = Path(__file__).parent.parent / "data" / "gguf" / "qwen35-tiny-q8_0.gguf"


@pytest.fixture(scope="module")
def served_gguf() -> Iterator[Served]:
    served, thread = start(make_llm(FIXTURE, max_num_seqs=2))
    yield served
    stop(served, thread)


def test_listings_describe_the_gguf_file(served_gguf: Served) -> None:
    client = served_gguf.ollama()
    [listed] = client.list().models
    assert listed.details is not None
    details = listed.details
    assert (details.format, details.quantization_level, details.family) == ("gguf", "Q8_0", "qwen35")
    assert listed.size is not None and listed.size > 0
    shown = client.show(MODEL)
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "qwen35"
    assert "thinking" in (shown.capabilities or []) and "tools" in (shown.capabilities or [])


def test_chat_uses_the_files_template_and_tokenizer(served_gguf: Served) -> None:
    llm = served_gguf.llm
    messages = [{"role": "user", "content": "hello there"}]
    out = served_gguf.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    prompt, _ = llm.encode_chat(messages)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    # Qwen3.5's template, from the file
    assert llm.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")


def test_structured_output_with_the_files_tokenizer(served_gguf: Served) -> None:
    """The grammar engine reads the tokenizer built from the file's metadata."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = served_gguf.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "ok?"}],
        max_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    [choice] = out.choices
    assert choice.finish_reason == "stop" and json.loads(choice.message.content or "") in ({"ok": True}, {"ok": False})
