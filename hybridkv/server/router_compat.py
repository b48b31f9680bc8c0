"""What the routers in front of replicas (sglang-router, vllm-router) add to requests and poll.

Both routers add their own engines' fields to every request they forward. The rule, for any client:
a value that equals what this server does anyway is accepted, any other is a 400 naming the field.

sglang-router reads a worker's model id from `/server_info` (then `/model_info`; the `get_`
names are their older spellings): a 404 on `/server_info` leaves the model "unknown" in its
`/v1/models`. Both routers poll `/health`. vllm-router's `kv_aware` policy POSTs each request to
`/tokenize` (see `hybridkv.server.tokenize`).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridkv.server.fields import Fields, bad

# field -> (the only value accepted, why)
_SHARED = {
    "no_stop_trim": (False, "a stop string is always trimmed from the answer"),
    "skip_special_tokens": (True, "special tokens are never written into the answer's text"),
    "return_hidden_states": (False, "hidden states are not returned"),
}
CHAT_FIELDS = _SHARED | {
    "continue_final_message": (False, "the answer always starts a new assistant message"),
    "separate_reasoning": (True, "a think block is always answered apart, as reasoning_content"),
    "stream_reasoning": (True, "reasoning is always streamed as it is generated"),
    "include_reasoning": (True, "reasoning_content is always included"),
}
COMPLETION_FIELDS = _SHARED


def accept_router_fields(body: Fields, chat: bool) -> None:
    """Read the router-added fields of a chat or completions request: each must be absent, null
    or equal to this server's behaviour."""
    for name, (ours, why) in (CHAT_FIELDS if chat else COMPLETION_FIELDS).items():
        value = body.boolean(name)
        if value is not None and value != ours:
            raise bad(name, f"only {str(ours).lower()} is supported: {why}")


INFO_PATHS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info")


def routes() -> list[Route]:
    return [Route(path, model_info, methods=["GET"]) for path in INFO_PATHS]


def info(state: Any) -> dict[str, Any]:
    """SGLang's model/server info, as much of it as means something here."""
    llm = state.llm
    return {
        "model_path": str(llm.model_dir),
        "served_model_name": state.model_id,
        "is_generation": True,
        "max_context_length": state.max_model_len,
        "model_type": llm.architecture,
        "weight_version": "default",
    }


async def model_info(request: Request) -> Response:
    return JSONResponse(info(request.app.state.server))
