"""A real uvicorn server on a free loopback port, in a background thread, and clients for it
(sending `key` as a bearer API key when the server has keys)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import ollama
import openai

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.server.auth import Access
from hybridkv.server.serve import GracefulServer, make_server


def wait_until_healthy(process: subprocess.Popen[str], url: str, seconds: float = 60) -> None:
    """Poll a `hybridkv serve` child's /health until it answers 200 (it must not exit meanwhile)."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


MODEL = "tiny-chat"
MAX_MODEL_LEN = 1024


@dataclass
class Served:
    llm: LLM
    url: str
    server: GracefulServer
    key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "unused", max_retries=0, timeout=60)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.key or "unused", max_retries=0, timeout=60)

    def ollama(self) -> ollama.Client:
        return ollama.Client(host=self.url, timeout=60, headers=self.headers)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers=self.headers)

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10, headers=self.headers).text
        samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
        return {name: float(value) for name, value in samples}

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Seconds until no request runs or waits (per /metrics)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            m = self.metrics()
            if m["hybridkv_requests_running"] == 0 and m["hybridkv_requests_waiting"] == 0:
                return time.monotonic() - start
            time.sleep(0.02)
        raise AssertionError(f"the engine is still busy after {timeout} s")


def start(
    llm: LLM, grace: float = 1.0, access: Access | None = None, key: str | None = None, **uvicorn_options: object
) -> tuple[Served, threading.Thread]:
    """Serve `llm` on loopback; with `access` (keys, limits) and uvicorn options (TLS), if given."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uvicorn_options.setdefault("log_level", "warning")
    server = make_server(llm, MODEL, "127.0.0.1", port, grace=grace, access=access, **uvicorn_options)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    scheme = "https" if uvicorn_options.get("ssl_certfile") else "http"
    return Served(llm, f"{scheme}://127.0.0.1:{port}", server, key), thread


def stop(served: Served, thread: threading.Thread) -> None:
    served.server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not shut down"


def make_llm(model_dir: Path, max_num_seqs: int = 8, max_queue: int = 256) -> LLM:
    cache = CacheConfig(max_sequences=2 * max_num_seqs + 1, max_model_len=MAX_MODEL_LEN, snapshots_per_sequence=16)
    return LLM(model_dir, cache=cache, engine=EngineConfig(max_num_seqs=max_num_seqs, max_queue=max_queue))
