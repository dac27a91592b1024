"""``specter serve`` as a subprocess on loopback, as a user starts and stops it (the serving tests')."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx

START_S = 300  # a server's start on a loaded two-core machine (a local Ray, Serve, the three actors)
STOP_S = 90
READY = "; Ctrl-C stops)"  # the end of the line ``specter serve`` prints once the application is up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(port: int, flags: list[str], log: IO[str]) -> subprocess.Popen:
    """``specter serve --port PORT FLAGS`` as a subprocess writing to ``log``, without the key or the Ray
    address of the environment that runs the tests, leading a process group of its own (as a shell,
    ``timeout`` or a service manager starts it: ``stop`` can signal the whole group)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPECTER_API_KEY", "RAY_ADDRESS")}
    return subprocess.Popen([sys.executable, "-m", "specter.cli", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen, how: str) -> None:
    """``ctrl-c``: SIGINT to the server; ``sigterm-group``: SIGTERM to its whole process group, as
    ``timeout``, systemd's stop or Slurm's send it."""
    if how == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    elif how == "sigterm-group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        raise ValueError(f"how: 'ctrl-c' or 'sigterm-group', got {how!r}")


@contextlib.contextmanager
def serving(flags: list[str], log_path: Path, how: str = "ctrl-c") -> Iterator[tuple[str, int, subprocess.Popen]]:
    """``specter serve --port P FLAGS`` until it answers ``/health`` and has said it is serving (the
    ready line: a Ctrl-C before it stops a server still starting, with 130): yields its URL, port and
    process; then stops it (``stop``'s ``how``: Ctrl-C by default), which must end it with 0 and no
    traceback in its log (``log_path``)."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = start_serve(port, flags, log)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"specter serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200 and READY in log_path.read_text():
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"specter serve not up in {START_S} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(1.0)
            yield url, port, proc
        finally:
            stop(proc, how)
            try:
                code = proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
    text = log_path.read_text()
    assert code == 0, f"{how} ended specter serve with {code}:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
