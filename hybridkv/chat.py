"""`hybridkv run`: one streamed answer, or an interactive chat that reuses the cache every turn.

A thinking model's reasoning (`<think>…</think>`, split off as the server splits it) is shown
apart from the answer: dimmed on a terminal, else between "Thinking..." and "...done thinking."
lines; `--hide-thinking` leaves it out. `--think/--no-think` and `/think on|off` set the
template's `enable_thinking`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any, Literal

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams
from hybridkv.server.parsing import Content, OutputParser, Piece, Reasoning

HELP = (
    "commands: /reset (new conversation), /regenerate (answer the last message again), "
    "/think on|off (let the model reason first, if its template can), /stats, /quit"
)
DIM, RESET = "\033[2m", "\033[0m"
Thinking = Literal["dim", "plain", "hide"]


def run_chat(args: argparse.Namespace, llm: LLM) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    opening: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    thinking: Thinking = "hide" if args.hide_thinking else "dim" if sys.stdout.isatty() else "plain"
    template_kwargs: dict[str, Any] = {} if args.think is None else {"enable_thinking": args.think}
    if args.think is not None and not _has_thinking_switch(llm):
        print("hybridkv: note: this model's chat template has no enable_thinking switch", file=sys.stderr)
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
        answer(llm, messages, params, thinking, **template_kwargs)
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
        elif command.split()[:1] == ["/think"]:
            choice = command.split()[1:]
            if choice not in (["on"], ["off"]):
                print("(usage: /think on|off)", file=sys.stderr)
                continue
            template_kwargs["enable_thinking"] = choice == ["on"]
            note = "" if _has_thinking_switch(llm) else "; this model's chat template has no such switch"
            print(f"(thinking {choice[0]} from the next answer{note})", file=sys.stderr)
        elif command == "/regenerate":
            if not messages or messages[-1]["role"] != "assistant":
                print("(nothing to regenerate yet)", file=sys.stderr)
                continue
            messages.pop()
            messages.append(
                {"role": "assistant", "content": answer(llm, messages, params, thinking, **template_kwargs)}
            )
        elif command.startswith("/"):
            print(f"(unknown command {command}; {HELP})", file=sys.stderr)
        elif command:
            messages.append({"role": "user", "content": line})
            messages.append(
                {"role": "assistant", "content": answer(llm, messages, params, thinking, **template_kwargs)}
            )


def answer(
    llm: LLM,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    thinking: Thinking = "plain",
    **template_kwargs: Any,
) -> str:
    """Stream the reply to `messages` to stdout, reasoning shown as `thinking` says ("dim",
    "plain" or "hide"); Ctrl-C stops it and keeps what was said. Returns the whole generated
    text, reasoning included (the template drops it from history as the model expects)."""
    if llm.template is not None:
        ids, hints = llm.encode_chat(messages, **template_kwargs)
    else:  # no chat template: continue the text of the conversation as it is
        ids, hints = llm.encode("\n".join(m["content"] for m in messages)), []
    request = llm.engine.add_request(llm.engine.make_request(ids, params, tuple(hints)))
    printer = AnswerPrinter(_opens_thinking(llm, ids), thinking)
    started = time.perf_counter()
    with CtrlC() as ctrl_c:
        try:
            while not request.finished and not ctrl_c.pressed:
                llm.engine.step()
                _print_events(request, printer)
        except KeyboardInterrupt:  # pressed twice: the step was cut short, its forward is not kept
            pass
        if not request.finished:  # what was computed stays in the cache for the next turn
            llm.engine.cancel(request.request_id)
            llm.engine.run_until_done()
    _print_events(request, printer)
    printer.finish()
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


class CtrlC:
    """Ctrl-C while answering: the first press sets `pressed` and the answer stops after the
    current engine step, so its forward completes and the cache keeps it for the next turn; a
    second press raises KeyboardInterrupt at once. Off the main thread signals stay as they are."""

    def __init__(self) -> None:
        self.pressed = 0
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is threading.main_thread():
            previous = self._previous if self._previous is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.pressed += 1
        if self.pressed > 1:
            raise KeyboardInterrupt


class AnswerPrinter:
    """Writes a streamed answer to stdout with its reasoning set apart: `thinking` "dim" (ANSI
    dim, for a terminal), "plain" (between "Thinking..." and "...done thinking." lines) or "hide".
    `reasoning` says the answer starts inside a think block (the prompt ended with `<think>`)."""

    MARKS = {"dim": (DIM, RESET + "\n\n"), "plain": ("Thinking...\n", "\n...done thinking.\n\n")}

    def __init__(self, reasoning: bool, thinking: Thinking = "plain") -> None:
        if thinking not in ("dim", "plain", "hide"):
            raise ValueError(f"thinking must be 'dim', 'plain' or 'hide', got {thinking!r}")
        self.parser = OutputParser(reasoning=reasoning, tools=False)
        self.thinking = thinking
        self.in_reasoning = False

    def push(self, text: str) -> None:
        self._write(self.parser.push(text))

    def finish(self) -> None:
        self._write(self.parser.finish())
        self._end_reasoning()

    def _write(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            if isinstance(piece, Content):
                self._end_reasoning()
                self._out(piece.text)
            elif isinstance(piece, Reasoning) and self.thinking != "hide":
                if not self.in_reasoning:
                    self._out(self.MARKS[self.thinking][0])
                    self.in_reasoning = True
                self._out(piece.text)
            # (no tool calls: the parser leaves <tool_call> text in the content)

    def _end_reasoning(self) -> None:
        if self.in_reasoning:
            self._out(self.MARKS[self.thinking][1])
            self.in_reasoning = False

    @staticmethod
    def _out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _print_events(request: Any, printer: AnswerPrinter) -> None:
    while not request.events.empty():
        text = request.events.get().text
        if text:
            printer.push(text)


def _opens_thinking(llm: LLM, prompt_ids: list[int]) -> bool:
    """Does the prompt end inside a think block (a thinking template's generation prompt)?"""
    return llm.tokenizer.decode(prompt_ids[-8:]).rstrip().endswith("<think>")


def _has_thinking_switch(llm: LLM) -> bool:
    return llm.template is not None and any("enable_thinking" in t for t in llm.template.templates.values())


def _stats(llm: LLM) -> str:
    m = llm.engine.metrics()
    return (
        f"requests finished {m.get('requests_finished', 0)}, prompt tokens computed "
        f"{m.get('prompt_tokens_computed', 0)}, reused {m.get('prompt_tokens_cached', 0)}, generated "
        f"{m.get('tokens_generated', 0)}; cached conversations {m['cached_sequences']}; KV "
        f"{m['kv_bytes_used'] / 2**20:.1f}/{m['kv_bytes_total'] / 2**20:.1f} MiB, snapshots "
        f"{m['snapshot_bytes_used'] / 2**20:.1f}/{m['snapshot_bytes_total'] / 2**20:.1f} MiB"
    )
