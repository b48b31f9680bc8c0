"""Where keys come from and when `serve` refuses to start: keys from a file, HYBRIDKV_API_KEY and
--api-key are unioned, a source without a key is an error naming it, and a --host that reaches
beyond loopback without a key is refused before the model loads, with one line saying what to do.
Last, `hybridkv serve` as a user starts it with keys from all three sources: none shows in its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import MODEL, wait_until_healthy

from hybridkv.cli import main
from hybridkv.server import serve as serve_module
from hybridkv.server.auth import Access, AccessError, exposed_addresses, load_keys
from hybridkv.server.serve import make_server

NO_MODEL = "/nonexistent/model"  # reaching the model load fails differently: a refusal must come first


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDKV_API_KEY", raising=False)


def test_keys_from_every_source_are_unioned(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n#disabled-key\n")
    keys = load_keys(["cli-key"], key_file, " env-key-1, env-key-2 ,")
    assert keys == {"cli-key", "file-key-1", "file-key-2", "env-key-1", "env-key-2"}
    assert load_keys() == frozenset()


@pytest.mark.parametrize(
    ("file_text", "env", "cli", "names"),
    [
        ("", None, [], "--api-key-file"),
        ("# only a comment\n\n", None, [], "--api-key-file"),
        (None, " , ", [], "HYBRIDKV_API_KEY"),
        (None, None, [""], "--api-key"),
        (None, None, ["secret with spaces"], "--api-key"),
        ("ok-key\nsecret with spaces\n", None, [], "line 2"),
        (None, "ok,sécret", [], "HYBRIDKV_API_KEY"),
    ],
)
def test_a_source_without_a_usable_key_is_an_error_naming_it(
    tmp_path: Path, file_text: str | None, env: str | None, cli: list[str], names: str
) -> None:
    key_file = None
    if file_text is not None:
        key_file = tmp_path / "keys"
        key_file.write_text(file_text)
    with pytest.raises(AccessError) as error:
        load_keys(cli, key_file, env)
    assert names in str(error.value)
    assert "secret" not in str(error.value)  # a key is never repeated back


def test_a_missing_key_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(AccessError, match="--api-key-file .*nope"):
        load_keys(key_file=tmp_path / "nope")


def test_access_never_shows_its_keys() -> None:
    access = Access(frozenset({"the-secret-key"}))
    assert "the-secret-key" not in repr(access) and "the-secret-key" not in str(access)
    assert access.match(b"the-secret-key") == 0 and access.match(b"the-secret-ke") is None
    with pytest.raises(AccessError, match="--max-waiting-per-key"):
        Access(max_waiting_per_key=4)  # counts per key: needs keys
    with pytest.raises(AccessError, match="--max-waiting-per-key"):
        Access(frozenset({"k"}), max_waiting_per_key=0)


def fake_resolver(names: dict[str, list[str]]) -> Any:
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in names:
            return real(host, port, *args, **kwargs)
        infos = []
        for address in names[host]:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr = (address, port, 0, 0) if family == socket.AF_INET6 else (address, port)
            infos.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
        return infos

    return getaddrinfo


NAMES = {
    "gpu-box.example": ["10.1.2.3"],
    "split.example": ["127.0.0.1", "fd00::7"],
    "local.example": ["127.0.0.1", "127.0.1.1", "::1"],
    "mapped.example": ["::ffff:127.0.0.1"],
}


@pytest.mark.parametrize(
    ("host", "exposed"),
    [
        ("127.0.0.1", []),
        ("localhost", []),
        ("local.example", []),
        ("mapped.example", []),
        ("0.0.0.0", ["0.0.0.0"]),
        ("gpu-box.example", ["10.1.2.3"]),
        ("split.example", ["fd00::7"]),  # one address beyond loopback is enough
    ],
)
def test_addresses_beyond_loopback(monkeypatch: pytest.MonkeyPatch, host: str, exposed: list[str]) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver(NAMES))
    assert exposed_addresses(host, 8000) == exposed
    if exposed:
        with pytest.raises(AccessError) as refused:
            Access().check_host(host, 8000)
        message = str(refused.value)
        assert "\n" not in message and exposed[0] in message
        assert "HYBRIDKV_API_KEY" in message and "--api-key-file" in message and "--allow-unauthenticated" in message
        Access(frozenset({"k"})).check_host(host, 8000)  # a key, or saying it is meant, lets it start
        Access(allow_unauthenticated=True).check_host(host, 8000)
    else:
        Access().check_host(host, 8000)


def test_the_python_api_refuses_too() -> None:
    with pytest.raises(AccessError, match="--allow-unauthenticated"):
        make_server(None, MODEL, "0.0.0.0", 8000)  # type: ignore[arg-type]  # refused before the LLM is used


@pytest.mark.parametrize(
    "flags",
    [
        ["--host", "0.0.0.0"],
        ["--host", "gpu-box.example"],  # a name that resolves beyond loopback
        ["--host", "0.0.0.0", "--ssl-certfile", "cert.pem", "--ssl-keyfile", "key.pem"],  # TLS is not a key
    ],
)
def test_serve_refuses_beyond_loopback_without_a_key_before_loading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver(NAMES))
    assert main(["serve", "--model", NO_MODEL, *flags]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--allow-unauthenticated" in error and "not found" not in error


@pytest.mark.parametrize(
    "flags",
    [
        ["--host", "0.0.0.0", "--allow-unauthenticated"],
        ["--host", "gpu-box.example", "--api-key", "some-key"],
    ],
)
def test_serve_with_a_key_or_allowed_goes_on_to_load_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver(NAMES))

    def bind_loopback(host: str, port: int) -> socket.socket:  # the fake names are not this machine's
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        return sock

    monkeypatch.setattr(serve_module, "bind", bind_loopback)  # serve binds before the model loads
    assert main(["serve", "--model", NO_MODEL, *flags]) == 2
    assert "not found" in capsys.readouterr().err  # past every check, at the model


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--api-key-file", "/nonexistent/keys"], "--api-key-file"),
        (["--max-waiting-per-key", "3"], "--max-waiting-per-key"),
        (["--api-key", "k", "--max-waiting-per-key", "0"], "--max-waiting-per-key"),
        (["--api-key", "k", "--ssl-keyfile", "key.pem"], "--ssl-certfile"),
        (["--api-key", "k", "--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile"),
        (["--api-key", "k", "--ssl-certfile", __file__], "--ssl-certfile"),  # not a certificate
    ],
)
def test_bad_access_flags_are_named(capsys: pytest.CaptureFixture[str], flags: list[str], named: str) -> None:
    assert main(["serve", "--model", NO_MODEL, *flags]) == 2
    error = capsys.readouterr().err
    assert named in error and "not found" not in error


def test_serve_subprocess_refuses_0_0_0_0_fast() -> None:
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--host", "0.0.0.0", "--model", NO_MODEL]
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_API_KEY"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("hybridkv: error: --host 0.0.0.0") and result.stderr.count("\n") == 1
    assert "--allow-unauthenticated" in result.stderr and "Traceback" not in result.stderr


def test_serve_with_keys_from_all_sources_logs_none(model_dir: Path, tmp_path: Path) -> None:
    keys = {"file": "file-key-4f1a", "env": "env-key-9b2c", "cli": "cli-key-77de"}
    key_file = tmp_path / "keys"
    key_file.write_text(f"# keys\n{keys['file']}\n")
    key_file.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--max-model-len", "256", "--max-num-seqs", "2", "--threads", "1"]
    command += ["--api-key-file", str(key_file), "--api-key", keys["cli"]]
    env = os.environ | {"HYBRIDKV_API_KEY": keys["env"]}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url, wrong = f"http://127.0.0.1:{port}", "wrong-key-0000"
    try:
        wait_until_healthy(process, url)
        for key in keys.values():
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/api/version").status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "3 API keys" in stderr and '"GET /v1/models HTTP/1.1" 401' in stdout  # uvicorn's access log was on
    for key in [*keys.values(), wrong]:
        assert key not in stdout + stderr
