"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.

Supported request fields are read and checked one by one; fields that would change the answer
and are not implemented (logit_bias, response_format other than text, tool_choice other than
auto/none, echo, suffix, best_of > n, audio, ...) are a 400 naming the field, and so is any
field this module does not know. Fields that change nothing here (user, metadata, store=false,
service_tier, ...) are accepted. vLLM's extensions top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids and chat_template_kwargs are accepted too.

Unset max_tokens means "up to the end of the context" for chat (as vLLM does) and 16 for
completions (as OpenAI does). Usage reports `prompt_tokens_details.cached_tokens`: the prompt
tokens taken from the prefix cache instead of being computed.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridkv.engine.request import Completion, Usage
from hybridkv.engine.sampling import MAX_LOGPROBS, SamplingParams
from hybridkv.server.auth import api_key
from hybridkv.server.fields import Fields, bad
from hybridkv.server.generation import EventStream, Generation
from hybridkv.server.parsing import Content, OutputParser, Piece, Reasoning, ToolCall, merge
from hybridkv.server.tool_calls import tool_schemas

HARMLESS = frozenset({"user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"})
MAX_PROMPTS = 64
_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def _state(request: Request) -> Any:
    return request.app.state.server


def _model_card(state: Any) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "hybridkv"}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    state.check_model(request.path_params["model"])
    return JSONResponse(_model_card(state))


# -- shared request fields ---------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    params: SamplingParams
    max_tokens: int | None  # None: the default of the endpoint
    stream: bool
    include_usage: bool
    logprobs: bool


def _options(body: Fields, chat: bool) -> Options:
    """The sampling fields both endpoints share, checked."""
    stream = bool(body.boolean("stream"))
    include_usage = False
    stream_options = body.mapping("stream_options")
    if stream_options is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with stream: true")
        include_usage = bool(stream_options.boolean("include_usage"))
        stream_options.boolean("include_obfuscation")  # padding against side channels: none needed here
        stream_options.finish()
    if chat:
        max_tokens = body.integer("max_completion_tokens", low=1)
        legacy = body.integer("max_tokens", low=1)
        if max_tokens is not None and legacy is not None and max_tokens != legacy:
            raise bad("max_tokens", "give max_completion_tokens or max_tokens, not both")
        max_tokens = max_tokens if max_tokens is not None else legacy
        logprobs = bool(body.boolean("logprobs"))
        top = body.integer("top_logprobs", low=0, high=MAX_LOGPROBS)
        if top is not None and not logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        top_logprobs = (top or 0) if logprobs else None
    else:
        max_tokens = body.integer("max_tokens", low=1)
        top_logprobs = body.integer("logprobs", low=0, high=MAX_LOGPROBS)
        logprobs = top_logprobs is not None
    n = body.integer("n", low=1)
    best_of = body.integer("best_of", low=1) if not chat else None
    if best_of is not None and best_of != (n or 1):
        raise bad("best_of", "only best_of = n is supported (no ranking of extra samples)")
    body.refuse("logit_bias", "is not supported", allowed=({},))
    try:
        params = SamplingParams(
            max_tokens=max_tokens or 16,
            temperature=body.number("temperature"),
            top_p=body.number("top_p"),
            top_k=_top_k(body.integer("top_k")),
            min_p=body.number("min_p"),
            repetition_penalty=body.number("repetition_penalty"),
            presence_penalty=body.number("presence_penalty") or 0.0,
            frequency_penalty=body.number("frequency_penalty") or 0.0,
            seed=body.integer("seed"),
            stop=body.stop("stop"),
            stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
            ignore_eos=bool(body.boolean("ignore_eos")),
            logprobs=top_logprobs,
            n=n or 1,
        )
    except ValueError as e:  # "top_p must be in (0.0, 1.0], got 0"
        field, _, rest = str(e).partition(" ")
        raise bad(field, rest) from None
    return Options(params, max_tokens, stream, include_usage, logprobs)


def _top_k(value: int | None) -> int | None:
    return 0 if value == -1 else value  # vLLM: -1 means off


def _int_list(body: Fields, key: str) -> list[int]:
    items = body.array(key) or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise bad(key, "must be a list of integers")
    return items


def _usage(usages: Sequence[Usage]) -> dict[str, Any]:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)},
    }


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _token_text(state: Any, token_id: int) -> str:
    return str(state.llm.tokenizer.decode([token_id]))


# -- /v1/completions ---------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    state = _state(request)
    body = await state.read_json(request)
    state.check_model(body.string("model", required=True))
    prompts = _prompts(body.get("prompt"))
    options = _options(body, chat=False)
    body.refuse("echo", "is not supported", allowed=(False,))
    body.refuse("suffix", "is not supported (no fill-in-the-middle)", allowed=("",))
    body.finish(HARMLESS)
    encoded = [p if isinstance(p, list) else await state.encode(p) for p in prompts]
    generation = state.submit([(ids, (), options.params) for ids in encoded], api_key(request))
    reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
    reply["model"] = state.model_id
    if options.stream:
        return EventStream(_completion_chunks(state, generation, options, reply), generation, "text/event-stream")
    outputs = await generation.outputs(request)
    n = options.params.n
    choices = [
        {
            "index": p * n + c.index,
            "text": c.text,
            "logprobs": _completion_logprobs(state, c.logprobs) if options.logprobs else None,
            "finish_reason": _FINISH.get(c.finish_reason or "stop"),
        }
        for p, output in enumerate(outputs)
        for c in output.outputs
    ]
    return JSONResponse({**reply, "choices": choices, "usage": _usage([o.usage for o in outputs])})


def _prompts(value: object) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [value]
        if all(isinstance(p, str) for p in value) or all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value
        ):
            if len(value) > MAX_PROMPTS:
                raise bad("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
            return list(value)
    raise bad("prompt", "must be a non-empty string, list of strings, list of token ids or list of such lists")


async def _completion_chunks(
    state: Any, generation: Generation, options: Options, reply: dict[str, Any]
) -> AsyncIterator[str]:
    n = options.params.n
    async for p, event in generation.events():
        if event.done:
            continue
        choice = {
            "index": p * n + event.index,
            "text": event.text,
            "logprobs": _completion_logprobs(state, event.logprobs) if options.logprobs else None,
            "finish_reason": _FINISH.get(event.finish_reason) if event.finish_reason else None,
        }
        if event.text or event.finish_reason or options.logprobs:
            yield _sse({**reply, "choices": [choice], **({"usage": None} if options.include_usage else {})})
    if options.include_usage:
        yield _sse({**reply, "choices": [], "usage": _usage([r.usage for r in generation.requests])})
    yield "data: [DONE]\n\n"


def _completion_logprobs(state: Any, logprobs: Sequence[Any]) -> dict[str, Any]:
    tokens = [_token_text(state, token) for token, _, _ in logprobs]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in logprobs],
        "top_logprobs": [{_token_text(state, t): v for t, v in (top or ())} for _, _, top in logprobs],
        "text_offset": offsets,
    }


# -- /v1/chat/completions ----------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await state.read_json(request)
    state.check_model(body.string("model", required=True))
    messages = _messages(body.array("messages", required=True))
    tools = body.array("tools") or None
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise bad("tool_choice", 'only "auto" and "none" are supported')
    if tool_choice == "none":
        tools = None  # the model neither sees nor calls them
    body.refuse("parallel_tool_calls", "false is not supported", allowed=(True,))
    options = _options(body, chat=True)
    kwargs = body.mapping("chat_template_kwargs")
    template_kwargs = dict(kwargs.data) if kwargs is not None else {}
    body.refuse("response_format", "only {'type': 'text'} is supported", allowed=({"type": "text"},))
    body.refuse("modalities", "only ['text'] is supported", allowed=(["text"],))
    body.refuse("store", "is not supported", allowed=(False,))
    for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort", "verbosity"):
        body.refuse(name)
    body.refuse("web_search_options")
    body.finish(HARMLESS)

    ids, hints = await state.encode_chat(messages, tools, **template_kwargs)
    params = options.params
    if options.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=max(1, state.max_model_len - len(ids)))
    generation = state.submit([(ids, hints, params)], api_key(request))
    parse = {"reasoning": state.opens_thinking(ids), "tools": tools is not None, "schemas": tool_schemas(tools)}
    reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time())}
    reply["model"] = state.model_id
    if options.stream:
        stream = _chat_chunks(state, generation, options, {**reply, "object": "chat.completion.chunk"}, parse)
        return EventStream(stream, generation, "text/event-stream")
    [output] = await generation.outputs(request)
    state.remember([output])
    choices = [chat_choice(state, c, options.logprobs, parse) for c in output.outputs]
    return JSONResponse({**reply, "choices": choices, "usage": _usage([output.usage])})


def _messages(items: list[Any] | None) -> list[dict[str, Any]]:
    """OpenAI messages as chat-template messages: text parts joined, `developer` as `system`."""
    out = []
    for i, item in enumerate(items or []):
        message = Fields(item, f"messages[{i}]")
        role = message.string("role", required=True)
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", f"must be system, developer, user, assistant or tool, got {role!r}")
        converted: dict[str, Any] = {"role": role, "content": _content(message)}
        tool_calls = message.array("tool_calls")
        if tool_calls:
            converted["tool_calls"] = [
                _tool_call_in(message.name(f"tool_calls[{j}]"), c) for j, c in enumerate(tool_calls)
            ]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if (value := message.string(key)) is not None:
                converted[key] = value
        message.refuse("audio", "is not supported")
        message.refuse("function_call", "is not supported (use tool_calls)")
        message.finish({"refusal", "annotations"})
        out.append(converted)
    if not out:
        raise bad("messages", "must be a non-empty list")
    return out


def _content(message: Fields) -> str | None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(message.name("content"), "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        part_fields = Fields(part, message.name(f"content[{j}]"))
        kind = part_fields.string("type", required=True)
        if kind not in ("text", "input_text"):
            raise bad(part_fields.name("type"), f"only text parts are supported, got {kind!r}")
        texts.append(part_fields.string("text", required=True) or "")
        part_fields.finish({"cache_control"})
    return "".join(texts)


def _tool_call_in(where: str, call: object) -> dict[str, Any]:
    fields = Fields(call, where)
    function = fields.mapping("function")
    if function is None:
        raise bad(f"{where}.function", "is required")
    name = function.string("name", required=True)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad(function.name("arguments"), "must be a JSON object (as a string)") from None
    if not isinstance(arguments, dict):
        raise bad(function.name("arguments"), "must be a JSON object (as a string)")
    function.finish()
    fields.string("type")
    fields.string("id")
    fields.finish({"index"})
    return {"type": "function", "id": fields.data.get("id"), "function": {"name": name, "arguments": arguments}}


def chat_choice(state: Any, completion: Completion, logprobs: bool, parse: dict[str, Any]) -> dict[str, Any]:
    """One choice of a chat answer: content, `reasoning_content` and `tool_calls` (arguments as a
    JSON string) split out of the generated text; finish reason "tool_calls" when it called any."""
    parser = OutputParser(**parse)
    pieces = merge([*parser.push(completion.text), *parser.finish()])
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    calls = [_tool_call_out(p) for p in pieces if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    finish = _FINISH.get(completion.finish_reason or "stop")
    return {
        "index": completion.index,
        "message": message,
        "logprobs": {"content": _chat_logprobs(state, completion.logprobs)} if logprobs else None,
        "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
    }


def _tool_call_out(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    out |= {"id": call.id, "type": "function"}
    out["function"] = {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}
    return out


def _chat_logprobs(state: Any, logprobs: Sequence[Any]) -> list[dict[str, Any]]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(state, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in (top or ())]} for token, lp, top in logprobs]


async def _chat_chunks(
    state: Any, generation: Generation, options: Options, reply: dict[str, Any], parse: dict[str, Any]
) -> AsyncIterator[str]:
    n = options.params.n
    parsers = [OutputParser(**parse) for _ in range(n)]
    calls = [0] * n
    usage_field = {"usage": None} if options.include_usage else {}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**reply, "choices": [choice], **usage_field})

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for _, event in generation.events():
        if event.done:
            continue
        parser = parsers[event.index]
        pieces: list[Piece] = parser.push(event.text)
        if event.finish_reason:
            pieces += parser.finish()
        logprobs = {"content": _chat_logprobs(state, event.logprobs)} if options.logprobs else None
        deltas = [_delta(piece, calls, event.index) for piece in merge(pieces)]
        if not deltas and logprobs is not None:
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            yield chunk(event.index, delta, logprobs if k == 0 else None)
        if event.finish_reason:
            finish = _FINISH.get(event.finish_reason)
            yield chunk(event.index, {}, finish="tool_calls" if calls[event.index] and finish == "stop" else finish)
    state.remember([r.output() for r in generation.requests])
    if options.include_usage:
        yield _sse({**reply, "choices": [], "usage": _usage([r.usage for r in generation.requests])})
    yield "data: [DONE]\n\n"


def _delta(piece: Piece, calls: list[int], index: int) -> dict[str, Any]:
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    if isinstance(piece, Content):
        return {"content": piece.text}
    calls[index] += 1
    return {"tool_calls": [_tool_call_out(piece, index=calls[index] - 1)]}
