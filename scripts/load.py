"""Load test for `hybridkv serve`: N streaming clients for M seconds on loopback, then a report.

    .venv/bin/python scripts/load.py [--clients 8] [--duration 20] [--max-tokens 32] [--api openai|ollama]
                                     [--url http://127.0.0.1:8000 | --model DIR --max-num-seqs 8]

Without --url it starts its own server (`hybridkv serve` on a free loopback port, the default
model unless --model) and stops it at the end. Each client sends streaming chat requests one
after another until the time is up (a shared system prompt, then a message of its own); requests
still running then get 60 s to finish. It reports requests per second, output tokens per second,
time to first token and whole-request latency (p50 / p95), errors by kind, and the server's
prompt tokens computed vs taken from the cache. Only loopback addresses are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SYSTEM = "You are a load-test assistant. Answer briefly and stay on topic. " * 3


@dataclass
class Results:
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)


async def one_request(http: httpx.AsyncClient, api: str, model: str, text: str, max_tokens: int, out: Results) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    if api == "openai":
        path = "/v1/chat/completions"
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
        body["stream_options"] = {"include_usage": True}
    else:
        path, body = "/api/chat", {"model": model, "messages": messages, "options": {"num_predict": max_tokens}}
    started = time.perf_counter()
    first: float | None = None
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                out.errors[f"HTTP {response.status_code}"] += 1
                return
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ") if api == "openai" else line
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if first is None and _has_text(api, chunk):
                    first = time.perf_counter()
                out.tokens += _tokens(api, chunk)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.errors[type(e).__name__] += 1
        return
    out.latency.append(time.perf_counter() - started)
    if first is not None:
        out.ttft.append(first - started)


def _has_text(api: str, chunk: dict) -> bool:
    if api == "openai":
        return any(c["delta"].get("content") for c in chunk.get("choices", []))
    return bool(chunk.get("message", {}).get("content"))


def _tokens(api: str, chunk: dict) -> int:
    if api == "openai":
        return int((chunk.get("usage") or {}).get("completion_tokens", 0))
    return int(chunk.get("eval_count", 0)) if chunk.get("done") else 0


async def client(k: int, args: argparse.Namespace, model: str, deadline: float, out: Results) -> None:
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(60.0)) as http:
        n = 0
        while time.monotonic() < deadline:
            await one_request(
                http, args.api, model, f"Client {k}, question {n}: what is {k} times {n}?", args.max_tokens, out
            )
            n += 1


async def run(args: argparse.Namespace) -> tuple[Results, float, str]:
    async with httpx.AsyncClient(base_url=args.url, timeout=10) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    out = Results()
    started = time.monotonic()
    deadline = started + args.duration
    tasks = [client(k, args, model, deadline, out) for k in range(args.clients)]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.duration + 60)
    return out, time.monotonic() - started, model


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in samples}


def start_server(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "hybridkv.cli",
        "serve",
        "--port",
        str(port),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    args.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"load.py: the server exited with status {server.returncode}")
        try:
            if httpx.get(f"{args.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    sys.exit("load.py: the server did not come up within 120 s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds to send requests for (default 20)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument(
        "--api", choices=["openai", "ollama"], default="openai", help="which API to load (default openai)"
    )
    parser.add_argument("--url", help="a running server (loopback only); default: start one")
    parser.add_argument("--model", help="checkpoint directory for the server started here (default: the default model)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="for the server started here (default 8)")
    args = parser.parse_args()
    if not (1 <= args.clients <= 256 and 0 < args.duration <= 600 and 1 <= args.max_tokens <= 4096):
        parser.error("give 1..256 clients, a duration in (0, 600] seconds and 1..4096 max tokens")
    server = None
    if args.url:
        if urlparse(args.url).hostname not in LOOPBACK:
            parser.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {args.url}")
        args.url = args.url.rstrip("/")
    else:
        server = start_server(args)
    try:
        before = metrics(args.url)
        out, elapsed, model = asyncio.run(run(args))
        after = metrics(args.url)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    done = len(out.latency)
    computed = (
        after['hybridkv_prompt_tokens_total{source="computed"}']
        - before['hybridkv_prompt_tokens_total{source="computed"}']
    )
    cached = (
        after['hybridkv_prompt_tokens_total{source="cache"}'] - before['hybridkv_prompt_tokens_total{source="cache"}']
    )
    print(f"model {model} via the {args.api} API: {args.clients} clients for {args.duration:g} s, ", end="")
    print(f"{args.max_tokens} tokens per answer")
    print(f"requests      {done} done in {elapsed:.1f} s: {done / elapsed:.2f} req/s, ", end="")
    print(f"{out.tokens / elapsed:.0f} output tok/s")
    print(f"TTFT          p50 {percentile(out.ttft, 50) * 1e3:.0f} ms, p95 {percentile(out.ttft, 95) * 1e3:.0f} ms")
    print(
        f"latency       p50 {percentile(out.latency, 50) * 1e3:.0f} ms, p95 {percentile(out.latency, 95) * 1e3:.0f} ms"
    )
    print(f"prompt tokens {computed:.0f} computed, {cached:.0f} from the cache")
    print(f"errors        {sum(out.errors.values())}" + (f" ({dict(out.errors)})" if out.errors else ""))
    return 1 if out.errors else 0


if __name__ == "__main__":
    sys.exit(main())
