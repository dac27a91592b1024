"""`ray start --head` on loopback, then the client attaches and generates through the actors.

`ray stop` stops every Ray process on this machine: no other test holds a Ray while this one runs
(the actor tests shut their module's local Ray down before this folder starts), and the head
binds free ports of 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def head():
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                   capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_client_attaches_to_ray_start_cluster_and_generates(head, tiny_dir):
    _, env = head  # the client finds the newest cluster on this machine: address="auto"
    folder = tiny_dir("mixtral")
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    env = dict(env, RAY_NODE_IP_ADDRESS="127.0.0.1")
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
