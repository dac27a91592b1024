"""What one draft step costs on this CPU's wall clock, against the target's all-resident decode step.

    python scripts/draft_cost.py --threads 1,2 --num-prompts 3 --new-tokens 64
    python scripts/draft_cost.py --threads 1 --dtypes bfloat16,float32   # the draft's compute dtype
    python scripts/draft_cost.py --threads 1 --steps eager,lean           # the decode step's path

Per torch thread count, draft compute dtype and decode-step path (``lean``: ``models/decode.py``,
``eager``: transformers' forward; interleaved by prompt, so load drifts hit every
setting alike):

* ``target step`` — the target's all-resident decode step as the bench measures it (TPOT of a
  request with every expert in a slot and no link);
* ``target fwd``, ``draft fwd`` — one decode forward of each in isolation (median of one-token
  steps after the prompt: no round around it);
* ``in round`` — one draft step inside a real round: a ``specter+fixed`` run at the profile's
  link (scaled to this CPU's step) and budget, draft seconds of the round divided by its draft
  forwards — the forward plus what the round does around it (routing capture, the plan delta,
  the policy's schedule, choosing the token);
* its parts — the forward, building the plan delta, the policy's ``on_plan`` — and the run's TPOT;
* the ratio of ``in round`` to the target step, per setting and against the target step pooled
  over every setting (the same measurement, so the steadier denominator).

Wall-clock figures: run it on a quiet machine (no test suite, no second benchmark).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from specter import proposer as proposer_module
from specter.assets import DEFAULT_MODEL
from specter.config import LinkConfig, SlotConfig
from specter.draft.runner import DraftModel
from specter.engine import Engine
from specter.eval.bench import BenchConfig, load_target
from specter.eval.prompts import load_prompts
from specter.generation import resident_step_s
from specter.target import OffloadedTarget
from specter.timing.costs import resolve_timing
from specter.timing.profiles import PROFILES


class Timers:
    """Seconds spent in wrapped calls, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return timed


def isolated_forward_s(model: Any, prompt: list[int], steps: int = 24) -> float:
    """Median seconds of a one-token forward of ``model`` (draft or target) after ``prompt``."""
    cache = model.new_cache()
    logits = model.forward(torch.tensor([prompt]), cache)
    token = int(torch.argmax(logits[0, -1]))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor([[token]]), cache)
        times.append(time.perf_counter() - t0)
        token = int(torch.argmax(logits[0, -1]))
    return statistics.median(times)


def in_round(config: BenchConfig, timing: Any, draft: Any, prompt: list[int], window: int) -> dict[str, float]:
    """One ``specter+fixed`` request: per draft forward its parts, and the TPOT."""
    timers = Timers()
    target = load_target(config, timing, PROFILES[config.profiles[0]], "specter+fixed")
    forward, plan_delta = draft.forward, proposer_module.plan_delta
    try:
        engine = Engine(target, draft, window, untimed_prefill=True)
        engine.generate_fresh(prompt, 4)  # warm-up: first-call allocations, the chooser's state
        on_plan, prefill = engine.policy.on_plan, engine.proposer.prefill
        draft.forward = timers.wrap("forward", forward)
        engine.proposer.prefill = timers.wrap("prefill", prefill)  # type: ignore[method-assign]
        proposer_module.plan_delta = timers.wrap("plan delta", plan_delta)
        engine.policy.on_plan = timers.wrap("on_plan", on_plan)  # type: ignore[method-assign]
        stats = engine.generate(prompt, config.new_tokens)[1]
    finally:
        draft.forward = forward
        proposer_module.plan_delta = plan_delta
        target.close()
    forwards = stats.extra["drafted"] + (stats.extra["rounds"] if engine.policy.route_last_draft else 0)
    timers.seconds["forward"] -= timers.seconds.pop("prefill")  # the prompt's pass is not a round's
    per = {name: s / forwards for name, s in timers.seconds.items()}
    per["in round"] = stats.extra["draft_s"] / forwards
    per["tpot"] = stats.tpot_s
    return per


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--profile", default="qwen2moe-pcie4", choices=list(PROFILES))
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--threads", default="1,2", help="torch intra-op thread counts to compare")
    parser.add_argument("--mode", default="dequant-cache", help="the draft's expert mode")
    parser.add_argument("--dtypes", default="float32",
                        help="the draft's compute dtypes to compare (float32 is its default on a CPU)")
    parser.add_argument("--steps", default="lean",
                        help="the draft's decode-step paths to compare: lean (its default), eager")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
    if bad:
        parser.error(f"--dtypes: not torch dtypes: {', '.join(bad)}")
    steps = [s for s in args.steps.split(",") if s]
    if not steps or set(steps) - {"lean", "eager"}:
        parser.error(f"--steps: expected lean and/or eager, got {args.steps!r}")
    settings = [(t, d, s) for t in threads for d in dtypes for s in steps]
    prompts = load_prompts(args.model, None, args.num_prompts)
    drafts = {
        (d, s): DraftModel.load(args.model + "-awq", mode=args.mode, dtype=getattr(torch, d), lean=s == "lean")
        for d in dtypes for s in steps
    }
    config = BenchConfig(args.model, args.model + "-awq", prompts, [args.profile], ["specter+fixed"],
                         {}, new_tokens=args.new_tokens, budget=args.budget)
    torch.set_num_threads(1)
    step_1, _ = resident_step_s(args.model, prompts[0])
    timing = resolve_timing(args.model, "wall", args.profile, step_s=step_1)  # one link for every setting
    print(f"{args.profile} link at budget {args.budget:.0%}, K {args.window}, {args.mode}: {timing.describe()}")
    resident = OffloadedTarget.load(args.model, SlotConfig(fraction=1.0), LinkConfig(bandwidth=1e15, latency=0.0))
    rows: dict[tuple[int, str, str], dict[str, list[float]]] = {s: defaultdict(list) for s in settings}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        for t, d, s in settings if i % 2 == 0 else settings[::-1]:
            torch.set_num_threads(t)
            row = rows[(t, d, s)]
            row["target step"].append(resident_step_s(args.model, prompt)[0])
            row["target fwd"].append(isolated_forward_s(resident, prompt))
            row["draft fwd"].append(isolated_forward_s(drafts[(d, s)], prompt))
            for name, value in in_round(config, timing, drafts[(d, s)], prompt, args.window).items():
                row[name].append(value)
        print(f"  prompt {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    resident.close()
    columns = ["target step", "target fwd", "draft fwd", "in round", "forward", "plan delta", "on_plan", "tpot"]
    # The target step does not depend on the draft's setting: pooled over settings (per thread
    # count) it is the steadier denominator.
    pooled = {t: statistics.median(v for (t2, _, _), r in rows.items() if t2 == t for v in r["target step"])
              for t in threads}
    print("\n| threads | draft dtype | step | " + " | ".join(f"{c} ms" for c in columns)
          + " | in round / target step | in round / pooled target step |")
    print("| ---: | --- | --- |" + " ---: |" * (len(columns) + 2))
    for t, d, s in settings:
        med = {c: statistics.median(rows[(t, d, s)][c]) for c in columns}
        cells = " | ".join(f"{med[c] * 1e3:.2f}" for c in columns)
        print(f"| {t} | {d} | {s} | {cells} | {med['in round'] / med['target step']:.2f}x "
              f"| {med['in round'] / pooled[t]:.2f}x |")
    print("pooled target step (median over every setting's prompts): "
          + ", ".join(f"{t} thread(s) {pooled[t] * 1e3:.2f} ms" for t in threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
