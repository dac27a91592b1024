"""The GPU check (issue 18): one prepared run on a lent device, every probe in its own try.

    bash scripts/gpu_check.sh            # on the device machine: figures under $OUT
    python scripts/gpu_check.py --out DIR [--quick]

Probes (each records its figures or why it failed or was skipped, and how long it took):

* ``env``: torch, CUDA, the device, transformers.
* ``copy``: host→device GB/s from pinned and from pageable memory, at one expert's size of each
  real model (CUDA only).
* ``overlap``: a copy on a side stream while the default stream multiplies matrices: the share of
  the copy's time hidden behind the compute (CUDA only).
* ``real_shapes``: for Qwen1.5-MoE-A2.7B, DeepSeek-V2-Lite and Mixtral-8x7B at their real layer
  shapes (random weights): one expert's transfer (pinned), one expert on 1 and K+1 tokens in bf16
  and in int4 (torch's W4A16 ``_weight_int4pack_mm``, CUDA only), the host CPU's time for one
  expert (any machine), and from them the real ρ, η and draft/target ratio next to what the
  virtual clock's cost model assumes for an H200 (``specter/timing/profiles.py``).
* ``trained``: both trained models in process, every policy, budget 25 %: tokens against
  transformers' greedy ``generate`` on the same device, TPOT per policy (on a CPU: a simulated
  link, a few tokens, the code path only).

Writes ``gpu_check.json`` and ``gpu_check.md`` under ``--out``. Exits 0 whatever the probes found
(the figures are the result); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the device machine runs the checkout without installing it

# The real models' routed-expert shapes (hidden, intermediate), top-k, MoE layers, active bytes.
REAL = {
    "qwen2moe": {"hidden": 2048, "intermediate": 1408, "top_k": 4, "layers": 24, "profile": "qwen2moe-pcie4"},
    "dsv2lite": {"hidden": 2048, "intermediate": 1408, "top_k": 6, "layers": 26, "profile": "dsv2lite-pcie4"},
    "mixtral": {"hidden": 4096, "intermediate": 14336, "top_k": 2, "layers": 32, "profile": "mixtral-pcie4"},
}
H200_HBM = 4.8e12  # bytes/s (NVIDIA H200 data sheet)
H200_FLOPS = 989e12  # dense bf16 tensor peak (NVIDIA H200 data sheet)
PCIE5_PINNED = 50e9  # the profiles' PCIe 5.0 x16 pinned figure (docs/profiles.md)
WINDOW = 8  # K: a verify pass is K + 1 positions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tokens (a smoke run)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per trained-model run")
    parser.add_argument("--policies", default=None, help="comma-separated policies (default: every policy)")
    parser.add_argument("--skip", default="", help="comma-separated probes not to run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    reps = 3 if args.quick else 20
    new_tokens = args.new_tokens or (4 if args.quick or not cuda else 32)
    probes: dict[str, Callable[[], dict[str, Any]]] = {
        "env": probe_env,
        "copy": lambda: probe_copy(reps),
        "overlap": lambda: probe_overlap(reps),
        "real_shapes": lambda: probe_real_shapes(reps, cuda),
        "trained": lambda: probe_trained(new_tokens, args.policies),
    }
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(probes)
    if unknown:
        parser.error(f"--skip: unknown probe(s) {', '.join(sorted(unknown))}; known: {', '.join(probes)}")
    results: dict[str, Any] = {}
    for name, probe in probes.items():
        if name in skip:
            results[name] = {"status": "skipped", "why": "--skip"}
            continue
        t0 = time.perf_counter()
        try:
            results[name] = {"status": "ok", **probe()}
        except Skipped as why:
            results[name] = {"status": "skipped", "why": str(why)}
        except Exception as exc:  # one probe's failure must not hide the others'
            results[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(limit=8)}
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"{name}: {results[name]['status']} ({results[name]['seconds']} s)", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(results))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


class Skipped(Exception):
    """A probe that cannot run here (says why)."""


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skipped("needs CUDA")


def probe_env() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gb=round(props.total_memory / 2**30, 1),
                    cuda_version=torch.version.cuda, int4_mm=hasattr(torch, "_weight_int4pack_mm"))
    return info


def _time_cuda(fn: Callable[[], Any], reps: int, stream: torch.cuda.Stream | None = None) -> float:
    """Seconds per call of ``fn`` on ``stream`` (CUDA events; one warm-up call)."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def probe_copy(reps: int) -> dict[str, Any]:
    need_cuda()
    rows = {}
    for name, real in REAL.items():
        nbytes = 3 * real["hidden"] * real["intermediate"] * 2
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        row = {"expert_mb": round(nbytes / 1e6, 1)}
        for kind, pin in (("pinned", True), ("pageable", False)):
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            seconds = _time_cuda(lambda s=src, d=dst: d.copy_(s, non_blocking=True), reps, stream)
            row[f"{kind}_gbps"] = round(nbytes / seconds / 1e9, 2)
            row[f"{kind}_expert_ms"] = round(seconds * 1e3, 3)
        rows[name] = row
    return {"by_model": rows}


def probe_overlap(reps: int) -> dict[str, Any]:
    need_cuda()
    nbytes = 3 * 4096 * 14336 * 2  # a Mixtral expert
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    copy_stream = torch.cuda.Stream()

    def compute() -> None:
        for _ in range(8):
            a @ a

    copy_s = _time_cuda(lambda: dst.copy_(src, non_blocking=True), reps, copy_stream)
    compute_s = _time_cuda(compute, reps)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch.cuda.stream(copy_stream):
            dst.copy_(src, non_blocking=True)
        compute()
    torch.cuda.synchronize()
    both_s = (time.perf_counter() - t0) / reps
    hidden = max(0.0, min(copy_s, copy_s + compute_s - both_s))
    return {"copy_ms": round(copy_s * 1e3, 3), "compute_ms": round(compute_s * 1e3, 3),
            "both_ms": round(both_s * 1e3, 3), "copy_hidden_fraction": round(hidden / copy_s, 3)}


def _expert_s(hidden: int, inter: int, tokens: int, reps: int, device: str, dtype: torch.dtype,
              int4: bool = False) -> float:
    """Seconds for one routed expert (gate/up, SiLU × up, down) on ``tokens`` tokens."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate_up = torch.randn(2 * inter, hidden, device=device, dtype=dtype) / hidden**0.5
    down = torch.randn(hidden, inter, device=device, dtype=dtype) / inter**0.5
    if int4:
        gu_q, gu_s = _int4_pack(gate_up)
        dn_q, dn_s = _int4_pack(down)

        def fn() -> torch.Tensor:
            g, u = torch._weight_int4pack_mm(x, gu_q, 128, gu_s).chunk(2, dim=-1)
            return torch._weight_int4pack_mm(torch.nn.functional.silu(g) * u, dn_q, 128, dn_s)
    else:
        def fn() -> torch.Tensor:
            g, u = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
            return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, down)
    if device == "cuda":
        return _time_cuda(fn, reps)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _int4_pack(weight: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (out, in) as torch's CUDA W4A16 layout: packed codes and (scale, zero) per group."""
    out, inp = weight.shape
    w = weight.float().reshape(out, inp // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(out, inp)
    packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
    zero = lo + 8 * scale  # the kernel computes (code - 8) * scale + zero
    scales_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_zeros.to(weight.dtype)


def probe_real_shapes(reps: int, cuda: bool) -> dict[str, Any]:
    from specter.timing.profiles import PROFILES, Profile

    rows: dict[str, Any] = {}
    for name, real in REAL.items():
        h, i = real["hidden"], real["intermediate"]
        nbytes = 3 * h * i * 2
        base: Profile = PROFILES[real["profile"]]
        h200 = Profile(f"{name}-h200", "modelled H200", PCIE5_PINNED, base.expert_bytes, base.experts_per_token,
                       base.active_bytes, H200_HBM, base.budget, base.layers, base.kv_bytes, H200_FLOPS,
                       base.model_type, base.host)
        row: dict[str, Any] = {
            "modelled": {"expert_transfer_ms": round(h200.link_expert_s * 1e3, 3),
                         "expert_1tok_ms": round(h200.expert_s(1) * 1e3, 4),
                         "expert_int4_1tok_ms": round(h200.expert_s(1, int4=True) * 1e3, 4),
                         "step_ms": round(h200.step_s * 1e3, 3), "rho": round(h200.rho, 2),
                         "eta": round(h200.eta, 3), "draft_ratio": round(h200.draft_ratio, 3)},
        }
        # The host CPU of the machine this runs on: one expert on one token, fp32 as HostCompute runs it.
        host_reps = max(1, reps // 4) if nbytes > 1e8 else reps
        row["host_expert_ms"] = round(_expert_s(h, i, 1, host_reps, "cpu", torch.float32) * 1e3, 3)
        if cuda:
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            transfer = _time_cuda(lambda s=src, d=dst: d.copy_(s, non_blocking=True), reps, torch.cuda.Stream())
            measured: dict[str, Any] = {"expert_transfer_ms": round(transfer * 1e3, 3)}
            for tokens in (1, WINDOW + 1):
                bf16 = _expert_s(h, i, tokens, reps, "cuda", torch.bfloat16)
                measured[f"expert_{tokens}tok_ms"] = round(bf16 * 1e3, 4)
                try:  # the int4 kernel's own failure keeps the other figures
                    w4 = _expert_s(h, i, tokens, reps, "cuda", torch.bfloat16, int4=True)
                    measured[f"expert_int4_{tokens}tok_ms"] = round(w4 * 1e3, 4)
                    measured[f"w4_time_ratio_{tokens}tok"] = round(w4 / bf16, 3)
                except Exception as exc:
                    measured[f"expert_int4_{tokens}tok_error"] = f"{type(exc).__name__}: {exc}"
            # The dense part is modelled (the check builds no attention at real shape): step and ρ
            # from the modelled dense part plus the measured experts, so ρ, η and the draft ratio
            # change only where the measured expert and transfer times differ from the model's.
            dense = h200.layers * h200.dense_layer_s(1, 0)
            e = h200.experts_per_token
            step = dense + e * measured["expert_1tok_ms"] / 1e3
            measured["step_ms_dense_modelled"] = round(step * 1e3, 3)
            measured["rho"] = round(e * transfer / step, 2)
            measured["eta"] = round(row["host_expert_ms"] / 1e3 / transfer, 3)
            if "expert_int4_1tok_ms" in measured:
                draft = dense + e * measured["expert_int4_1tok_ms"] / 1e3
                measured["draft_ratio"] = round(draft / step, 3)
            row["measured"] = measured
        else:
            row["measured"] = "skipped: needs CUDA (the host CPU's expert time above is this machine's)"
        rows[name] = row
    return {"by_model": rows, "window": WINDOW}


def probe_trained(new_tokens: int, policies: str | None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from specter.assets import COARSE_MODEL, DEFAULT_MODEL
    from specter.config import LinkConfig, SlotConfig
    from specter.draft.loading import load_draft
    from specter.engine import Engine
    from specter.eval.prompts import load_prompts
    from specter.models.greedy import greedy_continuation
    from specter.plan import POLICIES, drafts
    from specter.target import OffloadedTarget

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    link = LinkConfig(kind="cuda") if cuda else LinkConfig(kind="sim", bandwidth=1e9, latency=10e-6)
    names = [p for p in (policies.split(",") if policies else sorted(POLICIES)) if p]
    rows: dict[str, Any] = {"device": device, "link": link.kind, "new_tokens": new_tokens}
    for model in (DEFAULT_MODEL, COARSE_MODEL):
        if not (model / "config.json").is_file() or not Path(f"{model}-awq", "config.json").is_file():
            rows[model.name] = {"skipped": "not in this checkout (moved out to fit a device's carry?)"}
            continue
        prompt = load_prompts(model, None, 1)[0]
        reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(device).eval()
        with torch.no_grad():
            expected = greedy_continuation(reference, prompt, new_tokens)
        del reference
        draft = load_draft(f"{model}-awq", device=device, mode="dequant-cache")
        per_policy: dict[str, Any] = {}
        for policy in names:
            try:
                target = OffloadedTarget.load(model, SlotConfig(fraction=0.25), link, policy, device=device, dtype=dtype)
                try:
                    window = 8 if drafts(policy) else 0
                    engine = Engine(target, draft if window else None, window)
                    tokens, stats = engine.generate_fresh(prompt, new_tokens)
                finally:
                    target.close()
                per_policy[policy] = {"identical": list(tokens[:new_tokens]) == expected,
                                      "tpot_ms": round(stats.tpot_s * 1e3, 3), "hit_rate": round(stats.hit_rate, 3),
                                      "bytes_moved": stats.bytes_moved}
            except Exception as exc:
                per_policy[policy] = {"error": f"{type(exc).__name__}: {exc}"}
        rows[model.name] = per_policy
    return rows


def markdown(results: dict[str, Any]) -> str:
    """The figures as tables (the JSON has everything)."""
    lines = ["# GPU check", "", "| probe | status | seconds | note |", "| --- | --- | ---: | --- |"]
    for name, r in results.items():
        note = r.get("why") or r.get("error") or ""
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {note} |")
    env = results.get("env", {})
    if env.get("status") == "ok":
        lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("status", "seconds"))]
    copy = results.get("copy", {})
    if copy.get("status") == "ok":
        lines += ["", "| model | expert MB | pinned GB/s | pageable GB/s |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {m} | {r['expert_mb']} | {r['pinned_gbps']} | {r['pageable_gbps']} |"
                  for m, r in copy["by_model"].items()]
    overlap = results.get("overlap", {})
    if overlap.get("status") == "ok":
        lines += ["", f"Copy/compute overlap: {overlap['copy_hidden_fraction']:.0%} of the copy hidden "
                  f"(copy {overlap['copy_ms']} ms, compute {overlap['compute_ms']} ms, both {overlap['both_ms']} ms)."]
    shapes = results.get("real_shapes", {})
    if shapes.get("status") == "ok":
        lines += ["", "| model | figure | modelled (H200) | measured |", "| --- | --- | ---: | ---: |"]
        for m, r in shapes["by_model"].items():
            measured = r["measured"] if isinstance(r["measured"], dict) else {}
            for key in ("expert_transfer_ms", "expert_1tok_ms", "expert_int4_1tok_ms", "rho", "eta", "draft_ratio"):
                lines.append(f"| {m} | {key} | {r['modelled'].get(key, '')} | {measured.get(key, '–')} |")
            lines.append(f"| {m} | host_expert_ms (this machine's CPU) | | {r['host_expert_ms']} |")
    trained = results.get("trained", {})
    if trained.get("status") == "ok":
        lines += ["", f"Trained models on {trained['device']} (link {trained['link']}, {trained['new_tokens']} tokens):",
                  "", "| model | policy | identical | TPOT ms | hit rate |", "| --- | --- | --- | ---: | ---: |"]
        for m, per in trained.items():
            if not isinstance(per, dict):
                continue
            if "skipped" in per:
                lines.append(f"| {m} | - | skipped: {per['skipped']} | | |")
                continue
            for policy, r in per.items():
                if isinstance(r, dict):
                    lines.append(f"| {m} | {policy} | {r.get('identical', r.get('error'))} | {r.get('tpot_ms', '')} "
                                 f"| {r.get('hit_rate', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
