"""Validate the measured clock against the wall clock: same prompts, same link and host, each
policy run on both clocks back to back (interleaved, which goes first alternating by prompt), median
TPOT per policy and their ratio.

    python scripts/validate_clock.py --profile qwen2moe-pcie4 --num-prompts 3 --new-tokens 32

The measured clock charges compute its measured CPU time and runs the link and host as virtual
events; if it is a faithful account of the wall clock, every ratio is within ±10 % on a quiet
machine. It idles (uncounted) through each wait as the wall clock does, so that its compute is
timed in the state a real run's is; the third column, ``warm``, is the same clock jumping over its
waits instead, whose compute is faster than any real run's on this CPU (``docs/benchmark.md``).
One torch thread by default, so the wall clock's link thread has the other core.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from specter.assets import DEFAULT_MODEL
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.eval.bench import BenchConfig, load_target, window_of
from specter.eval.prompts import load_prompts
from specter.generation import resident_step_s
from specter.plan import drafts, policy_class
from specter.timing.costs import resolve_timing
from specter.timing.profiles import PROFILES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--profile", default="qwen2moe-pcie4", choices=list(PROFILES))
    parser.add_argument("--policies", default="demand-lru,demand-host,specter-paper,specter-paper+host,specter")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=8, help="K of the drafting policies")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="Python's GIL switch interval, s (default: the interpreter's, 0.005)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    prompts = load_prompts(args.model, None, args.num_prompts)
    policies = [p for p in args.policies.split(",") if p]
    draft = load_draft(args.model + "-awq", mode="dequant-cache")
    step_s, _ = resident_step_s(args.model, prompts[0])
    config = BenchConfig(args.model, args.model + "-awq", prompts, [args.profile], policies,
                         {p: args.window for p in policies if drafts(p)}, new_tokens=args.new_tokens)
    profile = PROFILES[args.profile]
    clocks = {c: resolve_timing(args.model, c, args.profile, step_s=step_s) for c in ("wall", "measured")}
    clocks["warm"] = dataclasses.replace(clocks["measured"], idle=False)
    print(f"{args.profile}: CPU all-resident step {step_s * 1e3:.2f} ms, {clocks['wall'].describe()}", flush=True)
    tpot: dict[tuple[str, str], list[float]] = {(p, c): [] for p in policies for c in clocks}
    draft_steps: list[tuple[float, int]] = []  # wall clock: (draft seconds, draft forwards) per run
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        for policy in policies:
            order = list(clocks.items()) if i % 2 == 0 else list(clocks.items())[::-1]  # no first-run bias
            for clock, timing in order:
                target = load_target(config, timing, profile, policy)
                window = window_of(config, policy)
                try:
                    engine = Engine(target, draft if drafts(policy) else None, window if drafts(policy) else 0,
                                    untimed_prefill=True)
                    stats = engine.generate_fresh(prompt, args.new_tokens)[1]
                    tpot[(policy, clock)].append(stats.tpot_s)
                    if clock == "wall" and drafts(policy):
                        last = policy_class(policy)().route_last_draft
                        forwards = stats.extra["drafted"] + (stats.extra["rounds"] if last else 0)
                        draft_steps.append((stats.extra["draft_s"], forwards))
                finally:
                    target.close()
        print(f"  prompt {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    print(f"\n{'policy':<22}{'wall ms':>10}{'measured ms':>13}{'measured/wall':>15}{'warm ms':>10}{'warm/wall':>11}")
    worst = 0.0
    for policy in policies:
        wall, measured, warm = (statistics.median(tpot[(policy, c)]) for c in clocks)
        worst = max(worst, abs(measured / wall - 1))
        print(f"{policy:<22}{wall * 1e3:>10.2f}{measured * 1e3:>13.2f}{measured / wall:>14.3f}x"
              f"{warm * 1e3:>10.2f}{warm / wall:>10.3f}x")
    print(f"\nlargest deviation {worst:.1%} ({'within' if worst <= 0.10 else 'outside'} ±10 %)")
    if draft_steps:
        step = sum(s for s, _ in draft_steps) / sum(n for _, n in draft_steps)
        print(f"draft step inside the round (wall, this CPU): {step * 1e3:.2f} ms = {step / step_s:.2f}x the "
              f"all-resident target step; modelled on the GPU ({args.profile}): {profile.draft_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
