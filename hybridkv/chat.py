"""`hybridkv run`: one streamed answer, or an interactive chat that reuses the cache every turn."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams

HELP = "commands: /reset (new conversation), /regenerate (answer the last message again), /stats, /quit"


def run_chat(args: argparse.Namespace, llm: LLM) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    opening: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
        answer(llm, messages, params)
        return 0
    print(f"hybridkv chat with {llm.model_dir} — {HELP}; Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        command = line.strip()
        if command in ("/quit", "/exit"):
            return 0
        if command == "/reset":
            messages = list(opening)
            print("(new conversation)", file=sys.stderr)
        elif command == "/stats":
            print(_stats(llm), file=sys.stderr)
        elif command == "/regenerate":
            if not messages or messages[-1]["role"] != "assistant":
                print("(nothing to regenerate yet)", file=sys.stderr)
                continue
            messages.pop()
            messages.append({"role": "assistant", "content": answer(llm, messages, params)})
        elif command.startswith("/"):
            print(f"(unknown command {command}; {HELP})", file=sys.stderr)
        elif command:
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": answer(llm, messages, params)})


def answer(llm: LLM, messages: list[dict[str, Any]], params: SamplingParams) -> str:
    """Stream the reply to `messages` to stdout; Ctrl-C stops it and keeps what was said."""
    if llm.template is not None:
        ids, hints = llm.encode_chat(messages)
    else:  # no chat template: continue the text of the conversation as it is
        ids, hints = llm.encode("\n".join(m["content"] for m in messages)), []
    request = llm.engine.add_request(llm.engine.make_request(ids, params, tuple(hints)))
    started = time.perf_counter()
    try:
        while not request.finished:
            llm.engine.step()
            _print_events(request)
    except KeyboardInterrupt:
        llm.engine.cancel(request.request_id)
        llm.engine.run_until_done()
    _print_events(request)
    elapsed = time.perf_counter() - started
    output = request.output()
    llm.remember(output)
    u = output.usage
    speed = u.completion_tokens / elapsed if elapsed > 0 else 0.0
    print(
        f"\n[prompt {u.prompt_tokens} tokens: {u.cached_tokens} reused, {u.computed_tokens} computed; "
        f"{u.completion_tokens} generated in {elapsed:.2f}s, {speed:.1f} tokens/s; "
        f"{output.outputs[0].finish_reason}]",
        file=sys.stderr,
        flush=True,
    )
    return output.text


def _print_events(request: Any) -> None:
    while not request.events.empty():
        text = request.events.get().text
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()


def _stats(llm: LLM) -> str:
    m = llm.engine.metrics()
    return (
        f"requests finished {m.get('requests_finished', 0)}, prompt tokens computed "
        f"{m.get('prompt_tokens_computed', 0)}, reused {m.get('prompt_tokens_cached', 0)}, generated "
        f"{m.get('tokens_generated', 0)}; cached conversations {m['cached_sequences']}; KV "
        f"{m['kv_bytes_used'] / 2**20:.1f}/{m['kv_bytes_total'] / 2**20:.1f} MiB, snapshots "
        f"{m['snapshot_bytes_used'] / 2**20:.1f}/{m['snapshot_bytes_total'] / 2**20:.1f} MiB"
    )
