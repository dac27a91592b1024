"""The prepared GPU check (scripts/gpu_check.sh) runs on a CPU: the probes that need CUDA say so,
the others give figures, and its lossless probe agrees with transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_cpu_parts_and_says_what_it_skipped(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--quick", "--policies", "demand-lru,specter"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["env"]["status"] == "ok" and results["env"]["torch"] == torch.__version__
    for probe in ("copy", "overlap"):
        assert results[probe] == {"status": "skipped", "why": "needs CUDA", "seconds": results[probe]["seconds"]}
    shapes = results["real_shapes"]["by_model"]
    assert set(shapes) == {"qwen2moe", "dsv2lite", "mixtral"}
    for row in shapes.values():
        assert row["host_expert_ms"] > 0 and row["measured"].startswith("skipped: needs CUDA")
        assert 0 < row["modelled"]["draft_ratio"] < 1.0  # int4 experts make the draft step cheaper
    # A Mixtral expert is 3 x 4096 x 14336 bf16 = 352 MB: 7.05 ms over the modelled 50 GB/s.
    assert abs(shapes["mixtral"]["modelled"]["expert_transfer_ms"] - 3 * 4096 * 14336 * 2 / 50e9 * 1e3) < 1e-3
    trained = results["trained"]
    assert trained["status"] == "ok" and trained["device"] == "cpu"
    for model in ("moe-fine", "moe-coarse"):
        assert {p: r["identical"] for p, r in trained[model].items()} == {"demand-lru": True, "specter": True}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| copy | skipped |" in table and "needs CUDA" in table


def test_an_unknown_probe_is_a_clear_error(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--out", str(tmp_path), "--skip", "cpoy"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown probe(s) cpoy" in run.stderr


def test_the_device_session_runs_the_gpu_tests_then_hands_its_arguments_to_the_bench(tmp_path: Path) -> None:
    """scripts/gpu_session.sh is the one call a lent device gets: on a CPU its tests/gpu stage collects
    every GPU test and skips it for want of CUDA (a collection error would fail here), and the bench stage
    receives the arguments: a shape it does not know is refused by name."""
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "SPECTER_WHEELS_SITE": str(tmp_path / "site")}
    env.pop("SPECTER_WHEELS_READY", None)
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu_session.sh"), "--smoke", "--shapes", "qwen1.5-moe,nosuch"],
                         env=env, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "tests.log").read_text()
    assert " skipped" in log and "needs CUDA" in log and "error" not in log.lower(), log[-2000:]
    assert "passed" not in log and "failed" not in log
    assert "--shapes: unknown nosuch" in run.stderr
    assert "gpu_session: tests exit 0, bench exit 2" in run.stderr and run.returncode == 2
