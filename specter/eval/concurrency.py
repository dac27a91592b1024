"""Throughput and latency against the number of concurrent requests (``specter bench --concurrency``).

For each profile, policy and count N: N clients in a closed loop (each sends its next prompt when its
last one finishes) over the same prompts, continuously batched on one target (``specter/batching.py``;
a drafting policy's speculative rounds batched too; ``specter`` chooses K per round), on the run's clock. Reported per count: throughput (tokens per second of the clock), per-request
TPOT and time to first token (medians), the 99th percentile of the gaps between a request's tokens
(what a joining prompt's prefill stalls), and how much of each MoE layer a step's union of routed
experts covers, with the floor that coverage puts under a step: whatever of the union the slots
cannot hold crosses the link every step (``link_floor_s``), and on the virtual clock the lower
bound on the run's own passes (``specter/bound.py``) as the most throughput any schedule of them could
reach (``bound_tokens_per_s``). The counts are interleaved per policy and every policy runs the same
prompts from the same initial residency.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specter.batching import PREFILL_CHUNK, Batcher
from specter.config import SamplingConfig
from specter.draft.loading import load_draft
from specter.eval.bench import FIXED_DRAFT_MODE, BenchConfig, load_target
from specter.plan import drafts
from specter.request import BatchRequest, trace_bound
from specter.timing.costs import resolve_timing
from specter.timing.profiles import PROFILES


@dataclass
class ConcurrencyConfig:
    """What one concurrency run covers."""

    model: str
    prompts: list[list[int]]
    profiles: list[str]
    policies: list[str] = field(default_factory=lambda: ["demand-lru", "demand-host"])
    counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    new_tokens: int = 32
    requests_per_client: int = 2  # each of the N clients sends this many prompts in turn
    clock: str = "virtual"
    budget: float | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prefill_chunk: int = PREFILL_CHUNK
    draft: str | None = None  # the draft folder, for drafting policies (speculative rounds batched)
    windows: dict[str, int] = field(default_factory=dict)  # K per policy (default: the batcher's)
    # an adaptive policy also runs as "POLICY kept": a restarted server's batcher, going on from the K
    # choosers the policy's fresh run of the same count left (``specter serve`` keeps them between runs)
    kept: bool = False


KEPT = " kept"  # the suffix of a kept row's policy


def check(config: ConcurrencyConfig) -> None:
    """Refuse what this run cannot measure, naming it."""
    drafting = [p for p in config.policies if drafts(p)]
    if drafting and config.draft is None:
        raise ValueError(f"--policies: {', '.join(drafting)} draft; give --draft FOLDER")
    if not config.counts or any(n < 1 for n in config.counts):
        raise ValueError(f"--concurrency: expected counts >= 1, got {config.counts}")
    unknown = [p for p in config.profiles if p not in PROFILES]
    if unknown:
        raise ValueError(f"--profiles: unknown {unknown}; known: {', '.join(PROFILES)}")


def run(config: ConcurrencyConfig, progress: bool = True) -> dict[str, Any]:
    """``{"profiles": {profile: {policy: {count: figures}}}, ...}``."""
    check(config)
    out: dict[str, Any] = {"clock": config.clock, "counts": config.counts, "new_tokens": config.new_tokens,
                           "requests_per_client": config.requests_per_client, "prefill_chunk": config.prefill_chunk,
                           "profiles": {}}
    for name in config.profiles:
        timing = resolve_timing(config.model, config.clock, name)
        profile = PROFILES[name]
        bench = BenchConfig(config.model, "", config.prompts, [name], budget=config.budget)
        rows: dict[str, dict[int, dict[str, float]]] = {p: {} for p in config.policies}
        targets = {p: load_target(bench, timing, profile, p) for p in config.policies}
        draft = None
        if config.draft is not None and any(drafts(p) for p in config.policies):
            draft = load_draft(config.draft, device="cpu", mode=FIXED_DRAFT_MODE)
        try:
            for count in config.counts:
                for policy in config.policies:  # interleaved: machine noise (wall clock) hits every policy alike
                    target = targets[policy]
                    runs = [policy] + ([policy + KEPT] if config.kept and target.offload.policy.adaptive_window
                                       else [])
                    choosers = None
                    for row in runs:
                        target.offload.reset_residency()
                        rows.setdefault(row, {})[count], choosers = _measure(
                            target, config, count, draft if drafts(policy) else None, config.windows.get(policy),
                            choosers)
                        if progress:
                            r = rows[row][count]
                            print(f"  [{name}] {row:12s} N={count:<3d} {r['tokens_per_s']:10.1f} tok/s  "
                                  f"TPOT {r['tpot_s'] * 1e3:8.2f} ms  TTFT {r['ttft_s'] * 1e3:8.2f} ms  "
                                  f"coverage {r['coverage']:.2f}", flush=True)
        finally:
            for target in targets.values():
                target.close()
        out["profiles"][name] = {"rho": timing.rho, "rows": rows}
    return out


def _measure(target: Any, config: ConcurrencyConfig, count: int, draft: Any = None, window: int | None = None,
             choosers: dict[int, dict[str, Any]] | None = None) -> tuple[dict[str, float], dict[int, dict[str, Any]]]:
    """N closed-loop clients on one batcher (its K choosers going on from ``choosers``, when given): the
    figures of every request they sent, and the choosers' states after them."""
    batcher = Batcher(target, max_batch=count, prefill_chunk=config.prefill_chunk, draft=draft, window=window,
                      choosers=choosers)
    total = count * config.requests_per_client
    pending = deque(BatchRequest(config.prompts[i % len(config.prompts)], config.new_tokens, config.sampling)
                    for i in range(total))
    sent: list[BatchRequest] = []

    def send() -> None:
        request = pending.popleft()
        sent.append(request)
        batcher.submit(request)

    coverage: list[float] = []
    experts = target.loaded.num_experts
    costs = getattr(target.clock, "costs", None)  # the bound needs the cost model: virtual clock only
    trace = target.offload.start_trace() if costs is not None else None
    draft_mark = getattr(target.clock, "draft_charged", 0.0)
    start_wall, start = time.perf_counter(), target.clock.now()
    for _ in range(min(count, total)):
        send()
    while True:
        stepped = batcher.step()
        if stepped and batcher.running:
            needed = target.offload.last_needed
            coverage.append(statistics.fmean(len(ids) / experts for ids in needed.values()) if needed else 0.0)
        finished = sum(r.done.is_set() for r in sent)
        while pending and len(sent) - finished < count:
            send()
        if not stepped and not pending and batcher.idle():
            break
    elapsed = target.clock.now() - start
    results = [r.result(0) for r in sent]
    tokens = sum(len(t) for t, _ in results)
    bound_s = 0.0
    if trace is not None and costs is not None:  # no schedule of these passes (chunks, rounds, K) is faster
        target.offload.trace = None
        trace.draft_s = target.clock.draft_charged - draft_mark
        bound_s = trace_bound(target, trace, costs)
    slots = target.offload.pool.num_slots / max(1, len(target.loaded.moe_layers))
    cover = statistics.fmean(coverage) if coverage else 0.0
    missing = max(0.0, cover * experts - slots) * len(target.loaded.moe_layers)
    link = target.link
    gaps = sorted(b - a for r in sent for a, b in zip(r.commits, r.commits[1:], strict=False))
    return {
        "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
        "requests": len(results), "tokens": tokens, "seconds": elapsed, "wall_s": time.perf_counter() - start_wall,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "bound_tokens_per_s": tokens / bound_s if bound_s > 0 else 0.0,
        "tpot_s": statistics.median(s.tpot_s for _, s in results),
        "ttft_s": statistics.median(s.extra["ttft_s"] for _, s in results),
        "mean_batch": statistics.fmean(s.extra["mean_batch"] for _, s in results),
        "window": statistics.fmean(s.extra["window"] for _, s in results), "mean_accepted": statistics.fmean(s.extra["mean_accepted"] for _, s in results),
        "coverage": cover, "hit_rate": statistics.fmean(s.hit_rate for _, s in results),
        "link_floor_s": missing * target.offload.store.shape.nbytes / link.bandwidth if hasattr(link, "bandwidth") else 0.0,
    }, batcher.chooser_states()


def plot(results: dict[str, Any], path: Path, bounds: tuple[str, ...] = ("specter",)) -> Path:
    """Throughput and TPOT against N, one panel pair per profile, × one request (matplotlib, PNG); on
    the virtual clock the bound of the policies in ``bounds`` (dashed: the most any schedule of their
    passes reaches) over their measured throughput at the first N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["profiles"])
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 6.5), squeeze=False)
    for col, name in enumerate(names):
        for policy, rows in results["profiles"][name]["rows"].items():
            by_n = {int(n): row for n, row in rows.items()}  # int keys in a run, strings once saved as JSON
            counts = sorted(by_n)
            one = by_n[counts[0]]
            line, = axes[0][col].plot(counts, [by_n[n]["tokens_per_s"] / one["tokens_per_s"] for n in counts], "o-",
                                      label=policy)
            if policy in bounds and all(by_n[n].get("bound_tokens_per_s") for n in counts):
                axes[0][col].plot(counts, [by_n[n]["bound_tokens_per_s"] / one["tokens_per_s"] for n in counts],
                                  "--", color=line.get_color(), lw=0.9, alpha=0.6)
            axes[1][col].plot(counts, [by_n[n]["tpot_s"] / one["tpot_s"] for n in counts], "o-", label=policy)
        axes[0][col].set_title(f"{name} ({results['clock']} clock)")
        axes[0][col].set_ylabel("throughput, × one request")
        if any(p in bounds for p in results["profiles"][name]["rows"]) and results["clock"] == "virtual":
            axes[0][col].set_title(f"{name} (virtual; dashed: {', '.join(bounds)}'s bound)")
        axes[1][col].set_ylabel("TPOT, × one request")
        axes[1][col].set_xlabel("concurrent requests N")
        for row in axes:
            row[col].axhline(1.0, color="grey", lw=0.8)
            row[col].set_xscale("log", base=2)
            row[col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def table(results: dict[str, Any]) -> str:
    """Markdown: per profile, policy and count: throughput (and × one request), TPOT, TTFT, coverage."""
    lines = [f"clock: {results['clock']}, {results['new_tokens']} new tokens a request, "
             f"{results['requests_per_client']} requests per client, prompts fed {results['prefill_chunk']} tokens a step"]
    for name, block in results["profiles"].items():
        rho = f", rho {block['rho']:.1f}" if block.get("rho") else ""
        lines += ["", f"### {name}{rho}", "",
                  "| policy | K | N | tokens/s | × N=1 | bound tokens/s | TPOT ms | × N=1 | p99 gap ms | TTFT ms | "
                  "mean batch | accepted | experts covered | link floor ms/step |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for policy, rows in block["rows"].items():
            one = rows.get(min(rows))
            for count, r in sorted(rows.items()):
                lines.append(
                    f"| {policy} | {r.get('window', 0):.3g} | {count} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / one['tokens_per_s']:.2f} | "
                    f"{_bound_cell(r)} | "
                    f"{r['tpot_s'] * 1e3:.2f} | {r['tpot_s'] / one['tpot_s']:.2f} | {r['itl_p99_s'] * 1e3:.1f} | "
                    f"{r['ttft_s'] * 1e3:.2f} | "
                    f"{r['mean_batch']:.1f} | {r.get('mean_accepted', 0.0):.2f} | {r['coverage']:.0%} | {r['link_floor_s'] * 1e3:.2f} |")
    return "\n".join(lines)


def _bound_cell(row: dict[str, Any]) -> str:
    """The bound's throughput (an upper bound for the same passes), "–" off the virtual clock."""
    bound = row.get("bound_tokens_per_s", 0.0)
    return f"{bound:.1f}" if bound else "–"
