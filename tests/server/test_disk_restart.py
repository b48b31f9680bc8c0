"""A conversation outlives its server: after a restart on the same cache directory, the next turn
computes only its new tokens (through the official openai and ollama clients), and answers as a
server that never restarted does: the answers' token ids are kept too, since a client sends an
answer back as text and text need not encode back to the ids generated. /metrics counts the
disk's share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from served import MAX_MODEL_LEN, MODEL, Served, start, stop

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM


def make_llm(model_dir: Path, cache_dir: Path | None) -> LLM:
    cache = CacheConfig(max_sequences=5, max_model_len=MAX_MODEL_LEN, snapshots_per_sequence=16)
    disk: dict[str, Any] = {"cache_dir": cache_dir} if cache_dir else {"cache_disk": 0}
    return LLM(model_dir, cache=cache, engine=EngineConfig(max_num_seqs=2), **disk)


def turn(served: Served, messages: list[dict[str, str]]) -> tuple[str, int, int, int]:
    """(answer, prompt tokens, cached tokens, completion tokens) of one OpenAI chat turn."""
    client = served.openai()
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    usage = out.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return out.choices[0].message.content or "", usage.prompt_tokens, cached, usage.completion_tokens


def test_a_conversation_continues_after_a_restart(model_dir: Path, tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "You remember everything, even across restarts of your server."},
        {"role": "user", "content": "Turn one: what is the first thing?"},
    ]
    served, thread = start(make_llm(model_dir, tmp_path))
    try:
        first, *_ = turn(served, messages)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Turn two: and next?"}]
        second, second_prompt, cached, second_completion = turn(served, messages)
        held = second_prompt + second_completion - 1  # what the server keeps of turn two: all it fed
        assert cached > 0
    finally:
        stop(served, thread)  # writes what is queued to disk before it ends

    messages += [{"role": "assistant", "content": second}, {"role": "user", "content": "Turn three, after a restart."}]
    restarted, thread = start(make_llm(model_dir, tmp_path))
    try:
        third, third_prompt, third_cached, _ = turn(restarted, messages)
        metrics = restarted.metrics()
        ollama_answer = restarted.ollama().chat(
            model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 8}
        )
    finally:
        stop(restarted, thread)
    # A fresh server without a disk tier, never restarted, holding the conversation in RAM.
    fresh, thread = start(make_llm(model_dir, None))
    try:
        assert turn(fresh, messages[:2])[0] == first and turn(fresh, messages[:4])[0] == second
        want, want_prompt, want_cached, _ = turn(fresh, messages)
    finally:
        stop(fresh, thread)
    assert (third, third_prompt) == (want, want_prompt)
    # only the new tokens: the last answer's last token, its end, the new message, the header
    assert third_cached == want_cached == held
    assert metrics['hybridkv_prompt_tokens_total{source="disk"}'] == held
    assert metrics["hybridkv_disk_bytes_used"] > 0
    assert ollama_answer.message.content == want
