"""Splitting a chat answer into content, reasoning (`<think>…</think>`) and tool calls
(`<tool_call>…</tool_call>`, JSON or XML body: see `tool_calls`), as it streams.

    text ──push──> OutputParser ──> [Content("…"), Reasoning("…"), ToolCall(name, arguments), …]

Text that might be the start of a tag is held back until the next piece tells; whitespace
between a tag and its neighbours is dropped (the template puts newlines there), all other text
comes out exactly as generated. A tool call comes out whole once its `</tool_call>` arrives, so a
streamed answer splits exactly as the finished one. A `<tool_call>` block whose body is neither
form stays in the content, unchanged, as vLLM and Ollama leave it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridkv.server.tool_calls import ToolSchemas, parse_call

THINK, END_THINK = "<think>", "</think>"
TOOL, END_TOOL = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


Piece = Content | Reasoning | ToolCall


class OutputParser:
    """`push(text)` returns the pieces that are certain so far; `finish()` the rest.

    `reasoning=True` starts inside a think block (the prompt ended with `<think>`, as Qwen3
    thinking templates do). `tools=False` leaves `<tool_call>` text in the content. `schemas`
    (function name -> parameters schema, from `tool_calls.tool_schemas`) types XML arguments.
    """

    def __init__(
        self, reasoning: bool = False, tools: bool = True, think: bool = True, schemas: ToolSchemas | None = None
    ) -> None:
        self.state = "reasoning" if reasoning else "content"
        self.tools = tools
        self.schemas = schemas
        self.think = think
        self.buffer = ""
        self.held_space = ""  # whitespace withheld until we know whether a tag follows it
        self.after_tag = reasoning  # drop whitespace right after a tag
        self.tool_calls = 0

    def push(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while True:
            tag, at = self._next_tag()
            if at < 0:
                break
            before, self.buffer = self.buffer[:at], self.buffer[at + len(tag) :]
            if self.state == "tool":
                pieces.append(self._tool_call(before))
                self.state = "content"
            else:
                self._emit(before, pieces)
                self.held_space = ""  # whitespace before a tag is layout
                self.state = {THINK: "reasoning", END_THINK: "content", TOOL: "tool"}[tag]
            self.after_tag = True
        if self.state != "tool":  # a tool call's body waits in the buffer for its end tag
            keep = len(self.buffer) - self._partial_tag()
            self._emit(self.buffer[:keep], pieces)
            self.buffer = self.buffer[keep:]
        return pieces

    def finish(self) -> list[Piece]:
        """The end of the output: an unclosed think block is reasoning, an unclosed tool call is content."""
        pieces: list[Piece] = []
        if self.state == "tool":
            pieces.append(Content(TOOL + self.buffer))
        else:
            self._emit(self.buffer, pieces)
            if self.held_space:
                pieces.append(self._piece(self.held_space))
        self.buffer = self.held_space = ""
        return pieces

    # -- internals ----------------------------------------------------------------------------

    def _tags(self) -> tuple[str, ...]:
        if self.state == "tool":
            return (END_TOOL,)
        if self.state == "reasoning":
            return (END_THINK,)
        return ((THINK,) if self.think else ()) + ((TOOL,) if self.tools else ())

    def _next_tag(self) -> tuple[str, int]:
        found = [(at, tag) for tag in self._tags() if (at := self.buffer.find(tag)) >= 0]
        if not found:
            return "", -1
        at, tag = min(found)
        return tag, at

    def _partial_tag(self) -> int:
        """How many trailing characters of the buffer could begin a tag."""
        best = 0
        for tag in self._tags():
            for n in range(min(len(tag) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(tag[:n]):
                    best = n
                    break
        return best

    def _emit(self, text: str, pieces: list[Piece]) -> None:
        """Text of the current state. Whitespace right after a tag is dropped; trailing whitespace
        is held until more text shows it is not just layout before the next tag."""
        if self.after_tag:
            text = text.lstrip()
            if not text:
                return
            self.after_tag = False
        body = text.rstrip()
        if body:
            pieces.append(self._piece(self.held_space + body))
            self.held_space = ""
        self.held_space += text[len(body) :]

    def _piece(self, text: str) -> Piece:
        return Reasoning(text) if self.state == "reasoning" else Content(text)

    def _tool_call(self, body: str) -> Piece:
        call = parse_tool_call(body, self.schemas)
        if call is None:
            return Content(f"{TOOL}{body}{END_TOOL}")
        self.tool_calls += 1
        return call


def parse_tool_call(body: str, schemas: ToolSchemas | None = None) -> ToolCall | None:
    """The call in the body of a `<tool_call>` block, JSON or XML; None when it is neither."""
    call = parse_call(body, schemas)
    return None if call is None else ToolCall(*call)


def split_output(
    text: str, reasoning: bool = False, tools: bool = True, think: bool = True, schemas: ToolSchemas | None = None
) -> list[Piece]:
    """All pieces of a finished output, merged: what a non-streaming answer reports."""
    parser = OutputParser(reasoning, tools, think, schemas)
    return merge([*parser.push(text), *parser.finish()])


def merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of the same text kind joined."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + piece.text)
        elif isinstance(piece, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + piece.text)
        else:
            out.append(piece)
    return out
