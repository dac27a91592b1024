"""Screenshots of the Ray dashboard while Specter's actors are alive (docs/dashboard.md).

Start a Ray head with its dashboard on 127.0.0.1, run a workload that attaches to it, wait until the
dashboard lists actors named ``specter-*``, then save PNGs of the Overview, Cluster and Actors pages:

    python scripts/dashboard_screenshot.py -- specter batch prompts.jsonl --out results.jsonl --address auto
    python scripts/dashboard_screenshot.py --demo            # one replica of the embedded model, in a loop
    python scripts/dashboard_screenshot.py --attach --port 8265   # a dashboard that is already up

The workload gets ``RAY_ADDRESS`` (this head's GCS) in its environment, so ``--address auto`` finds
it. Without ``--attach`` the head lives in this process (``ray.init``) and ends with it; nothing else
on the machine is touched (no ``ray stop``). Needs a headless Chromium (``apt-get install chromium``).
The head requires Ray's token (``RAY_AUTH_TOKEN``, made here, inherited by the workload); this
script's API calls send it. The headless browser is not handed the token, so pages that Ray's
dashboard protects show its token prompt: the images in docs/ were taken before token
authentication was turned on and have not been re-taken.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"overview": "#/overview", "cluster": "#/cluster", "actors": "#/actors"}
# The actors table is wide: its CPU, memory and GPU columns start past 1600 px.
WIDTH = {"actors": 2400}
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# One replica of the shipped model through the actors, generating until this script stops it.
# Ctrl-C (SIGINT, what finish() sends) or SIGTERM ends the `with`: the replica is shut down
# (sockets, shared memory) before the process exits.
DEMO = """
import itertools, signal, sys
from actors.client import Client
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    with Client("specter/assets/moe-fine", "specter/assets/moe-fine-awq", address="auto") as client:
        for i in itertools.count():
            out = client.generate(["def fibonacci(n):"], max_new_tokens=16, window=4, seed=i)
            print("demo request", i, "tpot_s", round(out[0]["stats"]["tpot_s"], 4), flush=True)
except KeyboardInterrupt:
    print("demo stopped", flush=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_head(port: int, num_cpus: int, metrics_port: int) -> str:
    """A Ray head owned by this process (loopback, token authentication: ``actors.cluster``), dashboard
    on 127.0.0.1:port; returns its GCS address."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from actors.cluster import start_local

    for attempt in range(1, 4):
        try:
            start_local(num_cpus, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
                        _metrics_export_port=metrics_port)
            return str(ray.get_runtime_context().gcs_address)
        except Exception as exc:  # Ray gives its raylet 30 s to register: a busy machine can miss that
            if "timed out during startup" not in str(exc) or attempt == 3:
                raise
            print(f"ray.init, attempt {attempt}: {exc}; retrying", file=sys.stderr, flush=True)
            ray.shutdown()
    raise AssertionError("unreachable")


def _metrics_port() -> int:
    import ray

    return ray._private.worker._global_node.metrics_export_port  # not in Ray's public API


def start_workload(command: list[str], gcs: str | None) -> subprocess.Popen:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")  # with this head's RAY_AUTH_MODE and RAY_AUTH_TOKEN
    if gcs:
        env["RAY_ADDRESS"] = gcs
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    print(f"workload: {shlex.join(command)}", flush=True)
    return subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)


def _rows(payload: Any) -> list[dict]:
    """The actor rows of a state-API answer, wherever the version nests them."""
    if isinstance(payload, list):
        return [r for r in payload if isinstance(r, dict)]
    if isinstance(payload, dict):
        for key in ("result", "data", "actors"):
            if key in payload and not isinstance(payload[key], bool | str | int):
                rows = _rows(payload[key])
                if rows:
                    return rows
        values = list(payload.values())
        if values and all(isinstance(v, dict) and "actorId" in v for v in values):
            return values
    return []


def specter_actors(port: int) -> list[tuple[str, str]]:
    """``(name, state)`` of the dashboard's actors named ``specter-*``."""
    url = f"http://127.0.0.1:{port}/api/v0/actors?limit=10000&detail=false"
    headers = {"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"} if os.environ.get("RAY_AUTH_TOKEN") else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        rows = _rows(json.load(response))
    found = [(r.get("name") or "", r.get("state") or "") for r in rows]
    return sorted((n, s) for n, s in found if n.startswith("specter-"))


def wait_for_actors(port: int, minimum: int, timeout_s: float, workload: subprocess.Popen | None) -> list:
    deadline = time.monotonic() + timeout_s
    alive: list = []
    while time.monotonic() < deadline:
        if workload is not None and workload.poll() is not None:
            raise SystemExit(f"the workload exited with status {workload.returncode} before {minimum} "
                             f"specter-* actors were alive ({len(alive)} were)")
        try:
            alive = [a for a in specter_actors(port) if a[1] == "ALIVE"]
        except OSError:  # the dashboard is still starting
            alive = []
        if len(alive) >= minimum:
            return alive
        time.sleep(2)
    raise SystemExit(f"timed out after {timeout_s:.0f}s: {len(alive)} of {minimum} specter-* actors alive")


def find_browser(explicit: str | None) -> str:
    for name in ([explicit] if explicit else BROWSERS):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("no Chromium found: apt-get install -y chromium (or pass --browser PATH)")


def screenshot(browser: str, url: str, out: Path, size: str, budget_ms: int) -> None:
    with tempfile.TemporaryDirectory(prefix="specter-chromium-") as profile:
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                   f"--user-data-dir={profile}", f"--window-size={size}", f"--virtual-time-budget={budget_ms}",
                   f"--screenshot={out}", url]
        subprocess.run(command, check=True, capture_output=True, timeout=120 + budget_ms / 1000)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", flush=True)


def finish(workload: subprocess.Popen | None, stop: bool) -> int:
    """Wait for the workload, or stop it as Ctrl-C would (so it shuts its replicas down), then harder."""
    if workload is None:
        return 0
    if stop:
        for sig, grace_s in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if workload.poll() is not None:
                break
            os.killpg(workload.pid, sig)  # its own session: the workload and its children only
            try:
                workload.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue
    return workload.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] [--demo | -- COMMAND ...]")
    parser.add_argument("--port", type=int, default=None, help="dashboard port (default: a free one; 8265 with --attach)")
    parser.add_argument("--attach", action="store_true", help="use a dashboard already up on 127.0.0.1:PORT")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the head this script starts")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="the head's --metrics-export-port (default: a free one; deploy/prometheus.yml uses 8080)")
    parser.add_argument("--demo", action="store_true", help="workload: one replica of the shipped model, in a loop")
    parser.add_argument("--min-actors", type=int, default=3, help="specter-* actors to wait for (3 per replica)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the actors")
    parser.add_argument("--settle", type=float, default=5, help="seconds to wait after they are up")
    parser.add_argument("--pages", default=",".join(PAGES), help=f"comma-separated, from: {', '.join(PAGES)}")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the PNGs")
    parser.add_argument("--prefix", default="dashboard", help="PNG names are PREFIX-PAGE.png")
    parser.add_argument("--size", default="1600,1000", help="browser window WIDTH,HEIGHT")
    parser.add_argument("--no-wide", dest="wide", action="store_false",
                        help=f"keep --size for every page (default: the actors page is {WIDTH['actors']} px wide)")
    parser.add_argument("--budget-ms", type=int, default=15000, help="Chromium's --virtual-time-budget")
    parser.add_argument("--browser", default=None, help="Chromium binary (default: found on PATH)")
    parser.add_argument("--stop-workload", action="store_true",
                        help="stop the workload once the screenshots are saved (default: wait for it; --demo stops)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="workload command, after --")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.demo and args.command:
        parser.error("give either --demo or a workload command, not both")
    unknown = set(args.pages.split(",")) - set(PAGES)
    if unknown:
        parser.error(f"argument --pages: unknown {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    browser = find_browser(args.browser)
    port = args.port or (8265 if args.attach else free_port())
    gcs = None if args.attach else start_head(port, args.num_cpus, args.metrics_port or free_port())
    print(f"dashboard: http://127.0.0.1:{port}" + (f" (GCS {gcs})" if gcs else ""), flush=True)
    if gcs:
        print(f"metrics: http://{gcs.rsplit(':', 1)[0]}:{_metrics_port()}/metrics (Prometheus text)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", DEMO] if args.demo else args.command
    workload = start_workload(command, gcs) if command else None
    try:
        actors = wait_for_actors(port, args.min_actors, args.timeout, workload)
        print("actors: " + ", ".join(name for name, _ in actors), flush=True)
        time.sleep(args.settle)  # let the dashboard's per-actor CPU/memory samples arrive
        for page in args.pages.split(","):
            width, height = args.size.split(",")
            size = f"{max(int(width), WIDTH.get(page, 0)) if args.wide else width},{height}"
            screenshot(browser, f"http://127.0.0.1:{port}/{PAGES[page]}", args.out / f"{args.prefix}-{page}.png",
                       size, args.budget_ms)
    finally:
        stop = args.demo or args.stop_workload
        status = finish(workload, stop)
    return 0 if stop else status  # a workload stopped on purpose has not failed


if __name__ == "__main__":
    sys.exit(main())
