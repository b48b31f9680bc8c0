"""`hybridkv serve` as a user starts it: it answers on the port, names the model after its
directory, and on Ctrl-C shuts down cleanly (status 130, as `run`)."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from served import wait_until_healthy


def test_serve_starts_answers_and_stops_on_ctrl_c(model_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--max-model-len", "256", "--max-num-seqs", "2", "--max-queue", "4", "--threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [model_dir.name]
        answer = httpx.post(
            f"http://127.0.0.1:{port}/api/generate",
            json={"model": f"{model_dir.name}:latest", "prompt": "hi", "stream": False, "options": {"num_predict": 3}},
        )
        body = answer.json()
        # three tokens, or fewer where the tiny random model samples its end of turn first
        assert body["done"] and (body["eval_count"] == 3 or (body["eval_count"] < 3 and body["done_reason"] == "stop"))
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr  # 128 + SIGINT, after a clean shutdown
    assert "Traceback" not in stderr


def test_bad_flags_exit_2_without_a_traceback(model_dir: Path) -> None:
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--model", str(model_dir), "--max-queue", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--max-queue" in result.stderr and "Traceback" not in result.stderr


def test_a_busy_port_is_one_line_before_the_model_loads(model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = [sys.executable, "-m", "hybridkv.cli", "serve", "--model", str(model_dir), "--port", str(port)]
        result = subprocess.run(command + ["--threads", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (
        f"hybridkv: error: cannot listen on http://127.0.0.1:{port}: already in use (another server?); "
        "stop it or choose another --port\n"
    )


def test_the_address_is_announced_once_the_server_listens_on_it(model_dir: Path) -> None:
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--model", str(model_dir), "--port", "0"]
    command += ["--max-model-len", "256", "--max-num-seqs", "2", "--threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        announced = None
        while announced is None:
            line = lines.get(timeout=60)
            announced = re.search(r"serving .* as model '\S+' on (http://127\.0\.0\.1:(\d+))$", line.strip())
        assert int(announced[2]) > 0  # --port 0: the port the system chose
        assert httpx.get(f"{announced[1]}/health", timeout=5).status_code == 200  # at once, no retry
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
