"""`hybridkv serve --replicas N` as a test starts it: a child process on a free loopback port, its
announce line read for the workers' and the metrics' addresses, stopped with SIGTERM."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from hybridkv.server.replicas import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "hybridkv-default"
_ANNOUNCE = re.compile(r"serving on (\S+) through .* replicas on (.*); cluster metrics on (\S+)/metrics")


def needs_router(router: str) -> None:
    """Skip, saying why, where the router's wheel is not installed."""
    package = {"sglang": "sglang_router", "vllm": "vllm_router"}[router]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install 'hybridkv[cluster]')")


@dataclass
class Cluster:
    process: subprocess.Popen[str]
    url: str
    workers: list[str]
    metrics_url: str
    key: str | None
    log: list[str] = field(default_factory=list)

    def openai(self, key: str | None = None, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key or self.key or "unused", max_retries=retries, timeout=120
        )

    def worker_pid(self, index: int) -> int:
        """The process serving worker `index` now: the child of serve holding its listening socket."""
        port = int(self.workers[index].rsplit(":", 1)[1])
        inode = next(
            fields[9]
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if (fields := line.split())[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port
        )
        for entry in Path("/proc").iterdir():
            try:
                if (
                    not entry.name.isdigit()
                    or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != self.process.pid
                ):
                    continue
                if any(os.readlink(fd) == f"socket:[{inode}]" for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
            except OSError:
                continue
        raise AssertionError(f"no worker process listening on port {port}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError("serve --replicas did not stop within 60 s of SIGTERM") from None


def start_cluster(*flags: str, key: str | None = None, replicas: int = 2, timeout: float = 240) -> Cluster:
    """`serve --replicas` with the default model, one thread a worker; `key` (KEY or KEY,KEY...) in
    HYBRIDKV_API_KEY, the first one used by the clients."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYBRIDKV_API_KEY", None)
    if key is not None:
        env["HYBRIDKV_API_KEY"] = key
    port = free_port()
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--replicas", str(replicas), "--port", str(port)]
    command += ["--threads", str(replicas), "--max-model-len", "1024", *flags]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    found = threading.Event()
    announced: list[re.Match[str]] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            match = _ANNOUNCE.search(line)
            if match and not found.is_set():
                announced.append(match)
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("serve --replicas did not come up:\n" + "".join(log[-40:]))
    url, workers, metrics = announced[0].groups()
    return Cluster(process, url, workers.split(", "), metrics, key.split(",")[0] if key else None, log)


def wait_healthy(url: str, seconds: float) -> float:
    """Seconds until `url`/health answers 200 (fails past `seconds`)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} was not healthy within {seconds} s")
