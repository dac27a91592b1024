"""Did a change alter any decision? Record virtual-clock runs, then compare two recordings exactly.

    python scripts/decisions.py record before.json        # on the old code (e.g. a worktree)
    python scripts/decisions.py record after.json         # on the new code
    python scripts/decisions.py compare before.json after.json

Each run is one policy on one prompt at one profile's own proportions, budget 25 %, on the virtual
clock (load-independent, so the recordings may be made on a busy machine): its tokens, TPOT, hits
and misses. A refactor that claims to change no decision (which expert moves when, which K, which
draft token) must compare equal: on the virtual clock every decision shows in the TPOT to the last
bit. Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specter.assets import DEFAULT_MODEL
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.eval.bench import BenchConfig, load_target
from specter.eval.prompts import load_prompts
from specter.plan import drafts
from specter.timing.costs import resolve_timing
from specter.timing.profiles import PROFILES

POLICIES = ("specter", "specter+fixed", "specter-paper+host", "demand-lru", "oracle")
RUN_PROFILES = ("qwen2moe-pcie4", "dsv2lite-pcie4")


def record(out: str, prompts: int, new_tokens: int, window: int) -> int:
    torch.set_num_threads(1)
    model = str(DEFAULT_MODEL)
    draft = load_draft(model + "-awq", mode="dequant-cache")
    chosen = load_prompts(model, None, prompts)
    runs: dict[str, list] = {}
    for profile in RUN_PROFILES:
        timing = resolve_timing(model, "virtual", profile)
        for policy in POLICIES:
            config = BenchConfig(model, model + "-awq", chosen, [profile], [policy], {}, new_tokens=new_tokens,
                                 budget=0.25)
            for i, prompt in enumerate(chosen):
                target = load_target(config, timing, PROFILES[profile], policy)
                try:
                    uses = drafts(policy)
                    engine = Engine(target, draft if uses else None, window if uses else 0)
                    tokens, stats = engine.generate_fresh(prompt, new_tokens)
                finally:
                    target.close()
                runs[f"{profile}/{policy}/{i}"] = [tokens, stats.tpot_s, stats.hits, stats.misses]
            print(f"  {profile} {policy}: {len(chosen)} runs", flush=True)
    with open(out, "w") as f:
        json.dump(runs, f)
    print(f"wrote {len(runs)} runs to {out}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    if set(a) != set(b):
        print(f"different runs: only in {a_path}: {sorted(set(a) - set(b))}; only in {b_path}: {sorted(set(b) - set(a))}")
        return 1
    differ = [k for k in a if a[k] != b[k]]
    for key in differ:
        (ta, sa, ha, ma), (tb, sb, hb, mb) = a[key], b[key]
        print(f"{key}: tokens {'same' if ta == tb else 'DIFFER'}, TPOT {sa * 1e3:.4f} -> {sb * 1e3:.4f} ms, "
              f"hits {ha} -> {hb}, misses {ma} -> {mb}")
    print(f"{len(a) - len(differ)} of {len(a)} runs identical")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run every (profile, policy, prompt) and write the recording")
    rec.add_argument("out")
    rec.add_argument("--prompts", type=int, default=4)
    rec.add_argument("--new-tokens", type=int, default=48)
    rec.add_argument("--window", type=int, default=8, help="K of the drafting policies (specter: its cap)")
    cmp = commands.add_parser("compare", help="compare two recordings exactly")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = parser.parse_args()
    if args.command == "record":
        return record(args.out, args.prompts, args.new_tokens, args.window)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
