"""Load test for `hybridkv serve`: N streaming clients for M seconds on loopback, then a report.

    .venv/bin/python scripts/load.py [--clients 8] [--duration 20] [--max-tokens 32] [--api openai|ollama]
                                     [--turns 1] [--url http://127.0.0.1:8000 | --model DIR --max-num-seqs 8
                                     [--replicas 1,2 --threads 2 --router sglang|vllm [--policy P]]]

Without --url it starts its own server (`hybridkv serve` on a free loopback port, the default
model unless --model) and stops it at the end. Each client sends streaming chat requests one
after another until the time is up (a shared system prompt, then a message of its own); requests
still running then get 60 s to finish. It reports requests per second, output tokens per second,
time to first token and whole-request latency (p50 / p95), errors by kind, and the server's
prompt tokens computed vs taken from the cache. Only loopback addresses are accepted.

Multi-turn (`--turns T`): each client holds a conversation of T turns, every turn sending the
whole history (its earlier answers included) plus a new question, then starts a new one; the cache
hit rate is the share of prompt tokens the answers' usage reports as cached. `--replicas 1,2`
runs the same load once per replica count, each a `serve --replicas R` with `--threads` split
between its workers, through the router, and prints one row each (openai API only).
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
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)


async def one_request(
    http: httpx.AsyncClient, api: str, model: str, messages: list[dict], max_tokens: int, out: Results
) -> str | None:
    """Send one streaming chat request; its answer's text, or None on an error."""
    answer = ""
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
                return None
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ") if api == "openai" else line
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                text = _text(api, chunk)
                if first is None and text:
                    first = time.perf_counter()
                answer += text
                out.tokens += _tokens(api, chunk)
                _count_prompt(api, chunk, out)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.errors[type(e).__name__] += 1
        return None
    out.latency.append(time.perf_counter() - started)
    if first is not None:
        out.ttft.append(first - started)
    return answer


def _text(api: str, chunk: dict) -> str:
    if api == "openai":
        return "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
    return str(chunk.get("message", {}).get("content") or "")


def _count_prompt(api: str, chunk: dict, out: Results) -> None:
    if api == "openai" and chunk.get("usage"):
        out.prompt_tokens += chunk["usage"]["prompt_tokens"]
        out.cached_tokens += (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    elif api == "ollama" and chunk.get("done"):
        out.prompt_tokens += int(chunk.get("prompt_eval_count", 0))


def _tokens(api: str, chunk: dict) -> int:
    if api == "openai":
        return int((chunk.get("usage") or {}).get("completion_tokens", 0))
    return int(chunk.get("eval_count", 0)) if chunk.get("done") else 0


async def client(k: int, args: argparse.Namespace, model: str, deadline: float, out: Results) -> None:
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(60.0)) as http:
        n = 0
        messages: list[dict] = []
        while time.monotonic() < deadline:
            if n % args.turns == 0:  # a new conversation
                messages = [{"role": "system", "content": f"{SYSTEM}(conversation {k}.{n})"}]
            messages.append({"role": "user", "content": f"Client {k}, question {n}: what is {k} times {n}?"})
            answer = await one_request(http, args.api, model, messages, args.max_tokens, out)
            messages.append({"role": "assistant", "content": answer or ""})
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


def start_server(args: argparse.Namespace, replicas: int | None = None) -> subprocess.Popen[bytes]:
    """`hybridkv serve` on a free loopback port (with `replicas`: behind the router), until healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--port", str(port)]
    command += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if replicas is not None:
        # No spare worker: its model load would run during the measurement.
        command += ["--replicas", str(replicas), "--router", args.router, "--no-spare"]
        command += ["--policy", args.policy] if args.policy else []
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    args.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"load.py: the server exited with status {server.returncode}")
        try:
            if httpx.get(f"{args.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    sys.exit("load.py: the server did not come up within 300 s")


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
    parser.add_argument("--turns", type=int, default=1, help="turns per conversation (default 1: no history)")
    parser.add_argument("--url", help="a running server (loopback only); default: start one")
    parser.add_argument("--model", help="checkpoint directory for the server started here (default: the default model)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="for the server started here (default 8)")
    parser.add_argument("--threads", type=int, help="for the server started here: CPU threads in all")
    parser.add_argument("--replicas", help="comma-separated replica counts, one run each through the router (1,2)")
    parser.add_argument("--router", choices=["sglang", "vllm"], default="sglang", help="with --replicas")
    parser.add_argument("--policy", help="with --replicas: the router's policy (default: serve's)")
    args = parser.parse_args()
    if not (1 <= args.clients <= 256 and 0 < args.duration <= 600 and 1 <= args.max_tokens <= 4096):
        parser.error("give 1..256 clients, a duration in (0, 600] seconds and 1..4096 max tokens")
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    if args.replicas:
        if args.url or args.api != "openai":
            parser.error("--replicas starts its own servers and loads the openai API")
        try:
            counts = [int(n) for n in args.replicas.split(",")]
        except ValueError:
            parser.error(f"--replicas: give counts like 1,2, got {args.replicas!r}")
        return compare(args, counts)
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
    turns = f", {args.turns} turns per conversation" if args.turns > 1 else ""
    print(f"model {model} via the {args.api} API: {args.clients} clients for {args.duration:g} s, ", end="")
    print(f"{args.max_tokens} tokens per answer{turns}")
    print(f"requests      {done} done in {elapsed:.1f} s: {done / elapsed:.2f} req/s, ", end="")
    print(f"{out.tokens / elapsed:.0f} output tok/s")
    print(f"TTFT          p50 {percentile(out.ttft, 50) * 1e3:.0f} ms, p95 {percentile(out.ttft, 95) * 1e3:.0f} ms")
    print(
        f"latency       p50 {percentile(out.latency, 50) * 1e3:.0f} ms, p95 {percentile(out.latency, 95) * 1e3:.0f} ms"
    )
    print(f"prompt tokens {computed:.0f} computed, {cached:.0f} from the cache")
    print(f"errors        {sum(out.errors.values())}" + (f" ({dict(out.errors)})" if out.errors else ""))
    return 1 if out.errors else 0


def compare(args: argparse.Namespace, counts: list[int]) -> int:
    """The same load through the router on each replica count, one row each."""
    threads = args.threads or 2
    rows = []
    for replicas in counts:
        if threads < replicas:
            sys.exit(f"load.py: --threads {threads} cannot give each of {replicas} replicas one")
        args.threads = threads
        server = start_server(args, replicas)
        try:
            out, elapsed, model = asyncio.run(run(args))
        finally:
            server.terminate()
            server.wait(timeout=60)
        rows.append((replicas, threads // replicas, out, elapsed))
    router = f"{args.router}-router" + (f" ({args.policy})" if args.policy else "")
    print(
        f"model {model} through {router}: {args.clients} clients for {args.duration:g} s, {args.turns} turns per ",
        end="",
    )
    print(f"conversation, {args.max_tokens} tokens per answer, {threads} threads in all")
    print("| replicas × threads | req/s | output tok/s | TTFT p50 | TTFT p95 | cache hit rate | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for replicas, each, out, elapsed in rows:
        hit = out.cached_tokens / out.prompt_tokens if out.prompt_tokens else float("nan")
        print(
            f"| {replicas} × {each} | {len(out.latency) / elapsed:.2f} | {out.tokens / elapsed:.0f} | "
            f"{percentile(out.ttft, 50) * 1e3:.0f} ms | {percentile(out.ttft, 95) * 1e3:.0f} ms | {hit:.0%} | "
            f"{sum(out.errors.values())} |"
        )
    return 1 if any(out.errors for _, _, out, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
