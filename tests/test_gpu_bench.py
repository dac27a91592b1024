"""The prepared GPU bench's CPU smoke: the same script at shrunk shapes, every setting, lossless."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_bench import SMOKE_SHRINK, layer_read_bytes  # noqa: E402
from gpu_bench_report import markdown  # noqa: E402


def test_the_gpu_bench_runs_every_setting_on_a_cpu_and_every_engine_run_is_transformers(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out, models = tmp_path / "out", tmp_path / "models"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--smoke", "--out", str(out),
                           "--models", str(models)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "gpu_bench.json").read_text())
    report = (out / "gpu_bench.md").read_text()
    assert results["kernels"] == {"status": "skipped: needs CUDA"}  # the graph's kernel probe: a device's
    assert "Kernels in a CUDA graph: skipped: needs CUDA." in report
    for shape in ("qwen1.5-moe", "mixtral-8x7b"):
        block = results["shapes"][shape]
        assert "error" not in block, block.get("trace")
        names = {f"{p}@{b}" for b in ("0.25", "0.5") for p in ("demand-lru", "specter-paper", "specter")}
        eager = {"engine-eager@1", "demand-lru-eager@0.25", "specter-eager@0.25", "demand-lru-ops@0.25"}
        processes = {"demand-lru-processes@0.25", "specter-processes@0.25"}  # the three roles as processes
        # the int4 draft where the kernel takes the shrunk shapes (Mixtral's; Qwen's intermediate 88 is not
        # a multiple of 32)
        int4 = {"specter-paper-int4@0.25", "specter-int4@0.25"} if shape == "mixtral-8x7b" else set()
        resident = {"transformers@1", "engine@1", "engine-cut@1"}
        assert set(block["summary"]) == names | eager | processes | int4 | resident
        assert ("int4 static" in block["draft_step"]) == bool(int4)
        for name in processes:
            assert block["summary"][name]["vs_in_process"] > 0
        assert {"eager", "static"} <= set(block["draft_step"]) and block["draft_step"]["static"]["ms"] > 0
        reference = block["runs"]["transformers@1"][0]["tokens"]
        for name, runs in block["runs"].items():
            assert runs[0]["tokens"] == reference, name  # fp32 on a CPU: token-identical
            assert block["summary"][name]["tpot_ms"] > 0
        for name in names:
            assert block["summary"][name]["vs_demand_lru"] > 0
            if not name.startswith("demand-lru"):
                assert block["summary"][name]["window"] > 0  # acceptance is reported beside the figure
                hist = block["summary"][name]["window_hist"]  # and the K of each round
                assert hist == block["runs"][name][-1]["window_hist"] and any(int(k) > 0 for k in hist)
        adaptive = block["summary"]["specter@0.25"]  # what the K chooser had learnt: why it chose its K
        assert set(adaptive["chooser"]) >= {"alpha", "draft_s", "round_s", "per_token_s", "samples"}
        # one K chooser through the setting's runs, as a running engine keeps it: the discarded pass's
        # two requests (warm-up and timed) and this run's two
        assert adaptive["chooser"]["requests"] == 2 + 2 * len(block["runs"]["specter@0.25"])
        assert "ahead" in adaptive and "chooser" not in block["summary"]["specter-paper@0.25"]
        assert "* specter@0.25: rounds by K" in report
        assert f"## {shape}" in report
        # the resident step at a second depth (2 layers where the smoke's model has 1): its slope is a layer's
        # cost, its intercept the step's own; the second model's runs are transformers' greedy tokens on it
        slope = block["resident_slope"]
        (few, many), (few_ms, many_ms) = slope["layers"], slope["tpot_ms"]
        assert (few, many) == (2, 1) and many_ms == pytest.approx(block["summary"]["engine@1"]["tpot_ms"], abs=1e-3)
        assert slope["per_layer_ms"] == pytest.approx((many_ms - few_ms) / (many - few), abs=1e-3)
        assert slope["step_own_ms"] == pytest.approx(many_ms - many * slope["per_layer_ms"], abs=1e-3)
        assert len(block["depth_runs"]) == len(block["runs"]["engine@1"])
        deeper = AutoModelForCausalLM.from_pretrained(models / f"{shape}-2-layers" / "target").eval()
        for run in block["depth_runs"]:
            new = len(run["tokens"])
            with torch.no_grad():
                want = deeper.generate(torch.tensor([run["prompt"]]), max_new_tokens=new, min_new_tokens=new,
                                       do_sample=False)
            assert run["tokens"] == want[0, len(run["prompt"]):].tolist()
        assert f"Engine resident per MoE layer: **{slope['per_layer_ms']:.3f} ms** (the slope between its 2- and " \
               "1-layer steps" in report
        # the weights a resident step reads per layer, at the smoke's shrunk shapes in fp32: the same count
        assert block["layer_read_bytes"] == _read_bytes(shape, SMOKE_SHRINK[shape], 4)


def _read_bytes(shape: str, shrink: int, size: int) -> int:
    """A resident one-token step's weights per MoE layer, from the published configs' shapes by hand:
    Mixtral-8x7B (hidden 4096, 32 query / 8 key-value heads of 128, 8 experts of 14336, top 2) and
    Qwen1.5-MoE-A2.7B (hidden 2048, 16 heads, q/k/v biases, 60 experts of 1408, top 4, a shared expert of
    5632 with its one-output gate)."""
    if shape == "mixtral-8x7b":
        h, inter = 4096 // shrink, 14336 // shrink
        attention = 2 * h * h + 2 * h * (h // 32 * 8)
        return (attention + 2 * h + 8 * h + 2 * 3 * h * inter) * size
    h, inter, shared = 2048 // shrink, 1408 // shrink, 5632 // shrink
    attention = 4 * h * h + 3 * h
    return (attention + 2 * h + 60 * h + 3 * h * shared + h + 4 * 3 * h * inter) * size


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen1.5-moe"])
def test_the_weights_a_resident_step_reads_per_layer_are_the_published_shapes(shape):
    assert layer_read_bytes(shape) == _read_bytes(shape, 1, 2)
    assert layer_read_bytes(shape, SMOKE_SHRINK[shape], 4) == _read_bytes(shape, SMOKE_SHRINK[shape], 4)
    if shape == "mixtral-8x7b":  # 2 of 8 experts of 352.3 MB and 84 MB of attention: ~789 MB
        assert round(layer_read_bytes(shape) / 1e6) == 789


def test_the_report_puts_the_slope_beside_its_memory_floor():
    kernels = {"status": "ok", "hidden": 2048, "add_us": 2.1, "rms_norm_module_us": 9.0, "rms_norm_engine_us": 5.0,
               "rms_norm_engine_differs": 0.0, "rms_norm_fused_us": 2.2, "rms_norm_fused_differs": 0.01,
               "fused_rms_norm_cuda": True, "gemv_us": 39.0, "gemv_gbps": 3000.0}
    slope = {"layers": [1, 2], "tpot_ms": [0.5, 0.9], "per_layer_ms": 0.4, "step_own_ms": 0.1,
             "tpot_over_layers_ms": 0.45}
    block = {"layers": 2, "gain": 0.25, "dtype": "torch.bfloat16", "summary": {}, "resident_slope": slope,
             "layer_read_bytes": 789_000_000}
    text = markdown({"device": "a GPU", "torch": "2.x", "repeats": 3, "new_tokens": 32,
                     "kernels": kernels, "shapes": {"mixtral-8x7b": block}})
    assert "**3000 GB/s**" in text
    # 789 MB at 3000 GB/s: 0.263 ms of the slope's 0.4; 0.137 above it
    assert "Its weights (789 MB a layer: attention, norms, router, the top-k experts) at the probe's 3000 GB/s " \
           "take 0.263 ms; the rest of the slope, 0.137 ms," in text
    del kernels["gemv_gbps"]  # a probe from before it measured the GEMV: no floor, no error
    assert "Its weights" not in markdown({"device": "a GPU", "torch": "2.x", "repeats": 3, "new_tokens": 32,
                                          "kernels": kernels, "shapes": {"mixtral-8x7b": block}})


def test_the_gpu_bench_refuses_to_run_without_a_device_unless_smoke(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a device is here: the bench would run")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--smoke" in done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--smoke", "--shapes", "gpt",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown gpt" in done.stderr


def test_the_gpu_bench_on_the_pieces_a_gpu_graphs_prepares_every_step_shape_first(tmp_path):
    """``--static``: the steps after the prompt through the static pieces (what a GPU replays as CUDA
    graphs, run eagerly). Every graphed run makes its token counts ready first (``prepared`` > 0), its
    timed request then runs no step shape for the first time (``cold_steps`` 0), and its tokens are still
    transformers'; the eager rows prepare nothing. The resident ``engine`` row's step ran whole (one piece,
    experts inside), ``engine-cut``'s and every offloaded row's cut at each MoE layer, their experts in
    slots by the slot graphs but in ``demand-lru-ops``. The same holds through the three processes
    (``ProcessEngine.prepare_steps``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--smoke", "--static", "--shapes",
                           "mixtral-8x7b", "--budgets", "0.25", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    block = json.loads((tmp_path / "gpu_bench.json").read_text())["shapes"]["mixtral-8x7b"]
    assert "error" not in block, block.get("trace")
    reference = block["runs"]["transformers@1"][0]["tokens"]
    for name, runs in block["runs"].items():
        if name == "transformers@1":
            continue
        run = runs[0]
        assert run["tokens"] == reference, name
        assert run["cold_steps"] == 0, name
        assert (run["prepared"] > 0) == ("-eager" not in name), name
        if name.endswith("-processes@0.25"):  # the verifier's and the draft process's steps, made ready too
            continue
        assert run["whole"] == (name == "engine@1"), name
        graphed = "-eager" not in name and name != "engine@1"  # cut pieces, run as a GPU replays them
        assert run["slot_graphs"] == (graphed and name != "demand-lru-ops@0.25"), name
    assert block["summary"]["specter@0.25"]["chooser"]["cold"] == 0
