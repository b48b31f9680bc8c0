"""`POST /tokenize` in vLLM's shape, for vllm-router's `kv_aware` policy.

The router POSTs every request's body here, on each worker, and matches the ids against the
blocks that worker announced (`hybridkv.server.kv_events`). So the ids must be exactly those the
request will run: a chat is encoded as `/v1/chat/completions` encodes it (the ids this server
generated for earlier answers included), a prompt as `/v1/completions` does.

    {"model", "prompt"}                                    -> completion prompt
    {"model", "messages", "tools", "chat_template_kwargs",
     "add_generation_prompt", "continue_final_message"}    -> chat prompt
    reply {"count", "max_model_len", "tokens", "token_strs"}

vLLM's `/v1/chat/completions/render` and `/v1/completions/render`, which the router tries first,
are not served: the router takes their 404 as "ask /tokenize" (a render reply would have to carry
vLLM's whole sampling request, which this server neither needs nor reads).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridkv.server.fields import bad
from hybridkv.server.openai import chat_messages


def routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"])]


async def tokenize(request: Request) -> Response:
    state = request.app.state.server
    body = await state.read_json(request)
    state.check_model(body.string("model") or state.model_id)  # vLLM's model is optional here
    strings = bool(body.boolean("return_token_strs"))
    if body.has("messages"):
        messages = chat_messages(body.array("messages"))
        tools = body.array("tools") or None
        if body.get("tool_choice") == "none":
            tools = None  # as the chat route: the model does not see them
        body.refuse("continue_final_message", "only false is supported", allowed=(False,))
        body.refuse("add_special_tokens", "only false is supported for messages", allowed=(False,))
        generation_prompt = body.boolean("add_generation_prompt")
        kwargs = body.mapping("chat_template_kwargs")
        template_kwargs: dict[str, Any] = dict(kwargs.data) if kwargs is not None else {}
        body.finish()
        ids, _ = await state.encode_chat(
            messages, tools, add_generation_prompt=generation_prompt is not False, **template_kwargs
        )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "must be a string (or give messages)")
        body.refuse("add_special_tokens", "only true is supported for a prompt", allowed=(True,))
        body.finish()
        ids = await state.encode(prompt)
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    reply["token_strs"] = [state.llm.tokenizer.decode([t]) for t in ids] if strings else None
    return JSONResponse(reply)
