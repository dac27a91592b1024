"""``specter bench``: the policies side by side at the published profiles (``specter.eval.bench``), or
with ``--concurrency`` against the number of concurrent requests (``specter.eval.concurrency``).

The harness is imported inside each command (seconds to import here): ``specter --help`` costs none of it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from specter.cli.args import DEFAULT_BENCH_PROFILES
from specter.cli.commands import sampling_config
from specter.config import compute_threads
from specter.plan import POLICIES, policy_class
from specter.timing.profiles import PROFILES


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specter.eval import bench
    from specter.eval.prompts import load_prompts

    if args.concurrency is not None:
        return _concurrency(args, parser)
    if args.kept_choosers:
        parser.error("argument --kept-choosers: only with --concurrency (the side-by-side bench keeps one chooser "
                     "through its prompts already)")

    profiles = [p for p in args.profiles.split(",") if p]
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        parser.error(f"argument --profiles: unknown {unknown}; known: {', '.join(PROFILES)}")
    policies = [p for p in args.policies.split(",") if p]
    for name in policies:
        try:
            policy_class(name)
        except ValueError as exc:
            parser.error(f"argument --policies: {str(exc).removeprefix('policy: ')}")
    windows: dict[str, int] = {}
    for item in args.window:
        name, _, k = item.partition("=")
        if name.split("+")[0] not in POLICIES or not k.isdigit() or not 0 < int(k) <= 64:
            parser.error(f"argument --window: expected POLICY=K with K in 1..64, got {item!r}")
        windows[name] = int(k)
    count, tokens = (3, 16) if args.quick else (args.num_prompts, args.new_tokens)
    if args.actors and args.clock != "wall":
        parser.error("argument --actors: the actors column runs on the wall clock; add --clock wall")
    if args.graphs and args.clock != "as-built":
        parser.error(f"argument --graphs: charges the graphed steps' dispatch on the as-built clock; add --clock "
                     f"as-built (not {args.clock})")
    sampling = sampling_config(args, parser)
    loaded = load_prompts(args.model, args.prompts, count + 2)  # the K scan's two come after the benchmark's
    prompts, scan = loaded[:count], loaded[count:]
    draft = args.draft or str(Path(args.model).with_name(Path(args.model).name + "-awq"))
    budget = args.budget.fraction if args.budget is not None else None
    config = bench.BenchConfig(args.model, draft, prompts, profiles, policies, windows, budget,
                               args.per_layer, tokens)
    if args.quick:
        config.k_candidates = (4, 8)
    config.actors, config.actors_policy = args.actors, args.actors_policy
    config.actors_schedules = tuple(args.actors_schedule.split(","))
    config.actors_via = args.actors_via
    config.clock, config.rho, config.sampling, config.scan_prompts = args.clock, args.rho, sampling, scan
    config.draft_mode, config.graphs = args.draft_mode, args.graphs
    if args.step_s is not None:
        if not args.step_s > 0:
            parser.error(f"argument --step-s: must be > 0 seconds, got {args.step_s}")
        config.step_s = args.step_s
    _threads(args)
    results = bench.run(config)
    written = bench.save(results, Path(args.out))  # first: what ran is kept whatever the report does
    print(bench.table(results))
    print()
    for claim, ok, numbers in bench.bar(results):
        print(f"{'PASS' if ok else 'FAIL'}  {claim}: {numbers}")
    for path in written:
        print(f"wrote {path}")
    return 0


def _concurrency(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``specter bench --concurrency 1,2,4,8``: throughput and latency against concurrent requests."""
    from specter.eval import concurrency
    from specter.eval.prompts import load_prompts

    try:
        counts = [int(n) for n in args.concurrency.split(",") if n]
    except ValueError:
        counts = []
    if not counts or any(n < 1 or n > 64 for n in counts):
        parser.error(f"argument --concurrency: expected comma-separated counts in 1..64, got {args.concurrency!r}")
    policies = [p for p in args.policies.split(",") if p]
    if args.policies == ",".join(POLICIES):  # not given: the baselines and specter
        policies = ["demand-lru", "demand-host", "specter-paper", "specter"]
    windows: dict[str, int] = {}
    for item in args.window:
        name, _, k = item.partition("=")
        if not k.isdigit() or not 0 < int(k) <= 64:
            parser.error(f"argument --window: expected POLICY=K with K in 1..64, got {item!r}")
        windows[name] = int(k)
    profiles = [p for p in args.profiles.split(",") if p]
    if args.profiles == DEFAULT_BENCH_PROFILES:
        profiles = ["mixtral-pcie4", "qwen2moe-pcie4"]
    if args.graphs:
        parser.error("argument --graphs: not with --concurrency (batched steps run eagerly: specter/batching.py)")
    if args.clock not in ("virtual", "as-built", "wall"):
        parser.error(f"argument --clock: --concurrency runs on the virtual, as-built or wall clock, not {args.clock}")
    count, tokens = (3, 16) if args.quick else (args.num_prompts, args.new_tokens)
    config = concurrency.ConcurrencyConfig(
        args.model, load_prompts(args.model, args.prompts, count), profiles, policies, sorted(set(counts)), tokens,
        clock=args.clock, budget=args.budget.fraction if args.budget is not None else None,
        sampling=sampling_config(args, parser), prefill_chunk=args.prefill_chunk, kept=args.kept_choosers,
        draft=args.draft or str(Path(args.model).with_name(Path(args.model).name + "-awq")), windows=windows)
    try:
        concurrency.check(config)
    except ValueError as exc:
        parser.error(f"argument {exc}")
    _threads(args)
    results = concurrency.run(config)
    print(concurrency.table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(results, indent=1))
    (out / "concurrency.md").write_text(concurrency.table(results) + "\n")
    concurrency.plot(results, out / "concurrency.png")
    print(f"wrote {out / 'concurrency.json'}, {out / 'concurrency.md'}, {out / 'concurrency.png'}")
    return 0


def _threads(args: argparse.Namespace) -> None:
    """Virtual figures do not depend on threads: one (unless asked) keeps parallel runs from thrashing."""
    if args.clock in ("virtual", "as-built") and args.threads is None and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(compute_threads(args.threads))
