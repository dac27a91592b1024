"""Attaching to a cluster that is not there fails fast, with one line naming the address tried.

No Ray is started here: nothing listens on the port these tests use (a port bound and closed a
moment before), so the address probe refuses at once; the bound asserted is the default connect
timeout, which only a hang reaches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import ray

from actors.cluster import DEFAULT_CONNECT_TIMEOUT_S, ConnectError, attach, resolve
from specter.assets import ASSETS


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "specter.cli", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=4 * DEFAULT_CONNECT_TIMEOUT_S)
    return proc, time.monotonic() - t0


def _one_line_naming(stderr: str, address: str) -> None:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("specter: error:")]
    assert len(lines) == 1, stderr[-2000:]
    assert address in lines[0] and "ray start" in lines[0] and "token" in lines[0], lines[0]
    assert "Traceback" not in stderr


def test_generate_with_an_unreachable_address_exits_at_once_naming_it() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    proc, wall = _cli("generate", "--address", address, "--prompt", "x", "--max-new-tokens", "2")
    assert proc.returncode == 1 and wall < DEFAULT_CONNECT_TIMEOUT_S
    _one_line_naming(proc.stderr, address)  # the loopback address as given, not rewritten


def test_batch_with_an_unreachable_auto_cluster_exits_at_once_naming_it(tmp_path, monkeypatch, capsys) -> None:
    """In this process (the subprocess above shows the command's own exit): ``main``'s status and stderr."""
    from specter.cli import main

    if ray.is_initialized():
        ray.shutdown()
    address = f"127.0.0.1:{_closed_port()}"
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    monkeypatch.setenv("RAY_ADDRESS", address)  # what `auto` resolves to
    t0 = time.monotonic()
    code = main(["batch", str(src), "--out", str(tmp_path / "out.jsonl"), "--address", "auto",
                 "--model", str(ASSETS / "moe-fine")])
    assert code == 1 and time.monotonic() - t0 < DEFAULT_CONNECT_TIMEOUT_S and not ray.is_initialized()
    _one_line_naming(capsys.readouterr().err, f"auto = {address}")
    out = tmp_path / "out.jsonl"
    assert not out.exists() or not out.read_text().strip()  # nothing ran, nothing recorded


def test_client_with_an_unreachable_address_raises_connect_error() -> None:
    from actors.client import Client

    if ray.is_initialized():
        ray.shutdown()
    address = f"127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match=address.replace(".", r"\.")):
        Client(ASSETS / "moe-fine", address=address, connect_timeout_s=10)
    assert time.monotonic() - t0 < 10 and not ray.is_initialized()


def test_auto_without_any_cluster_says_so(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray._private.services.find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(ConnectError, match="found no running cluster"):
        resolve("auto")


@pytest.mark.parametrize("bad", ["nowhere", "host:notaport", "127.0.0.1:0", "127.0.0.1:70000"])
def test_a_malformed_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="expected auto, local, HOST:PORT"):
        attach(bad, 1.0)


def test_the_connect_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="connect timeout"):
        attach("127.0.0.1:1", 0)
    proc, _ = _cli("generate", "--address", "auto", "--connect-timeout", "-1", "--prompt", "x")
    assert proc.returncode == 2 and "--connect-timeout" in proc.stderr
