"""A client that disconnects mid-stream, or a server that shuts down under it, leaves what its
request computed in the prefix cache: the same request again computes only its last token."""

from __future__ import annotations

import itertools
from pathlib import Path

from served import MODEL, Served, make_llm, start, stop


def long_request(question: str) -> dict[str, object]:
    messages = [{"role": "user", "content": f"{question} " + "Explain every step in detail. " * 20}]
    # no max_tokens: a chat answer runs to the end of the context (a larger max_tokens is a 400)
    return {"model": MODEL, "messages": messages, "temperature": 0, "ignore_eos": True}


def stream_a_few_chunks(served: Served, request: dict[str, object]) -> None:
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json=request | {"stream": True}) as r:
        assert r.status_code == 200
        chunks = [line for line in itertools.islice(r.iter_lines(), 8) if line.startswith("data: ")]
        assert len(chunks) == 4  # the role, then three pieces of text
        r.close()  # the client goes away mid-stream


def test_the_same_request_after_a_disconnect_reuses_the_prompt(served: Served) -> None:
    served.wait_idle()
    request = long_request("Why is the sky blue?")
    stream_a_few_chunks(served, request)
    served.wait_idle(timeout=5.0)
    with served.http() as http:
        usage = http.post("/v1/chat/completions", json=request | {"max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] > 100
    # everything but the prompt's last token, which is computed again for its logits
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    served.wait_idle()
    served.llm.cm.cache.check_integrity()


def test_a_request_cancelled_by_shutdown_is_kept_in_the_cache(model_dir: Path) -> None:
    served, thread = start(make_llm(model_dir), grace=0.0)
    request = long_request("Why is the sea salty?")
    try:
        with served.http() as http, http.stream("POST", "/v1/chat/completions", json=request | {"stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            stop(served, thread)
            last = [line for line in lines if line.startswith("data: {")][-1]
            assert '"finish_reason":"abort"' in last.replace(" ", "")
    finally:
        if thread.is_alive():
            stop(served, thread)
    llm = served.llm
    llm.cm.cache.check_integrity()
    prompt, _ = llm.encode_chat(request["messages"])  # type: ignore[arg-type]
    (entry,) = llm.engine.index._tokens.values()
    # the prompt, and the answer tokens fed before the cancel (none if it came right after the first)
    assert entry[: len(prompt)] == prompt
