"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.

Supported request fields are read and checked one by one; fields that would change the answer
and are not implemented (logit_bias, suffix, best_of > n, audio, ...) are a 400 naming the
field, and so is any field this module does not know. `response_format` (json_object,
json_schema), `tool_choice` (required, a named function) and `parallel_tool_calls: false` are
enforced by a grammar (see `structured`). Fields that change nothing here (user, metadata, store=false,
service_tier, ...) are accepted. vLLM's extensions top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, chat_template_kwargs and prompt_logprobs are accepted too.

Unset max_tokens means "up to the end of the context" for chat (as vLLM does) and 16 for
completions (as OpenAI does); a max_tokens that does not fit in the context after the prompt is
a 400 naming both numbers. Usage reports `prompt_tokens_details.cached_tokens`: the prompt
tokens taken from the prefix cache instead of being computed.

Scoring a prompt: completions `echo: true` puts the prompt before the answer, and with `logprobs`
its tokens' logprobs before the answer's (the first token's null), as lm-evaluation-harness's
`local-completions` reads them (`max_tokens` 0 or 1, token-id prompts); `max_tokens: 0` is
allowed with echo or prompt_logprobs. vLLM's `prompt_logprobs: k` answers, per completion choice
and at the top of a chat answer, a list with a null first entry and then, per prompt token, a
dict `token id -> {logprob, rank, decoded_token}` holding the token and the k likeliest. A
request that asks for prompt logprobs computes its whole prompt, prefix cache or not (see
`hybridkv.engine.engine`).
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

from hybridkv.engine.request import Completion, RequestOutput, Usage
from hybridkv.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from hybridkv.server.auth import api_key
from hybridkv.server.fields import Fields, bad
from hybridkv.server.generation import EventStream, Generation
from hybridkv.server.parsing import Content, OutputParser, Piece, Reasoning, ToolCall, merge
from hybridkv.server.router_compat import accept_router_fields
from hybridkv.server.structured import openai_constraint
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
    max_tokens_field: str  # the name the client gave it by
    stream: bool
    include_usage: bool
    logprobs: bool
    prompt_logprobs: int | None  # vLLM's extension: top-k alternatives per prompt token
    echo: bool = False

    def check_room(self, prompt_len: int, max_model_len: int) -> None:
        """A max_tokens that cannot fit after the prompt is the client's mistake: a 400 naming
        both (a prompt that fills the context alone is the engine's 400 about the prompt)."""
        if self.max_tokens is not None and prompt_len < max_model_len < prompt_len + self.max_tokens:
            raise bad(
                self.max_tokens_field,
                f"{self.max_tokens} tokens do not fit after a prompt of {prompt_len} tokens in this model's "
                f"{max_model_len}-token context: ask for at most {max_model_len - prompt_len}",
            )


def _options(body: Fields, chat: bool, echo: bool = False) -> Options:
    """The sampling fields both endpoints share, checked. `echo` (completions) allows max_tokens 0."""
    stream = bool(body.boolean("stream"))
    include_usage = False
    stream_options = body.mapping("stream_options")
    if stream_options is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with stream: true")
        include_usage = bool(stream_options.boolean("include_usage"))
        stream_options.boolean("include_obfuscation")  # padding against side channels: none needed here
        stream_options.finish()
    prompt_logprobs = body.integer("prompt_logprobs", low=0, high=MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise bad("prompt_logprobs", "is not available with stream: true")
    field = "max_tokens"
    if chat:
        max_tokens = body.integer("max_completion_tokens", low=1)
        legacy = body.integer("max_tokens", low=1)
        if max_tokens is not None and legacy is not None and max_tokens != legacy:
            raise bad("max_tokens", "give max_completion_tokens or max_tokens, not both")
        field = "max_completion_tokens" if max_tokens is not None else field
        max_tokens = max_tokens if max_tokens is not None else legacy
        logprobs = bool(body.boolean("logprobs"))
        top = body.integer("top_logprobs", low=0, high=MAX_LOGPROBS)
        if top is not None and not logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        top_logprobs = (top or 0) if logprobs else None
    else:
        max_tokens = body.integer("max_tokens", low=0)
        if max_tokens == 0 and not echo and prompt_logprobs is None:
            raise bad("max_tokens", "must be >= 1 (0, the prompt only, needs echo: true or prompt_logprobs)")
        top_logprobs = body.integer("logprobs", low=0, high=MAX_LOGPROBS)
        logprobs = top_logprobs is not None
    n = body.integer("n", low=1)
    best_of = body.integer("best_of", low=1) if not chat else None
    if best_of is not None and best_of != (n or 1):
        raise bad("best_of", "only best_of = n is supported (no ranking of extra samples)")
    body.refuse("logit_bias", "is not supported", allowed=({},))
    scored = [k for k in (prompt_logprobs, top_logprobs if echo else None) if k is not None]
    try:
        params = SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
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
            prompt_logprobs=max(scored) if scored else None,
            n=n or 1,
        )
    except ValueError as e:  # "top_p must be in (0.0, 1.0], got 0"
        name, _, rest = str(e).partition(" ")
        raise bad(name, rest) from None
    return Options(params, max_tokens, field, stream, include_usage, logprobs, prompt_logprobs, echo)


def _top_k(value: int | None) -> int | None:
    return 0 if value == -1 else value  # vLLM: -1 means off


def _int_list(body: Fields, key: str) -> list[int]:
    items = body.array(key) or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise bad(key, "must be a list of integers")
    return items


def _usage(usages: Sequence[Usage], announced: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with KV events on, `announced_tokens` beside `cached_tokens`: the prompt
    tokens the router could credit this worker with when it chose it (see `kv_events`)."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    accepted = sum(u.accepted_tokens for u in usages)
    details = {"cached_tokens": sum(u.cached_tokens for u in usages)}
    if announced is not None:
        details["announced_tokens"] = announced
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
        # Speculative decoding, in OpenAI's predicted-output fields: drafts verified and kept, and
        # drafts verified and rejected (their sum is every draft; none without --speculative).
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(u.draft_tokens for u in usages) - accepted,
        },
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
    options = _options(body, chat=False, echo=bool(body.boolean("echo")))
    body.refuse("suffix", "is not supported (no fill-in-the-middle)", allowed=("",))
    accept_router_fields(body, chat=False)
    body.finish(HARMLESS)
    encoded = [p if isinstance(p, list) else await state.encode(p) for p in prompts]
    for ids in encoded:
        options.check_room(len(ids), state.max_model_len)
    generation = state.submit([(ids, (), options.params) for ids in encoded], api_key(request))
    reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
    reply["model"] = state.model_id
    echoes = [_Echo(state, p, ids, options) for p, ids in zip(prompts, encoded, strict=True)]
    if options.stream:
        chunks = _completion_chunks(state, generation, options, reply, echoes)
        return EventStream(chunks, generation, "text/event-stream")
    outputs = await generation.outputs(request)
    n = options.params.n
    choices = [
        {"index": p * n + c.index, **echoes[p].choice(c.text, c.logprobs, output)}
        | {"finish_reason": _FINISH.get(c.finish_reason or "stop")}
        for p, output in enumerate(outputs)
        for c in output.outputs
    ]
    return JSONResponse(
        {**reply, "choices": choices, "usage": _usage([o.usage for o in outputs], generation.announced)}
    )


class _Echo:
    """One prompt of a completions request: what its choices show of it (the text and logprobs
    `echo` prepends, the `prompt_logprobs` list) before the generated text."""

    def __init__(self, state: Any, prompt: str | list[int], ids: list[int], options: Options) -> None:
        self.state = state
        self.ids = ids
        self.options = options
        self.text = "" if not options.echo else prompt if isinstance(prompt, str) else state.llm.tokenizer.decode(ids)

    def choice(
        self, text: str, logprobs: Sequence[Any], output: RequestOutput | None, offset: int = 0
    ) -> dict[str, Any]:
        """A choice's text, logprobs and prompt_logprobs; `output` None: a streamed chunk past
        the first (nothing of the prompt), else the first chunk or the whole answer."""
        echo = self.options.echo and output is not None
        entries: list[tuple[int, float | None, Any]] = []
        if echo and self.options.logprobs:
            assert output is not None
            k = self.options.params.logprobs or 0
            for token, scored in zip(self.ids, prompt_scores(output), strict=True):
                entries.append((token, None, None) if scored is None else (token, scored.logprob, scored.top[:k]))
        out: dict[str, Any] = {
            "text": (self.text if echo else "") + text,
            "logprobs": _completion_logprobs(self.state, [*entries, *logprobs], offset)
            if self.options.logprobs
            else None,
        }
        if self.options.prompt_logprobs is not None and output is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.state, prompt_scores(output), self.options)
        return out


def prompt_scores(output: RequestOutput) -> list[TokenLogprob | None]:
    """The prompt's scores, one per token: a request cancelled before its prompt was computed
    (finish reason "abort") has null for the tokens it did not score."""
    scored = output.prompt_logprobs or []
    return [*scored, *[None] * (len(output.prompt_ids) - len(scored))]


def vllm_prompt_logprobs(
    state: Any, scored: Sequence[TokenLogprob | None], options: Options
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then per token a dict from token id
    (a string, as JSON keys are) to {logprob, rank, decoded_token}: the token first, then the
    `prompt_logprobs` likeliest (ranked 1, 2, ...) unless one of them is the token itself."""
    k = options.prompt_logprobs or 0
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(t, lp, r) for r, (t, lp) in enumerate(entry.top[:k], start=1) if t != entry.token_id]
        out.append(
            {str(t): {"logprob": lp, "rank": rank, "decoded_token": _token_text(state, t)} for t, lp, rank in ranked}
        )
    return out


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
    state: Any, generation: Generation, options: Options, reply: dict[str, Any], echoes: list[_Echo]
) -> AsyncIterator[str]:
    n = options.params.n
    offsets: dict[int, int] = {}  # choice index -> its tokens' text so far, for logprobs' text_offset
    async for p, event in generation.events():
        if event.done:
            continue
        index = p * n + event.index
        first = index not in offsets
        output = generation.requests[p].output() if first else None  # the prompt is computed by now
        choice = {
            "index": index,
            **echoes[p].choice(event.text, event.logprobs, output, offsets.get(index, 0)),
            "finish_reason": _FINISH.get(event.finish_reason) if event.finish_reason else None,
        }
        offsets[index] = offsets.get(index, 0) + sum(map(len, (choice["logprobs"] or {}).get("tokens", ())))
        if choice["text"] or event.finish_reason or options.logprobs:
            yield _sse({**reply, "choices": [choice], **({"usage": None} if options.include_usage else {})})
    if options.include_usage:
        yield _sse(
            {**reply, "choices": [], "usage": _usage([r.usage for r in generation.requests], generation.announced)}
        )
    yield "data: [DONE]\n\n"


def _completion_logprobs(state: Any, logprobs: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy logprobs of (token, logprob or None, top alternatives or None) entries:
    each top_logprobs dict holds the alternatives and the token itself (as OpenAI documents:
    up to logprobs + 1 entries); an entry with no logprob (the first prompt token) has null."""
    tokens = [_token_text(state, token) for token, _, _ in logprobs]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    tops: list[dict[str, float] | None] = []
    for text, (_, logprob, top) in zip(tokens, logprobs, strict=True):
        if logprob is None:
            tops.append(None)
            continue
        alternatives = {_token_text(state, t): v for t, v in (top or ())}
        alternatives.setdefault(text, logprob)
        tops.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


# -- /v1/chat/completions ----------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await state.read_json(request)
    state.check_model(body.string("model", required=True))
    messages = chat_messages(body.array("messages", required=True))
    tools = body.array("tools") or None
    constraint = openai_constraint(body, tools)  # response_format, tool_choice, parallel_tool_calls
    if constraint.calls == "none":
        tools = None  # the model neither sees nor calls them
    options = _options(body, chat=True)
    kwargs = body.mapping("chat_template_kwargs")
    template_kwargs = dict(kwargs.data) if kwargs is not None else {}
    body.refuse("modalities", "only ['text'] is supported", allowed=(["text"],))
    body.refuse("store", "is not supported", allowed=(False,))
    for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort", "verbosity"):
        body.refuse(name)
    body.refuse("web_search_options")
    accept_router_fields(body, chat=True)
    body.finish(HARMLESS)

    ids, hints = await state.encode_chat(messages, tools, **template_kwargs)
    options.check_room(len(ids), state.max_model_len)
    params = options.params
    if options.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=max(1, state.max_model_len - len(ids)))
    thinking = state.opens_thinking(ids)
    params, grammar = await state.constrained(params, constraint, thinking)
    generation = state.submit([(ids, hints, params)], api_key(request))
    parse = {"reasoning": thinking, "tools": tools is not None, "schemas": tool_schemas(tools)}
    if grammar is not None:
        parse |= constraint.parser_options()
    reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time())}
    reply["model"] = state.model_id
    if options.stream:
        stream = _chat_chunks(state, generation, options, {**reply, "object": "chat.completion.chunk"}, parse)
        return EventStream(stream, generation, "text/event-stream")
    [output] = await generation.outputs(request)
    state.remember([output])
    choices = [chat_choice(state, c, options.logprobs, parse) for c in output.outputs]
    answer = {**reply, "choices": choices, "usage": _usage([output.usage], generation.announced)}
    if options.prompt_logprobs is not None:
        answer["prompt_logprobs"] = vllm_prompt_logprobs(state, prompt_scores(output), options)
    return JSONResponse(answer)


def chat_messages(items: list[Any] | None) -> list[dict[str, Any]]:
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
        yield _sse(
            {**reply, "choices": [], "usage": _usage([r.usage for r in generation.requests], generation.announced)}
        )
    yield "data: [DONE]\n\n"


def _delta(piece: Piece, calls: list[int], index: int) -> dict[str, Any]:
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    if isinstance(piece, Content):
        return {"content": piece.text}
    calls[index] += 1
    return {"tool_calls": [_tool_call_out(piece, index=calls[index] - 1)]}
