"""A crash leaves nothing behind: SIGKILL the driver, or an actor and then the driver, mid-request.

The driver is a separate process with its own embedded Ray. It launches one replica, starts a long
request, and prints ``INSIDE`` once the verifier reports committed tokens of that request (its
``progress``, read from the verifier's control thread): the kill is tied to that state, not to a
clock. After the kill the test waits until every process of that Ray session has exited, then
checks that nothing of that replica is left: no ``/dev/shm`` entry under its prefix (every segment a
replica makes is named by it) and no IPC directory. Scoped to the replica, not to every ``specter-*``
entry, so that another Specter running on the machine (a server, a second test run) cannot fail it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import json, sys, threading, time
import ray
from actors.cluster import start_local
from actors.launcher import launch
from specter.config import LinkConfig, SlotConfig

start_local(2, log_to_driver=False)
handle = launch(sys.argv[1], sys.argv[2], SlotConfig(fraction=0.25), LinkConfig(kind="sim", bandwidth=2e7,
                latency=5e-5), policy="specter+fixed", timeout_s=600)
pids = {role: ray.get(getattr(handle, role).pid.remote()) for role in ("transfer", "verifier", "draft")}
print(json.dumps({"session": ray.get_runtime_context().worker.node.session_name, "pids": pids,
                  "prefix": handle.prefix, "ipc": handle.ipc_dir}), flush=True)

def watch():
    while True:
        seen = ray.get(handle.verifier.progress.remote())
        if seen["active"] and seen["committed"] >= 1:
            print("INSIDE", json.dumps(seen), flush=True)
            return
        time.sleep(0.005)

threading.Thread(target=watch, daemon=True).start()
handle.generate([5, 99, 17, 42, 8, 63, 21], 200, window=3, policy="specter+fixed")  # drafts every round
print("FINISHED", flush=True)  # the kill landed too late: the test fails on this
"""


def _left(prefix: str, ipc: str) -> list[str]:
    """What of the replica of ``prefix`` is still there: its shared-memory segments and IPC directory."""
    shm = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"{prefix}-")]
    return shm + ([ipc] if Path(ipc).exists() else [])


def _session_alive(session: str) -> bool:
    found = subprocess.run(["pgrep", "-f", session], capture_output=True, text=True)
    return bool(found.stdout.strip())


def _read_line(proc: subprocess.Popen, prefix: str, bound_s: float) -> str:
    """The first stdout line starting with ``prefix`` (bounded: only a hung driver reaches it)."""
    deadline = time.monotonic() + bound_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the driver never printed {prefix!r}; stderr: {proc.stderr.read()[-2000:] if proc.stderr else ''}")


@pytest.mark.parametrize("victim", ["driver", "transfer", "verifier", "draft"])
def test_sigkill_mid_request_leaves_no_shared_memory_or_ipc_dir(models, victim) -> None:
    folder, draft = models
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_TOKEN", None)  # the driver's Ray makes its own
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(folder), str(draft)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(_read_line(proc, "{", 240))
        # launched sealed (the default): the names are gone once the peers are connected, so a crash
        # after that has nothing named to leave; the check is that no crash path brings one back
        assert info["prefix"].startswith("specter-") and Path(info["ipc"]).name.startswith("specter-ipc-")
        inside = _read_line(proc, "INSIDE", 240)
        assert json.loads(inside.split(" ", 1)[1])["committed"] < 200
        if victim != "driver":
            os.kill(info["pids"][victim], signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 90
        while _session_alive(info["session"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _session_alive(info["session"]), "Ray's processes outlived their driver"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _left(info["prefix"], info["ipc"]) == []
