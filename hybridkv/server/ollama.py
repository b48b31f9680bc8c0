"""Ollama-compatible routes: `POST /api/generate`, `POST /api/chat` (NDJSON streaming by default),
`GET /api/tags`, `POST /api/show`, `GET /api/ps`, `GET /api/version`.

Options: num_predict, temperature, top_k, top_p, min_p, seed, stop, repeat_penalty,
presence_penalty, frequency_penalty and num_ctx act as in Ollama; options about how the model
is loaded or run (num_gpu, num_thread, use_mmap, ...) change no output and are accepted; the
sampling options hybridkv does not implement (mirostat, tfs_z, typical_p, repeat_last_n other
than -1 with a repeat_penalty) are a 400 naming the option unless set to their no-op value.
num_ctx above the server's context is capped to it, as Ollama caps it to the model's.

`context` round-trips: a generate answer carries prompt + output token ids, and a request
carrying them continues from there; the prefix cache makes that continuation compute only the
new prompt. Durations are nanoseconds; `prompt_eval_count` is the whole prompt (cached tokens
included, as OpenAI's prompt_tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import hybridkv
from hybridkv.engine.request import Request as EngineRequest
from hybridkv.engine.sampling import MAX_LOGPROBS, SamplingParams
from hybridkv.server.auth import api_key
from hybridkv.server.fields import Fields, bad
from hybridkv.server.generation import EventStream, Generation
from hybridkv.server.parsing import Content, OutputParser, Piece, Reasoning, ToolCall, merge
from hybridkv.server.structured import ollama_constraint
from hybridkv.server.tool_calls import tool_schemas

NEVER_EXPIRES = "2318-11-26T00:00:00Z"  # what Ollama reports for a model kept loaded forever
# How the model is loaded or run: no effect on what it outputs.
LOAD_OPTIONS = frozenset(
    {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "use_mmap", "use_mlock", "num_thread"}
    | {"num_keep", "vocab_only", "logits_all", "embedding_only"}
)
_RENAMED = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}


def routes() -> list[Route]:
    return [
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/version", version, methods=["GET"]),
    ]


def _state(request: Request) -> Any:
    return request.app.state.server


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# -- options -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    sampling: dict[str, Any]
    num_predict: int | None
    num_ctx: int | None
    logprobs: int | None

    def params(self, prompt_len: int, max_model_len: int, prompt_field: str) -> SamplingParams:
        """Sampling parameters for a prompt of `prompt_len` tokens: num_predict -1 / -2 / unset
        run to the end of the (num_ctx-capped) context, a larger one is clamped to it (as Ollama
        does). A prompt that fills the context is a 400 naming num_ctx when num_ctx set the
        limit, else `prompt_field` (the prompt or the messages)."""
        context = min(self.num_ctx or max_model_len, max_model_len)
        if prompt_len >= context:
            limited = self.num_ctx is not None and self.num_ctx < max_model_len
            where = f"a {context}-token context (num_ctx)" if limited else f"this model's {context}-token context"
            raise bad("options.num_ctx" if limited else prompt_field, f"{prompt_len} tokens leave no room in {where}")
        room = context - prompt_len
        max_tokens = room if self.num_predict is None or self.num_predict < 0 else min(self.num_predict, room)
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self.sampling)
        except ValueError as e:  # "repetition_penalty must be in (0.0, inf), got 0"
            name, _, rest = str(e).partition(" ")
            raise bad(f"options.{_RENAMED.get(name, name)}", rest) from None


def _options(body: Fields) -> Options:
    logprobs = None
    if body.boolean("logprobs"):
        logprobs = body.integer("top_logprobs", low=0, high=MAX_LOGPROBS) or 0
    else:
        body.refuse("top_logprobs", "needs logprobs: true", allowed=(0,))
    options = body.mapping("options") or Fields({}, "options")
    num_predict = options.integer("num_predict")
    if num_predict is not None and (num_predict == 0 or num_predict < -2):
        raise bad("options.num_predict", f"must be >= 1, or -1 / -2 for the whole context, got {num_predict}")
    num_ctx = options.integer("num_ctx", low=1)
    seed = options.integer("seed")
    sampling: dict[str, Any] = {
        "temperature": options.number("temperature"),
        "top_k": options.integer("top_k"),
        "top_p": options.number("top_p"),
        "min_p": options.number("min_p"),
        "seed": None if seed is None or seed < 0 else seed,  # Ollama: a negative seed means random
        "stop": options.stop("stop"),
        "repetition_penalty": options.number("repeat_penalty"),
        "presence_penalty": options.number("presence_penalty") or 0.0,
        "frequency_penalty": options.number("frequency_penalty") or 0.0,
    }
    options.refuse("mirostat", "is not supported", allowed=(0,))
    for name in ("mirostat_tau", "mirostat_eta"):
        options.get(name)  # no effect without mirostat
    options.refuse("tfs_z", "is not supported", allowed=(1, 1.0))
    options.refuse("typical_p", "is not supported", allowed=(1, 1.0))
    if sampling["repetition_penalty"] in (None, 1.0):
        for name in ("repeat_last_n", "penalize_newline"):
            options.get(name)  # no effect without a penalty
    else:
        options.refuse("repeat_last_n", "only -1 (the whole context) is supported with repeat_penalty", allowed=(-1,))
        options.refuse("penalize_newline", "false is not supported", allowed=(True,))
    options.finish(LOAD_OPTIONS)
    return Options(sampling, num_predict, num_ctx, logprobs)


def _think(body: Fields) -> bool | None:
    think = body.get("think")
    if think is not None and not isinstance(think, bool):
        raise bad("think", f"only true or false is supported, got {think!r}")
    return think


def _refuse_unsupported(body: Fields) -> None:
    body.refuse("images", "images are not supported by this model", allowed=([],))
    for name in ("width", "height", "steps"):
        body.refuse(name, "image generation is not supported")
    body.get("keep_alive")  # the model stays loaded whatever it says


# -- /api/generate -----------------------------------------------------------------------------


async def generate(request: Request) -> Response:
    started = time.monotonic()
    state = _state(request)
    body = await state.read_json(request)
    state.check_model(body.string("model", required=True))
    prompt = body.string("prompt") or ""
    system = body.string("system")
    raw = bool(body.boolean("raw"))
    context = body.array("context") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise bad("context", "must be a list of token ids")
    stream = body.boolean("stream") is not False
    think = _think(body)
    options = _options(body)
    constraint = ollama_constraint(body.get("format"))
    body.refuse("suffix", "is not supported (no fill-in-the-middle)", allowed=("",))
    body.refuse("template", "custom templates are not supported", allowed=("",))
    if raw and system:
        raise bad("system", "cannot be used with raw: true")
    _refuse_unsupported(body)
    body.finish()
    if not prompt:  # Ollama's "load the model" request
        return JSONResponse(
            {"model": state.model_id, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        )

    if raw or state.llm.template is None:
        ids, hints = list(context) + await state.encode(prompt), [len(context) - 1] if context else []
    else:
        messages = ([{"role": "system", "content": system}] if system and not context else []) + [
            {"role": "user", "content": prompt}
        ]
        new, new_hints = await state.encode_chat(messages, None, **_think_kwargs(think))
        ids = list(context) + new
        hints = ([len(context) - 1] if context else []) + [len(context) + h for h in new_hints]
    thinking = not raw and state.opens_thinking(ids)
    params, grammar = await state.constrained(
        options.params(len(ids), state.max_model_len, "prompt"), constraint, thinking, prefix="options."
    )
    generation = state.submit([(ids, hints, params)], api_key(request))
    parse = {"reasoning": thinking, "tools": False, "think": think is not False and not raw}
    if grammar is not None:
        parse |= constraint.parser_options()
    reply = _Reply(state, generation, started, options.logprobs is not None, parse, chat=False)
    if stream:
        return EventStream(reply.chunks(), generation, "application/x-ndjson")
    await generation.outputs(request)
    return JSONResponse(reply.final())


def _think_kwargs(think: bool | None) -> dict[str, Any]:
    return {} if think is None else {"enable_thinking": think, "think": think}


# -- /api/chat ---------------------------------------------------------------------------------


async def chat(request: Request) -> Response:
    started = time.monotonic()
    state = _state(request)
    body = await state.read_json(request)
    state.check_model(body.string("model", required=True))
    messages = [_message(i, m) for i, m in enumerate(body.array("messages") or [])]
    tools = body.array("tools") or None
    stream = body.boolean("stream") is not False
    think = _think(body)
    options = _options(body)
    constraint = ollama_constraint(body.get("format"))
    _refuse_unsupported(body)
    body.finish()
    if not messages:  # Ollama's "load the model" request
        message = {"role": "assistant", "content": ""}
        return JSONResponse(
            {"model": state.model_id, "created_at": _now(), "message": message, "done": True, "done_reason": "load"}
        )
    ids, hints = await state.encode_chat(messages, tools, **_think_kwargs(think))
    thinking = state.opens_thinking(ids)
    params, grammar = await state.constrained(
        options.params(len(ids), state.max_model_len, "messages"), constraint, thinking, prefix="options."
    )
    generation = state.submit([(ids, hints, params)], api_key(request))
    parse = {
        "reasoning": thinking,
        "tools": tools is not None,
        "think": think is not False,
        "schemas": tool_schemas(tools),
    }
    if grammar is not None:
        parse |= constraint.parser_options()
    reply = _Reply(state, generation, started, options.logprobs is not None, parse, chat=True)
    if stream:
        return EventStream(reply.chunks(), generation, "application/x-ndjson")
    await generation.outputs(request)
    return JSONResponse(reply.final())


def _message(index: int, item: object) -> dict[str, Any]:
    message = Fields(item, f"messages[{index}]")
    role = message.string("role", required=True)
    converted: dict[str, Any] = {"role": role, "content": message.string("content") or ""}
    if thinking := message.string("thinking"):
        converted["reasoning_content"] = thinking
    if tool_name := message.string("tool_name"):
        converted["name"] = tool_name
    calls = message.array("tool_calls")
    if calls:
        converted["tool_calls"] = [_tool_call_in(message.name(f"tool_calls[{j}]"), c) for j, c in enumerate(calls)]
    message.refuse("images", "images are not supported by this model", allowed=([],))
    message.finish()
    return converted


def _tool_call_in(where: str, call: object) -> dict[str, Any]:
    fields = Fields(call, where)
    function = fields.mapping("function")
    if function is None:
        raise bad(f"{where}.function", "is required")
    name = function.string("name", required=True)
    arguments = function.get("arguments")
    if not isinstance(arguments, dict):
        raise bad(function.name("arguments"), "must be an object")
    function.finish({"index"})
    fields.finish({"id", "type"})
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# -- answers -----------------------------------------------------------------------------------


class _Reply:
    """Builds the NDJSON chunks or the single answer of a generate or chat request."""

    def __init__(
        self, state: Any, generation: Generation, started: float, logprobs: bool, parse: dict[str, Any], chat: bool
    ) -> None:
        self.state = state
        self.generation = generation
        self.request: EngineRequest = generation.requests[0]
        self.started = started
        self.logprobs = logprobs
        self.parser = OutputParser(**parse)
        self.chat = chat

    async def chunks(self) -> AsyncIterator[str]:
        async for _, event in self.generation.events():
            if event.done:
                continue
            pieces = self.parser.push(event.text)
            if event.finish_reason:
                pieces += self.parser.finish()
            chunk = self._answer(merge(pieces))
            if self.logprobs:
                chunk["logprobs"] = self._logprobs(event.logprobs)
            if pieces or self.logprobs:
                yield _line(chunk)
        if self.chat:
            self.state.remember([self.request.output()])
        yield _line(self._answer([]) | self._summary())

    def final(self) -> dict[str, Any]:
        completion = self.request.output().outputs[0]
        if self.chat:
            self.state.remember([self.request.output()])
        answer = self._answer(merge([*self.parser.push(completion.text), *self.parser.finish()]))
        if self.logprobs:
            answer["logprobs"] = self._logprobs(completion.logprobs)
        return answer | self._summary()

    def _answer(self, pieces: list[Piece]) -> dict[str, Any]:
        return {"model": self.state.model_id, "created_at": _now(), **answer_fields(pieces, self.chat), "done": False}

    def _summary(self) -> dict[str, Any]:
        r = self.request
        completion = r.output().outputs[0]
        now = time.monotonic()
        first = r.first_token_time or r.finish_time or now
        out: dict[str, Any] = {
            "done": True,
            "done_reason": completion.finish_reason or "stop",
            "total_duration": _ns(now - self.started),
            "load_duration": 0,
            "prompt_eval_count": r.usage.prompt_tokens,
            "prompt_eval_duration": _ns(first - r.arrival),
            "eval_count": r.usage.completion_tokens,
            "eval_duration": _ns((r.finish_time or now) - first),
        }
        if not self.chat:
            out["context"] = [*r.prompt_ids, *completion.token_ids]
        return out

    def _logprobs(self, logprobs: Any) -> list[dict[str, Any]]:
        decode: Callable[[list[int]], str] = self.state.llm.tokenizer.decode

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (top or ())]} for t, lp, top in logprobs]


def answer_fields(pieces: list[Piece], chat: bool) -> dict[str, Any]:
    """The text part of an answer: chat `message` (content, thinking, tool_calls with arguments
    as an object), or generate `response` and `thinking`."""
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    thinking = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    calls = [{"function": {"name": p.name, "arguments": p.arguments}} for p in pieces if isinstance(p, ToolCall)]
    if not chat:
        return {"response": content, **({"thinking": thinking} if thinking else {})}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


def _line(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# -- model information -------------------------------------------------------------------------


def _details(state: Any) -> dict[str, Any]:
    llm = state.llm
    count = _parameter_count(state)
    return {
        "parent_model": "",
        "format": llm.file_format,
        "family": llm.architecture,
        "families": [llm.architecture],
        "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e8 else f"{count / 1e6:.1f}M",
        "quantization_level": llm.quantization,
    }


def _parameter_count(state: Any) -> int:
    return int(state.llm.cm.model.weight_sizes()[0])


def _size(state: Any) -> int:
    return int(state.llm.cm.model.weight_sizes()[1])


def _digest(state: Any) -> str:
    files = [(p.name, p.stat().st_size) for p in state.llm.files]
    return hashlib.sha256(json.dumps([state.model_id, files]).encode()).hexdigest()


def _modified(state: Any) -> str:
    mtime = max(p.stat().st_mtime for p in state.llm.files)
    return datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")


def _listing(state: Any) -> dict[str, Any]:
    return {
        "name": state.model_id,
        "model": state.model_id,
        "modified_at": _modified(state),
        "size": _size(state),
        "digest": _digest(state),
        "details": _details(state),
    }


async def tags(request: Request) -> Response:
    return JSONResponse({"models": [_listing(_state(request))]})


async def ps(request: Request) -> Response:
    state = _state(request)
    entry = _listing(state)
    del entry["modified_at"]
    entry |= {"expires_at": NEVER_EXPIRES, "size_vram": 0, "context_length": state.max_model_len}
    return JSONResponse({"models": [entry]})


async def show(request: Request) -> Response:
    state = _state(request)
    body = await state.read_json(request)
    state.check_model(body.string("model") or body.string("name"))
    body.boolean("verbose")
    body.finish()
    arch = state.llm.architecture
    decoder = state.llm.cm.config  # parsed: also where a vision-language config nests it
    info = {
        "general.architecture": arch,
        "general.parameter_count": _parameter_count(state),
        f"{arch}.context_length": state.max_model_len,
        f"{arch}.embedding_length": decoder.hidden_size,
        f"{arch}.block_count": decoder.num_hidden_layers,
    }
    template = state.llm.template
    source = template.templates.get("default", "") if template is not None else ""
    capabilities = (
        ["completion"] + (["tools"] if "tools" in source else []) + (["thinking"] if "<think>" in source else [])
    )
    return JSONResponse(
        {
            "license": "",
            "modelfile": f"# served by hybridkv from {state.llm.model_dir}\nFROM {state.llm.model_dir}\n",
            "parameters": "",
            "template": source,
            "details": _details(state),
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": _modified(state),
        }
    )


async def version(request: Request) -> Response:
    return JSONResponse({"version": hybridkv.__version__})
