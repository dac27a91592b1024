"""`ray start --head` with token authentication, then the client attaches and generates through the actors.

The head gets a fresh token in ``RAY_AUTH_TOKEN`` (as `ray get-auth-token --generate` would make one,
without touching ``~/.ray``); drivers with it join, a driver without it is refused in bounded time.

Each head binds free ports of 127.0.0.1 only and is stopped by killing the processes that name its
GCS port (``_stop_head``): what `ray stop --force` does, scoped to this head, without its ~7 s of
waiting between kinds of process (`ray stop` would also stop every other Ray on the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 8


def _token_env() -> dict[str, str]:
    return dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_head(port: int, bound_s: float = 60.0) -> None:
    """SIGKILL every process of the head on GCS ``port`` — those that name its session (the GCS names its
    port and the session; the raylet, agents, monitors and workers the session) and their children —
    then wait until none runs (a killed process nobody reaps counts as gone)."""
    import psutil

    procs = list(psutil.process_iter(["cmdline"]))
    lines = {proc: " ".join(proc.info["cmdline"] or []) for proc in procs}
    gcs = [line for line in lines.values() if "gcs_server" in line and f"--gcs_server_port={port}" in line]
    assert len(gcs) == 1, f"no single GCS of the head on port {port}: {gcs}"
    session = re.search(r"--session-name=(\S+)", gcs[0])
    assert session is not None, gcs[0]
    mine = {proc for proc, line in lines.items() if session.group(1) in line}
    for proc in list(mine):
        with contextlib.suppress(psutil.NoSuchProcess):
            mine.update(proc.children(recursive=True))
    for proc in mine:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    deadline = time.monotonic() + bound_s
    for proc in mine:
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)


def _started_head(env: dict[str, str], cpus: int):
    """A `ray start --head` on a free loopback port with ``env``; yields its address, stops it after."""
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={cpus}",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                   capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        _stop_head(port)


@pytest.fixture(scope="class")
def head():
    yield from _started_head(_token_env(), cpus=2)


class TestATokenCluster:
    """Both on one head, started and stopped once (`ray start` takes ~5 s)."""

    def test_client_attaches_to_ray_start_cluster_and_generates(self, head, tiny_dir):
        _, env = head  # the client finds the newest cluster on this machine: address="auto"
        folder = tiny_dir("mixtral")
        ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        proc = subprocess.run(
            [sys.executable, "-m", "specter.cli", "generate", "--model", str(folder), "--draft", str(folder),
             "--policy", "specter", "--window", "3", "--prompt-ids", ",".join(map(str, PROMPT)),
             "--max-new-tokens", str(NEW), "--budget", "0.5", "--address", "auto", "--json"],
            capture_output=True, text=True, env=env, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["tokens"] == want[0, len(PROMPT):].tolist()
        assert result["stats"]["rounds"] > 0

    def test_a_driver_without_the_clusters_token_is_refused_in_bounded_time(self, head):
        address, env = head
        env = dict(env, RAY_AUTH_TOKEN=secrets.token_hex(32))  # not the cluster's
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "specter.cli", "generate", "--prompt-ids", "1,2", "--address",
                               address, "--connect-timeout", "10"], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 1 and time.monotonic() - t0 < 60, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("specter: error:")]
        assert len(lines) == 1 and "refused this driver's token" in lines[0] and address in lines[0], proc.stderr[-2000:]


@pytest.fixture(scope="class")
def plain_head(tmp_path_factory):
    """A plain `ray start --head`: no token authentication (Ray's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path_factory.mktemp("home")))  # no ~/.ray/auth_token either
    yield from _started_head(env, cpus=1)


class TestAClusterWithoutTokens:
    """Both cases on one plain head, started and stopped once."""

    @pytest.mark.parametrize("token", [False, True], ids=["no-token", "a-token"])
    def test_a_cluster_without_token_authentication_is_told_in_one_line(self, plain_head, tmp_path, token):
        """Without a token Ray itself would abort the driver with a C++ check dump; with one it would join
        and then lose its actors. Both end here with status 1 and the README's steps, for generate, batch and serve."""
        address, env = plain_head
        if token:
            env = dict(env, RAY_AUTH_TOKEN=secrets.token_hex(32))
        prompts = tmp_path / "in.jsonl"
        prompts.write_text('{"id": 1, "prompt": "hi"}\n')
        commands = (["generate", "--prompt-ids", "1,2"], ["batch", str(prompts), "--out", str(tmp_path / "out.jsonl")],
                    ["serve", "--port", "0"])
        # the three at once: each is its own process against the same head (a CLI start-up is ~5 s here)
        procs = [subprocess.Popen([sys.executable, "-m", "specter.cli", *command, "--address", address],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for command in commands]
        for command, proc in zip(commands, procs, strict=True):
            try:
                _, stderr = proc.communicate(timeout=120)
            finally:
                proc.kill()
            assert proc.returncode == 1, (command, stderr[-2000:])
            errors = [line for line in stderr.splitlines() if line.startswith("specter: error:")]
            assert len(errors) == 1 and "Traceback" not in stderr and "Check failed" not in stderr, stderr[-2000:]
            assert "runs without token authentication" in errors[0] and "RAY_AUTH_MODE=token ray start --head" in errors[0]
            assert len(stderr.splitlines()) <= 2  # batch says what it is about to run first


@pytest.fixture()
def head_with_dashboard():
    if ray.is_initialized():
        ray.shutdown()
    port, dashboard = _free_port(), _free_port()
    env = _token_env()
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        _stop_head(port)


def test_batch_through_ray_job_submit_stopped_by_ray_job_stop_then_resumed(head_with_dashboard, tmp_path):
    """`ray job submit -- specter batch …` on the cluster (the job's driver attaches with --address auto);
    `ray job stop` once the first result is in — SIGTERM to the driver, SIGKILL 3 s later — stops it
    between prompts: the job is STOPPED, its log says how many are left, what finished stays; the same
    job submitted again runs only the rest, and every prompt's tokens are transformers' greedy ones.
    Before, Ray's own SIGTERM handling took over (a C++ stack dump and an abort, no summary)."""
    from transformers import AutoTokenizer

    from specter.assets import ASSETS

    url, env = head_with_dashboard
    model = ASSETS / "moe-fine"
    prompts = {f"p{i}": text for i, text in enumerate(["def main():", "import sys\n", "class A:", "while True:"])}
    src, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in prompts.items()))
    entry = ["specter", "batch", str(src), "--out", str(out), "--address", "auto", "--model", str(model),
             "--draft", str(ASSETS / "moe-fine-awq"), "--policy", "specter", "--max-new-tokens", "5"]

    def job(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ray", "job", *args], capture_output=True, text=True, env=env, timeout=900)

    deadline = time.monotonic() + 180
    while True:  # the job agent comes up a little after the dashboard
        # a slow link for the first job (the results are the same on any link): one still runs when stopped
        proc = job("submit", "--address", url, "--submission-id", "first", "--no-wait", "--", *entry, "--link", "sim:0.002")
        if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text()):
        assert time.monotonic() < deadline, job("logs", "--address", url, "first").stdout[-3000:]
        time.sleep(0.1)
    assert job("stop", "--address", url, "first").returncode == 0
    assert "was stopped" in job("status", "--address", url, "first").stdout
    logs = job("logs", "--address", url, "first").stdout
    done = len(out.read_text().splitlines())
    assert done < len(prompts) and f"specter batch: terminated, {len(prompts) - done} left" in logs, logs[-3000:]
    assert "re-run the same command" in logs and "Traceback" not in logs and "SIGTERM received" not in logs

    proc = job("submit", "--address", url, "--", *entry)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr and f"{done} already in" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == sorted(prompts)  # each once
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ref = AutoModelForCausalLM.from_pretrained(str(model), experts_implementation="eager", dtype=torch.float32)
    for row in rows:
        ids = tokenizer.encode(prompts[row["id"]])
        want = ref.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
        assert row["tokens"] == want
