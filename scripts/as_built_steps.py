"""The as-built clock's prediction for this code on the H200 (or an H100), eager and with CUDA graphs.

    python scripts/as_built_steps.py [--workload qwen-led|mixtral-agree] [--dtype bfloat16] [--real-layers N]
                                     [--gpu h200|h100] [--draft-mode int4-kernel] [--out DIR]
                                     [--prompts N] [--new-tokens T] [--steps eager,static,prepared]
                                     [--settings resident,specter-paper,specter,specter-kept]

``scripts/validate_dispatch.py``'s token-led Qwen1.5-MoE workload (4 layers, shrunk for the CPU, the
``qwen2moe-h200`` profile cut to 4 layers; ``--workload`` takes another of its workloads, e.g.
``mixtral-agree``: Mixtral's shapes on ``mixtral-h200``, a draft that agrees), 3 prompts x 48 tokens, medians, on the as-built clock:
the eager lean steps at the ``h200-eager`` calibration, and the static pieces a GPU replays as CUDA
graphs (``step="static"``: each piece one launch, its kernels a device floor each) at ``h200-graphs``
(``specter/timing/dispatch.py``) — once as the H200 ran them at fa408d0 (each token count's first
two steps eager, inside the request) and once ``prepared`` (``Engine.prepare_steps`` before the
request, as the GPU bench now runs every setting). Every setting starts each prompt from a fresh
engine, as the H200's runs did (``--real-layers``: the 4 layers standing for a whole model's, its
step's own work spread over all of them); ``specter-kept`` is ``specter`` with one K chooser through the three
prompts, as a running engine (and ``specter bench``) keeps what it learnt. ``--dtype bfloat16`` computes in bf16 as a GPU does
(default fp32, as the CPU's engine): whatever kernels a bf16 step issues that an fp32 one does not, the
clock charges a floor each. ``--gpu h100``: the same on the device tool's other kind, an H100 (taken as
the SXM part: 3.35 TB/s where the H200 has 4.8; ``qwen2moe-h100`` / ``mixtral-h100``), its link, host and
dispatch costs the H200's (assumed: no H100 has run this code). ``--draft-mode int4-kernel``: the draft's
experts in int4, a step's pairs gathered (the GPU bench's ``-int4`` rows; default ``dequant-cache``, the
GPU's default draft, bf16 copies of its experts); the clock charges the draft's experts as that mode
computes them (``DraftModel.last_compute``). After each step kind's settings, ``draft-step``: one draft decode
step alone (``vs_resident``: over the resident target step). Prints one JSON line per setting, then per
step kind each setting's TPOT over ``demand-lru``'s prompt by prompt (a kept chooser's first prompt is a
fresh one's) and their geomean (``specter-kept``'s also after its first prompt: what ``specter generate``
gets from its second run of a setup on, ``specter/plan/window_store.py``); writes ``as_built_steps.json``.
``--prompts``/``--new-tokens`` (default 3 x 48, drawn with ``--prompt-seed``), ``--steps`` and ``--settings`` run a part of it
(``demand-lru`` always runs: it is the ratios' base).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from specter.config import SlotConfig
from specter.draft.loading import load_draft
from specter.draft.quantize.model import quantize_model
from specter.engine import Engine
from specter.target import OffloadedTarget
from specter.timing.clock import VirtualClock
from specter.timing.costs import cost_model
from specter.timing.dispatch import DISPATCH

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validate_dispatch as vd  # noqa: E402  (its workloads and profile cut)

parser = argparse.ArgumentParser(description="the as-built clock's prediction, eager and graphed")
parser.add_argument("--out", default="runs/as-built-steps")
parser.add_argument("--work", default=None, help="keep the synthetic model here (default: a temporary folder)")
parser.add_argument("--workload", default="qwen-led", choices=sorted(vd.WORKLOADS),
                    help="validate_dispatch.py's workload (default qwen-led; mixtral-agree: Mixtral's shapes "
                         "with a draft that accepts a third of its windows; mixtral-led: one that accepts ~90 %%, "
                         "issue 34's Mixtral target)")
parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the compute dtype (default float32, as the CPU engine; bfloat16, as a GPU computes)")
parser.add_argument("--real-layers", type=int, default=vd.LAYERS,
                    help="the real model's layers the synthetic model's 4 stand for (default 4: one each); e.g. 32, "
                         "Mixtral's: each layer's ops and kernels charged 8 times, the step's own (embedding, LM head, "
                         "launch, read) once, as a whole model's step pays them")
parser.add_argument("--gpu", default="h200", choices=("h200", "h100"),
                    help="whose memory and compute the kernels are charged at (default h200, the lent one that "
                         "calibrated the dispatch costs; h100: the SXM part's 3.35 TB/s, the rest assumed the H200's)")
parser.add_argument("--draft-mode", default="dequant-cache", choices=("dequant-cache", "int4-kernel"),
                    help="how the draft holds its experts (default dequant-cache: bf16 copies, a GPU's default; "
                         "int4-kernel: int4, a step's routed pairs gathered, as the GPU bench's -int4 rows)")
parser.add_argument("--shrink", type=int, default=None,
                    help="divide the real shapes by N for the CPU's model (default: the workload's; the clock charges "
                         "the real shapes either way): e.g. 4 for Qwen's shapes in int4, whose experts the kernel "
                         "takes only from there (its 1408 / 8 = 176 is no multiple of 32)")
parser.add_argument("--prompts", type=int, default=3, help="prompts per setting (default 3)")
parser.add_argument("--new-tokens", type=int, default=48, help="tokens per prompt (default 48)")
parser.add_argument("--prompt-seed", type=int, default=5,
                    help="the seed the prompts' random tokens are drawn with (default 5; another draws a held-out set)")
parser.add_argument("--steps", default="eager,static,prepared",
                    help="which step kinds, comma-separated (default all three: eager, static, prepared)")
parser.add_argument("--settings", default=None,
                    help="which settings, comma-separated (default all: resident, demand-lru, specter-paper, specter, "
                         "specter-kept; demand-lru is always run, the ratios' base)")
args = parser.parse_args()
if args.prompts < 1 or args.new_tokens < 1:
    parser.error(f"--prompts/--new-tokens: expected 1 or more, got {args.prompts} / {args.new_tokens}")
KINDS = {"eager": ("eager", "h200-eager", False), "static": ("static", "h200-graphs", False),
         "prepared": ("static", "h200-graphs", True)}
if not set(args.steps.split(",")) <= set(KINDS):
    parser.error(f"--steps: expected some of {', '.join(KINDS)}, got {args.steps!r}")
ALL = [*vd.SETTINGS, "specter-kept"]
chosen = ALL if args.settings is None else args.settings.split(",")
if not set(chosen) <= set(ALL):
    parser.error(f"--settings: expected some of {', '.join(ALL)}, got {args.settings!r}")
chosen = [name for name in ALL if name in chosen or name == "demand-lru"]
if args.real_layers < 1:
    parser.error(f"--real-layers: expected 1 or more layers, got {args.real_layers}")
dtype = getattr(torch, args.dtype)
torch.set_num_threads(1)
synthetic = vd._synthetic()
scratch = None if args.work else tempfile.TemporaryDirectory(prefix="specter-as-built-")  # removed at exit
work = Path(args.work or scratch.name)  # type: ignore[union-attr]
work.mkdir(parents=True, exist_ok=True)
shape, gain, profile_name, shrink = vd.WORKLOADS[args.workload]
shrink = args.shrink or shrink
model = work / "model"
if not model.exists():
    synthetic.build_synthetic(shape, model, layers=4, gain=gain, shrink=shrink, dtype=torch.float32)
    quantize_model(str(model), str(work / "draft"), method="rtn", progress=False)
profile = vd._profile(profile_name.replace("-h200", f"-{args.gpu}"), synthetic.SHAPES[shape], args.real_layers)
gen = torch.Generator().manual_seed(args.prompt_seed)
prompts = [torch.randint(0, 4096, (8,), generator=gen).tolist() for _ in range(args.prompts)]
dims = vd._dims(model, dtype)  # the link moves an expert of the run's dtype in the profile's time


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def draft_step_ms(draft, costs, dname: str, steps: int = 16) -> float:
    """A draft decode step alone on the as-built clock (each token count's first steps run before the
    counting, as prepared): its dispatch, its kernels' floors and its experts as it computed them."""
    clock = VirtualClock(costs, dispatch=DISPATCH[dname])
    cache = draft.new_cache()
    draft.forward(torch.tensor([prompts[0]]), cache)
    cached = len(prompts[0])
    for token in range(4):
        draft.forward(torch.tensor([[token + 3]]), cache)
        cached += 1
    with clock.counting():
        start = clock.now()
        for token in range(steps):
            draft.forward(torch.tensor([[token + 7]]), cache)
            clock.charge_draft(draft.last_routing, 1, cached, draft.last_compute)
            cached += 1
        return (clock.now() - start) / steps * 1e3


out = []
for step, dname, prepared in (KINDS[kind] for kind in args.steps.split(",")):
    draft = load_draft(work / "draft", device="cpu", mode=args.draft_mode, step=step, dtype=dtype)
    for setting in chosen:
        policy, budget, window = vd.SETTINGS[setting.removesuffix("-kept")]
        tpots, acc = [], []
        kept = None  # specter-kept: one K chooser through the prompts, as a running engine keeps it
        for prompt in prompts:
            costs = replace(cost_model(profile, *dims), launches=False)
            clock = VirtualClock(costs, dispatch=DISPATCH[dname])
            target = OffloadedTarget.load(model, SlotConfig(fraction=budget),
                                          replace(costs, launches=True).link(), policy, clock=clock, step=step,
                                          dtype=dtype)
            target.offload.set_host(None)
            try:
                engine = Engine(target, draft if window else None, window=window)
                if setting == "specter-kept":
                    if kept is not None:
                        engine.policy.use_window_chooser(kept)
                    kept = engine.policy.window_chooser()
                if prepared:  # outside the clock's counting: what a request pays is what it runs
                    engine.prepare_steps()
                with clock.counting():
                    tokens, stats = engine.generate_fresh(prompt, args.new_tokens)
            finally:
                target.close()
            tpots.append(stats.tpot_s * 1e3)
            acc.append((stats.extra.get("mean_accepted", 0), stats.extra.get("mean_window", 0)))
        row = {"workload": args.workload, "shrink": shrink, "gpu": args.gpu, "dtype": args.dtype, "prompt_seed": args.prompt_seed, "real_layers": args.real_layers,
               "profile": profile.name, "draft_mode": args.draft_mode, "step": step,
               "dispatch": dname, "prepared": prepared, "setting": setting, "tpot_ms": statistics.median(tpots),
               "tpot_ms_prompts": tpots,
               "per_layer_ms": statistics.median(tpots) / args.real_layers,
               "accepted_per_window": acc}
        print(json.dumps(row), flush=True)
        out.append(row)
    if "resident" not in chosen:  # the draft step is reported over the resident step
        continue
    resident = next(r["tpot_ms"] for r in out[-len(chosen):] if r["setting"] == "resident")
    ms = draft_step_ms(draft, replace(cost_model(profile, *dims), launches=False), dname)
    row = {"workload": args.workload, "shrink": shrink, "gpu": args.gpu, "dtype": args.dtype,
           "real_layers": args.real_layers, "profile": profile.name, "draft_mode": args.draft_mode, "step": step,
           "dispatch": dname, "prepared": prepared, "setting": "draft-step", "tpot_ms": ms,
           "per_layer_ms": ms / args.real_layers, "vs_resident": round(ms / resident, 3)}
    print(json.dumps(row), flush=True)
    out.append(row)
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / "as_built_steps.json").write_text(json.dumps(out, indent=1))
# prompt by prompt over demand-lru: a median over three prompts hides a chooser's first request
for step, dname, prepared in sorted({(r["step"], r["dispatch"], r["prepared"]) for r in out}):
    group = {r["setting"]: r["tpot_ms_prompts"] for r in out
             if (r["step"], r["dispatch"], r["prepared"]) == (step, dname, prepared) and "tpot_ms_prompts" in r}
    base = group["demand-lru"]
    ratios = "; ".join(f"{name} " + " ".join(f"{t / b:.3f}" for t, b in zip(tpots, base, strict=True))
                       for name, tpots in group.items() if name not in ("resident", "demand-lru"))
    print(f"# {step}{', prepared' if prepared else ''} ({dname}), TPOT per prompt over demand-lru: {ratios}")
    means = []
    for name, tpots in group.items():
        if name in ("resident", "demand-lru"):
            continue
        each = [t / b for t, b in zip(tpots, base, strict=True)]
        later = f", after its first {_geomean(each[1:]):.3f} (worst {max(each[1:]):.3f})" \
            if name.endswith("-kept") and len(each) > 1 else ""
        means.append(f"{name} {_geomean(each):.3f} (worst {max(each):.3f}){later}")
    print(f"#   geomean over demand-lru: {'; '.join(means)}")
