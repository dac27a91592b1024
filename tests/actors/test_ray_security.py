"""The embedded Ray is locked down: loopback only, and a driver without its token is refused."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import ray

from actors.cluster import node_address

ROOT = Path(__file__).resolve().parents[2]

ATTACH = """
import sys
from actors.cluster import ConnectError, attach
try:
    attach(sys.argv[1], 5.0)
except ConnectError as exc:
    print("REFUSED", exc)
    sys.exit(3)
print("JOINED")
"""


def _ray_processes() -> list[psutil.Process]:
    """This process and everything it started (the embedded Ray's GCS, raylet, agents, workers)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_embedded_ray_registers_and_listens_on_loopback_only(local_ray) -> None:
    assert node_address() == "127.0.0.1"
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    pids = {p.pid for p in _ray_processes()}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert listening, "found none of Ray's listening sockets"
    wide = [(c.pid, c.laddr) for c in listening if not _loopback(c.laddr.ip)]
    assert wide == [], f"listening beyond loopback: {wide}"


def test_embedded_ray_runs_with_token_auth_in_every_process(local_ray) -> None:
    @ray.remote(num_cpus=0)
    def auth_mode_and_niceness() -> tuple[str | None, int]:
        return os.environ.get("RAY_AUTH_MODE"), os.nice(0)

    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) >= 32
    # token auth in the worker too, and the worker (the engine's actors run in such processes) at
    # niceness 0, not Ray's default 15 that any ordinary load starves
    assert ray.get(auth_mode_and_niceness.remote()) == ("token", 0)


@pytest.mark.parametrize("who", ["no token", "wrong token", "right token"])
def test_a_driver_without_the_token_is_refused(local_ray, who: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if who == "no token":
        env["RAY_AUTH_MODE"] = "disabled"  # a plain Ray driver, as Ray defaults to
    elif who == "wrong token":
        env["RAY_AUTH_TOKEN"] = "0" * 64
    else:
        env["RAY_AUTH_TOKEN"] = os.environ["RAY_AUTH_TOKEN"]
    gcs = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-c", ATTACH, gcs], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    if who == "right token":
        assert proc.returncode == 0 and "JOINED" in proc.stdout, proc.stderr[-2000:]
    else:
        assert proc.returncode == 3, (proc.stdout + proc.stderr)[-2000:]
        assert "refused this driver's token" in proc.stdout and gcs in proc.stdout, proc.stdout
