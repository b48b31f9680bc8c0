"""`GET /metrics` in the Prometheus text format, and the middleware that counts HTTP answers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Paths counted by name; anything else (probes, typos) is counted as "other".
PATHS = frozenset(
    {
        "/",
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/api/generate",
        "/api/chat",
        "/api/tags",
        "/api/show",
        "/api/ps",
        "/api/version",
        "/tokenize",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
    }
)

# (engine counter, metric name, help, labels)
_COUNTERS = [
    ("requests_finished", "hybridkv_requests_total", "Engine requests by how they ended.", 'status="finished"'),
    ("requests_cancelled", "hybridkv_requests_total", "", 'status="cancelled"'),
    ("requests_rejected", "hybridkv_requests_total", "", 'status="rejected"'),
    ("tokens_generated", "hybridkv_generation_tokens_total", "Tokens generated.", ""),
    ("prompt_tokens_computed", "hybridkv_prompt_tokens_total", "Prompt tokens by origin.", 'source="computed"'),
    ("prompt_tokens_cached", "hybridkv_prompt_tokens_total", "", 'source="cache"'),
    ("prompt_tokens_disk", "hybridkv_prompt_tokens_total", "", 'source="disk"'),
    ("disk_read_seconds", "hybridkv_disk_read_seconds_total", "Seconds reading the prefix cache's disk tier.", ""),
    ("disk_write_seconds", "hybridkv_disk_write_seconds_total", "Seconds writing the prefix cache's disk tier.", ""),
    ("preemptions", "hybridkv_preemptions_total", "Requests preempted to make room in the cache.", ""),
    ("steps", "hybridkv_engine_steps_total", "Engine steps (forwards).", ""),
]
_GAUGES = [
    ("requests_running", "hybridkv_requests_running", "Requests being computed."),
    ("requests_waiting", "hybridkv_requests_waiting", "Requests queued, not yet admitted."),
    ("cached_sequences", "hybridkv_cached_sequences", "Finished sequences kept for prefix reuse."),
    ("disk_bytes_used", "hybridkv_disk_bytes_used", "Bytes the prefix cache's disk tier holds (all models)."),
]
_POOLS = ("kv", "state", "snapshot")


def render(
    engine: Mapping[str, int], responses: Mapping[tuple[str, int], int], model_id: str, announced: int | None = None
) -> str:
    """The metrics text; `announced`: prompt tokens in blocks this worker had announced to a
    router when each request came (with KV events on), to read against the cache's own count."""
    lines = [
        "# HELP hybridkv_model_info The model this server runs.",
        "# TYPE hybridkv_model_info gauge",
        f'hybridkv_model_info{{model="{_escape(model_id)}"}} 1',
    ]
    seen: set[str] = set()
    for key, name, help_text, labels in _COUNTERS:
        if name not in seen:
            seen.add(name)
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        lines.append(f"{name}{{{labels}}} {engine.get(key, 0)}" if labels else f"{name} {engine.get(key, 0)}")
    lines += _speculation(engine)
    for key, name, help_text in _GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {engine.get(key, 0)}"]
    for kind in ("used", "total"):
        name = f"hybridkv_cache_bytes_{kind}"
        lines += [f"# HELP {name} Cache memory {kind}, by pool.", f"# TYPE {name} gauge"]
        lines += [f'{name}{{pool="{pool}"}} {engine.get(f"{pool}_bytes_{kind}", 0)}' for pool in _POOLS]
    if announced is not None:
        name = "hybridkv_prompt_tokens_announced_total"
        lines += [f"# HELP {name} Prompt tokens the router could credit (announced blocks).", f"# TYPE {name} counter"]
        lines.append(f"{name} {announced}")
    lines += [
        "# HELP hybridkv_http_responses_total HTTP answers by path and status.",
        "# TYPE hybridkv_http_responses_total counter",
    ]
    for (path, status), count in sorted(responses.items()):
        lines.append(f'hybridkv_http_responses_total{{path="{_escape(path)}",status="{status}"}} {count}')
    return "\n".join(lines) + "\n"


class CountResponses:
    """ASGI middleware: counts each HTTP answer by path and status code into `counts`."""

    def __init__(self, app: ASGIApp, counts: Counter[tuple[str, int]]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in PATHS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counts[(path, int(message["status"]))] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


def _speculation(engine: Mapping[str, int]) -> list[str]:
    """Drafts verified, and drafts accepted by their position in the draft (1 = the first guess)."""
    positions = sorted(int(key.rsplit("_", 1)[1]) for key in engine if key.startswith("spec_draft_tokens_"))
    name = "hybridkv_spec_accepted_tokens_total"
    return [
        "# HELP hybridkv_spec_draft_tokens_total Speculative draft tokens verified.",
        "# TYPE hybridkv_spec_draft_tokens_total counter",
        f"hybridkv_spec_draft_tokens_total {engine.get('spec_draft_tokens', 0)}",
        f"# HELP {name} Speculative draft tokens accepted, by position in the draft.",
        f"# TYPE {name} counter",
        *(f'{name}{{position="{p}"}} {engine.get(f"spec_accepted_tokens_{p}", 0)}' for p in positions),
    ]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
