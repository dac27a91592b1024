"""Actors vs in-process TPOT on one checkpoint: ``python scripts/actors_overhead.py MODEL [DRAFT]``.

A first look at the plan plane's cost (docs/actors.md); ``specter bench --clock wall --actors`` is the full one.
Prints one JSON object: median TPOT (seconds) per (mode, policy).
"""

from __future__ import annotations

import argparse
import json
import statistics

import ray
import torch

from actors.cluster import start_local
from actors.launcher import launch
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.target import OffloadedTarget

PROMPT = [5, 99, 17, 42, 8, 63, 21]
CASES = (("demand-lru", 0), ("specter", 4))


def _in_process(args: argparse.Namespace, budget: SlotConfig, link: LinkConfig) -> dict[str, float]:
    out = {}
    for policy, k in CASES:
        target = OffloadedTarget.load(args.model, budget, link, policy=policy)
        try:
            engine = Engine(target, load_draft(args.draft, device="cpu") if k else None, k)
            engine.generate_fresh(PROMPT, 4)
            out[policy] = statistics.median(
                engine.generate_fresh(PROMPT, args.tokens)[1].tpot_s for _ in range(args.repeats)
            )
        finally:
            target.close()
    return out


def _actors(args: argparse.Namespace, budget: SlotConfig, link: LinkConfig) -> dict[str, float]:
    handle = launch(args.model, args.draft, budget, link, policy=CASES[0][0])
    out = {}
    try:
        for policy, k in CASES:
            handle.generate(PROMPT, 4, policy=policy, window=k)
            runs = [handle.generate(PROMPT, args.tokens, policy=policy, window=k) for _ in range(args.repeats)]
            out[policy] = statistics.median(r["stats"]["tpot_s"] for r in runs)
    finally:
        handle.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("draft", nargs="?")
    parser.add_argument("--budget", default="0.25")
    parser.add_argument("--link", default="sim:2,5")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.draft = args.draft or args.model
    torch.set_num_threads(1)
    budget, link = SlotConfig.parse(args.budget), LinkConfig.parse(args.link)
    result = {"in_process": _in_process(args, budget, link)}
    start_local(2, log_to_driver=False)
    try:
        result["actors"] = _actors(args, budget, link)
    finally:
        ray.shutdown()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
