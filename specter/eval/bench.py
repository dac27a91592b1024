"""The benchmark: every policy on the same prompts, interleaved in one process, per link profile.

By default on the virtual clock (``specter/timing/clock.py``): compute charged from the profile's GPU cost
model, link and host as discrete events, so the ratios do not depend on this machine or its load.
On the wall clock absolute CPU times are noise on a shared machine and the evidence is the ratios
between policies measured side by side in one run. See docs/benchmark.md for the method.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specter.config import ACTORS_VIA, LinkConfig, SamplingConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.generation import bytes_per_token, resident_step_s
from specter.plan import POLICIES, adapts, drafts, policy_class
from specter.target import OffloadedTarget
from specter.timing.costs import Timing, resolve_timing
from specter.timing.dispatch import DEFAULT_DISPATCH
from specter.timing.profiles import PROFILES, Profile

log = logging.getLogger(__name__)

GRAPHS_DISPATCH = "h200-graphs"  # ``graphs``: the calibration of the engine with CUDA graphs (timing/dispatch.py)
FIXED_DRAFT_MODE = "dequant-cache"  # the draft's expert mode off the wall clock (a timed choice varies tokens)
AS_BUILT_DRAFT_MODE = "int4-kernel"  # as built: the draft a profile's memory holds beside its target, in int4
BASELINE = "demand-lru"
ACTORS_POLICY = "specter"  # the full policy, host compute included, through the three actors


def actors_column(policy: str, pipelined: bool, suffix: str = "") -> str:
    """The column of ``policy`` run through the three roles: ``POLICY@actors`` (each round drafted after the
    last) or ``POLICY@pipelined`` (each next round drafted during the verify pass); ``suffix`` names a
    schedule after the first (``-v``: in the verifier)."""
    return f"{policy}@{'pipelined' if pipelined else 'actors'}{suffix}"


ACTORS = actors_column(ACTORS_POLICY, False)  # "specter@actors"
PIPELINED = actors_column(ACTORS_POLICY, True)  # "specter@pipelined"
SCHEDULES = ("transfer", "verifier")  # where the actors' schedule runs (actors/verifier.py)
RIVALS = ("specter-paper", "specmoeoff", "demand-host", "specter-paper+host", "specmoeoff+host")


@dataclass
class BenchConfig:
    """What one benchmark run covers."""

    model: str
    draft: str
    prompts: list[list[int]]
    profiles: list[str]
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    windows: dict[str, int] = field(default_factory=dict)
    budget: float | None = None  # device slots, fraction of routed experts; None: each profile's own
    per_layer: bool = False
    new_tokens: int = 128
    k_candidates: tuple[int, ...] = (2, 4, 6, 8, 12, 16, 20, 24, 32)
    actors: bool = False  # also run ``actors_policy`` through the three roles (columns "POLICY@actors", "@pipelined")
    actors_policy: str = ACTORS_POLICY  # the policy of the actors' columns (its in-process column is the reference)
    actors_schedules: tuple[str, ...] = ("transfer",)  # one pair of actors' columns each (the first unsuffixed)
    actors_via: str = "ray"  # the actors' columns through Ray actors, or "processes": plain ones (remote/processes.py)
    step_s: float | None = None  # this machine's all-resident step time (wall, measured); None: measure it
    clock: str = "virtual"  # wall | virtual | as-built | measured (specter/timing/clock.py)
    graphs: bool = False  # as-built: the steps a GPU replays as CUDA graphs, made ready first (``GRAPHS_DISPATCH``)
    rho: float | None = None  # every profile's link set to this offload pressure; None: the profile's own
    draft_mode: str | None = None  # the draft's expert mode; None: auto on the wall clock, else fixed
    scan_prompts: list[list[int]] = field(default_factory=list)  # the K scan's (None: the first two)
    scanned: dict[str, int] = field(default_factory=dict)  # base policy → K its scan found (filled by run)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


def check(config: BenchConfig) -> None:
    """Settings that cannot run together, named (a ``ValueError``)."""
    if config.actors and config.clock != "wall":
        raise ValueError(f"bench: the actors column runs on the wall clock; use --clock wall, not {config.clock!r}")
    if config.actors_via not in ACTORS_VIA:
        raise ValueError(f"actors_via: expected {' or '.join(ACTORS_VIA)}, got {config.actors_via!r}")
    if config.graphs and config.clock != "as-built":
        raise ValueError(f"graphs: the graphed steps' dispatch is what the as-built clock charges; use --clock "
                         f"as-built, not {config.clock!r} (other clocks charge no dispatch, or time this CPU's "
                         f"eager run of the pieces)")


def step_mode(config: BenchConfig) -> str:
    """How the target's and the draft's steps run: the pieces a GPU graphs, run eagerly (``graphs``), or
    as they run here by default (``models/graphed.py``)."""
    return "static" if config.graphs else "auto"


def budget_fraction(config: BenchConfig, profile: Profile) -> float:
    """The device's expert slots under ``profile``, as a fraction: the run's if given, else the profile's."""
    return profile.budget if config.budget is None else config.budget


def budget_for(config: BenchConfig, profile: Profile) -> SlotConfig:
    """The device's expert slots under ``profile``."""
    return SlotConfig(fraction=budget_fraction(config, profile), per_layer=config.per_layer)


def load_target(config: BenchConfig, timing: Timing, profile: Profile, policy: str) -> OffloadedTarget:
    """A target for ``policy`` at the profile's budget, on its own clock, with the profile's link and host."""
    target = OffloadedTarget.load(config.model, budget_for(config, profile), timing.link, policy,
                                  clock=timing.make_clock(), step=step_mode(config))
    target.offload.set_host(timing.host)
    return target


def timings(config: BenchConfig) -> tuple[dict[str, Timing], float | None, int | None]:
    """Each profile's clock, link and host; on the wall and measured clocks also this CPU's
    all-resident step and bytes per fully-missed token (measured once, shared by the profiles)."""
    step_s = per_token = None
    if config.clock not in ("virtual", "as-built"):
        if config.step_s is None:
            step_s, per_token = resident_step_s(config.model, config.prompts[0])
        else:  # several runs sharing one measured step share one simulated link and host
            step_s, per_token = config.step_s, bytes_per_token(config.model)
    dispatch = GRAPHS_DISPATCH if config.graphs else DEFAULT_DISPATCH
    out = {name: resolve_timing(config.model, config.clock, name, rho=config.rho, step_s=step_s, dispatch=dispatch)
           for name in config.profiles}
    return out, step_s, per_token


def _scan_base(policy: str) -> str:
    """Whose K scan serves ``policy``: its base policy's; the oracle runs specter's schedule, so specter's."""
    base = policy.split("+")[0]
    return "specter" if base == "oracle" else base


def window_of(config: BenchConfig, policy: str) -> int:
    """K for ``policy``: given for it or its base policy, else profiled, else its default. For a
    policy that chooses K per round (``specter``) this is the cap of its choice: never scanned."""
    if policy in config.windows:
        return config.windows[policy]
    if adapts(policy):
        return config.windows.get(policy.split("+")[0], policy_class(policy).default_window)
    base = _scan_base(policy)
    return config.windows.get(base, config.scanned.get(base, policy_class(policy).default_window))


def as_built_draft(config: BenchConfig) -> Any:
    """The draft on the as-built clock: in int4 where every expert takes the kernel (a step's pairs
    gathered, as a real model's draft must be to fit beside its target); else the dequantized cache,
    said so (a full-precision draft folder: itself)."""
    try:
        draft = load_draft(config.draft, mode=AS_BUILT_DRAFT_MODE, step=step_mode(config))
    except ValueError as exc:  # the steps a GPU graphs need every layer gathered
        reason = str(exc)
    else:
        kernels = getattr(draft, "kernels", None)
        if kernels is None or (kernels.gathered and not kernels.kernel_fallbacks):
            return draft
        reason = f"{kernels.kernel_fallbacks} projections outside its shapes, {len(kernels.gathered)} layers gathered"
        draft.close()
    log.warning("bench: the draft's experts do not all take the int4 kernel (%s); as built with %s instead",
                reason, FIXED_DRAFT_MODE)
    return load_draft(config.draft, mode=FIXED_DRAFT_MODE, step=step_mode(config))


def run(config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run every policy × prompt for every profile; returns the JSON-able results."""
    check(config)
    per_profile, step_s, per_token = timings(config)
    if config.draft_mode is None and config.clock == "as-built":
        draft = as_built_draft(config)
    else:
        mode = config.draft_mode or ("auto" if config.clock == "wall" else FIXED_DRAFT_MODE)
        draft = load_draft(config.draft, mode=mode, step=step_mode(config))
    dispatch = per_profile[config.profiles[0]].dispatch
    results: dict[str, Any] = {"clock": config.clock, "graphs": config.graphs,
                               "dispatch": dispatch.describe() if dispatch is not None else None,
                               "step_s": step_s, "bytes_per_token": per_token,
                               "draft_mode": getattr(draft, "mode", None), "rho_override": config.rho,
                               "temperature": config.sampling.temperature, "top_p": config.sampling.top_p,
                               "actors_policy": config.actors_policy, "actors_schedules": list(config.actors_schedules),
                               "actors_via": config.actors_via,
                               "profiles": {}}
    first = PROFILES[config.profiles[0]]
    for base in ("specter-paper", "specter"):  # K per model by profiling, as the paper does
        # The base policy's K serves its `+option` variants (and specter's the oracle's); scan the
        # base if it runs at a fixed K, else the first such variant (a `+host` rival alone is
        # scanned too, not left at its default). A policy choosing K per round needs no scan.
        variants = [p for p in config.policies if _scan_base(p) == base and not adapts(p)]
        if variants and base not in config.windows:
            policy = base if base in variants else variants[0]
            if policy.startswith("oracle"):
                policy = "specter+fixed"
            config.scanned[base], scan, recall = profile_window(config, draft, first, policy,
                                                                per_profile[first.name])
            results.setdefault("window_scan", {})[policy] = scan
            results.setdefault("window_recall", {})[policy] = recall
            log.info("%s: K = %d (TPOT by K: %s)", policy, config.scanned[base], scan)
    results["windows"] = {p: window_of(config, p) for p in config.policies}
    for name in config.profiles:
        profile, timing = PROFILES[name], per_profile[name]
        budget = budget_fraction(config, profile)
        log.info("profile %s: %s, budget %.0f%%", name, timing.describe(), budget * 100)
        runs = _run_profile(config, draft, timing, progress, profile)
        results["profiles"][name] = {"rho": timing.rho, "eta": profile.eta, "rho_host": profile.rho_host,
                                     "draft_ratio": profile.draft_ratio, "gpu_step_s": profile.step_s,
                                     "budget": budget, "link_bytes_per_s": timing.link.bandwidth,
                                     "runs": runs, "summary": summarize(runs)}
    return results


def profile_window(
    config: BenchConfig, draft: Any, profile: Profile, policy: str, timing: Timing,
) -> tuple[int, dict[int, float], dict[int, float]]:
    """The K of lowest median TPOT for ``policy`` on two prompts (a short profiling run), the
    median TPOT at every K scanned, and the mean prediction recall at every K."""
    target = load_target(config, timing, profile, policy)
    scan: dict[int, float] = {}
    recall: dict[int, float] = {}
    try:
        for k in config.k_candidates:
            engine = ready(config, Engine(target, draft, k, untimed_prefill=True))
            stats = [engine.generate_fresh(p, min(32, config.new_tokens), config.sampling)[1]
                     for p in config.scan_prompts or config.prompts[:2]]
            scan[k] = statistics.median(s.tpot_s for s in stats)
            recall[k] = statistics.mean(float(s.extra.get("recall", 0.0)) for s in stats)
    finally:
        target.close()
    return min(scan, key=lambda k: scan[k]), scan, recall


def _run_profile(config: BenchConfig, draft: Any, timing: Timing, progress: bool, profile: Profile) -> dict:
    name = profile.name
    budget = budget_for(config, profile)
    targets = {p: load_target(config, timing, profile, p) for p in config.policies}
    runs: dict[str, list[dict]] = {p: [] for p in config.policies}
    mode = getattr(draft, "mode", None) or "auto"  # the actors' draft computes as the in-process one does
    handle, owns_ray = _launch_actors(config, timing.link, budget, name, mode) if config.actors else (None, False)
    columns = actor_columns(config) if handle is not None else []
    for column, _, _ in columns:
        runs[column] = []
    t0 = time.perf_counter()
    try:
        for i, prompt in enumerate(config.prompts):
            for policy in config.policies:  # interleaved: machine noise hits every policy alike
                window = window_of(config, policy)
                use_draft = draft if drafts(policy) else None
                engine = ready(config, Engine(targets[policy], use_draft, window if use_draft else 0,
                                              untimed_prefill=True))
                _, stats = engine.generate_fresh(prompt, config.new_tokens, config.sampling)
                runs[policy].append(stats.to_dict())
            if handle is not None:  # the same policy and window, through the actors, same prompt
                window = window_of(config, config.actors_policy)
                for column, schedule, pipelined in columns:
                    out = handle.generate(prompt, config.new_tokens, window=window, policy=config.actors_policy,
                                          untimed_prefill=True, temperature=config.sampling.temperature,
                                          top_p=config.sampling.top_p, seed=config.sampling.seed,
                                          pipelined=pipelined, schedule=schedule)
                    runs[column].append(out["stats"])
            if progress:
                done = i + 1
                eta = (time.perf_counter() - t0) / done * (len(config.prompts) - done)
                print(f"  [{name}] prompt {done}/{len(config.prompts)}  ETA {eta:5.0f}s", flush=True)
    finally:
        for target in targets.values():
            target.close()
        if handle is not None:
            handle.shutdown()
            if owns_ray:
                import ray

                ray.shutdown()
    return runs


def ready(config: BenchConfig, engine: Engine) -> Engine:
    """``engine`` with every token count its rounds can use made ready (``Engine.prepare_steps``) where the
    run charges graphed steps: a GPU captures them once, before any request, and so does no timed run
    here (a count already ready is left as it is)."""
    if config.graphs:
        engine.prepare_steps()
    return engine


def actor_columns(config: BenchConfig) -> list[tuple[str, str, bool]]:
    """(column, schedule, pipelined) of the actors' runs: ``POLICY@actors`` and ``POLICY@pipelined`` (POLICY
    the ``actors_policy``) for the first schedule, the same with ``-v`` for the schedule in the verifier after it."""
    for schedule in config.actors_schedules:
        if schedule not in SCHEDULES:
            raise ValueError(f"actors_schedules: expected {' or '.join(SCHEDULES)}, got {schedule!r}")
    columns = []
    for i, schedule in enumerate(config.actors_schedules):
        suffix = "" if i == 0 else "-" + schedule[0]
        columns += [(actors_column(config.actors_policy, pipelined, suffix), schedule, pipelined)
                    for pipelined in (False, True)]
    return columns


def _launch_actors(
    config: BenchConfig, link: LinkConfig, budget: SlotConfig, profile: str, draft_mode: str
) -> tuple[Any, bool]:
    """One engine trio on a local Ray (started here if none is running), or as plain processes
    (``actors_via``: the same roles, sockets and shared memory without Ray); whether Ray was started here."""
    if config.actors_via == "processes":
        from specter.remote.processes import launch_processes

        return launch_processes(config.model, config.draft, budget, link, policy=config.actors_policy,
                                host_profile=profile, draft_mode=draft_mode), False
    import ray

    from actors.cluster import start_local
    from actors.launcher import launch

    started = not ray.is_initialized()
    if started:  # a local Ray for this profile, shut down with the trio
        start_local(2, log_to_driver=False)
    handle = launch(config.model, config.draft, budget, link, policy=config.actors_policy, host_profile=profile,
                    draft_mode=draft_mode)
    return handle, started


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Median TPOT per policy, speedups, and the mean of every other figure."""
    base = statistics.median(r["tpot_s"] for r in runs[BASELINE]) if BASELINE in runs else None
    out: dict[str, dict[str, Any]] = {}
    for policy, items in runs.items():
        tpot = statistics.median(r["tpot_s"] for r in items)
        tokens = sum(r["new_tokens"] for r in items)
        out[policy] = {
            "tpot_s": tpot,
            "speedup": base / tpot if base else float("nan"),
            "hit_rate": statistics.mean(r["hit_rate"] for r in items),
            "misses_per_token": sum(r["misses"] for r in items) / tokens,
            "mb_per_token": sum(r["bytes_moved"] for r in items) / tokens / 1e6,
            "link_busy": statistics.mean(r["link_busy_fraction"] for r in items),
            "recall": statistics.mean(r.get("recall", 0.0) for r in items),
            "accepted": statistics.mean(r.get("mean_accepted", 0.0) for r in items),
            "wait_s_per_token": sum(r["wait_s"] for r in items) / tokens,
            "draft_s_per_token": sum(r.get("draft_s", 0.0) for r in items) / tokens,
            "verify_s_per_token": sum(r.get("verify_s", 0.0) for r in items) / tokens,
            "host_per_token": sum(r.get("host_experts", 0) for r in items) / tokens,
            "host_s_per_token": sum(r.get("host_s", 0.0) for r in items) / tokens,
            "host_wait_s_per_token": sum(r.get("host_wait_s", 0.0) for r in items) / tokens,
            "window": items[0].get("window", 0),
            "bound_tpot_s": (statistics.median(r["bound_tpot_s"] for r in items)
                             if all(r.get("bound_tpot_s") is not None for r in items) else None),
            "mean_window": statistics.mean(r.get("mean_window", r.get("window", 0)) for r in items),
        }
        if items[0].get("pipelined"):
            for name in ("ahead_asked", "ahead_kept", "ahead_dropped"):
                out[policy][name] = sum(r.get(name, 0) for r in items)
    return out


def per_prompt(runs: dict[str, list[dict]], policy: str, against: str) -> dict[str, float]:
    """``policy``'s TPOT over ``against``'s prompt by prompt (one run: the same prompts in order): the ratio
    of medians the table shows beside the median and geometric mean of the per-prompt ratios, the ratio
    of the summed TPOTs, the range, and how many prompts were faster or slower by more than 1 %."""
    for name in (policy, against):
        if name not in runs:
            raise ValueError(f"policy {name!r} is not in this run (it has {', '.join(runs)})")
    mine = [r["tpot_s"] for r in runs[policy]]
    theirs = [r["tpot_s"] for r in runs[against]]
    if len(mine) != len(theirs) or not mine:
        raise ValueError(f"{policy} has {len(mine)} prompts and {against} {len(theirs)}: not one run's pairs")
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {
        "prompts": len(ratios),
        "ratio_of_medians": statistics.median(mine) / statistics.median(theirs),
        "median_ratio": statistics.median(ratios),
        "geometric_mean": statistics.geometric_mean(ratios),
        "ratio_of_sums": sum(mine) / sum(theirs),
        "best": min(ratios),
        "worst": max(ratios),
        "faster": sum(r < 0.99 for r in ratios),
        "slower": sum(r > 1.01 for r in ratios),
    }


def _per_prompt_line(runs: dict[str, list[dict]]) -> str | None:
    """``specter`` against the run's fastest other policy by median (not the oracle, not its own runs through
    the actors), prompt by prompt; None without both or with a single prompt."""
    others = {p: statistics.median(r["tpot_s"] for r in items) for p, items in runs.items()
              if p != "specter" and "@" not in p and not p.startswith("oracle") and items}
    if "specter" not in runs or not others or len(runs["specter"]) < 2:
        return None
    rival = min(others, key=lambda p: others[p])
    s = per_prompt(runs, "specter", rival)
    return (f"specter per prompt over {rival} (the fastest other policy): geometric mean {s['geometric_mean']:.3f}x, "
            f"{s['best']:.2f}-{s['worst']:.2f}x, faster on {s['faster']} and slower on {s['slower']} of "
            f"{s['prompts']} prompts by more than 1 %")


def table(results: dict[str, Any]) -> str:
    """The side-by-side table, one block per profile."""
    lines = []
    for name, block in results["profiles"].items():
        host = f", host eta {block['eta']:.2f}" if "eta" in block else ""
        budget = f", budget {block['budget']:.0%}" if "budget" in block else ""
        draft = f", draft/target {block['draft_ratio']:.2f}" if "draft_ratio" in block else ""
        clock = results.get("clock", "wall") + (" clock, graphed steps" if results.get("graphs") else " clock")
        via = "; actors' columns: the roles as plain processes" if results.get("actors_via") == "processes" else ""
        lines.append(f"\nprofile {name} ({clock}, rho {block['rho']:.1f}{host}{draft}"
                     f"{budget}, link {block['link_bytes_per_s'] / 1e6:.2f} MB/s{via})")
        width = max([18] + [len(p) + 1 for p in block["summary"]])  # the longest name and a space
        lines.append(f"{'policy':<{width}}{'K':>3}{'K avg':>6}{'TPOT ms':>10}{'speedup':>9}{'hit':>7}{'miss/tok':>10}"
                     f"{'host/tok':>9}{'MB/tok':>8}{'busy':>7}{'recall':>8}{'accept':>8}"
                     + (f"{'bound ms':>9}" if results.get("clock") in ("virtual", "as-built") else ""))
        for policy, s in block["summary"].items():
            speedup = f"{s['speedup']:>8.2f}x" if s["speedup"] == s["speedup"] else f"{'-':>9}"  # NaN: no baseline
            lines.append(f"{policy:<{width}}{s['window']:>3}{s.get('mean_window', s['window']):>6.1f}{s['tpot_s'] * 1e3:>10.2f}{speedup}"
                         f"{s['hit_rate']:>7.2f}{s['misses_per_token']:>10.2f}{s.get('host_per_token', 0.0):>9.2f}"
                         f"{s['mb_per_token']:>8.2f}{s['link_busy']:>7.0%}{s['recall']:>8.2f}{s['accepted']:>8.2f}"
                         + (f"{s['bound_tpot_s'] * 1e3:>9.2f}" if s.get("bound_tpot_s") is not None else ""))
        for suffix in ("", "-v", "-t"):
            piped_column = _actors_row(block["summary"], results, True, suffix)
            plain_column = _actors_row(block["summary"], results, False, suffix)
            if piped_column is not None and plain_column is not None and "ahead_asked" in piped_column[1]:  # it drafts
                (piped_name, piped), (plain_name, plain) = piped_column, plain_column
                gain = plain["tpot_s"] / piped["tpot_s"]
                lines.append(f"{piped_name}: {gain:.2f}x the TPOT of {plain_name}; rounds drafted "
                             f"ahead {piped['ahead_kept']}/{piped['ahead_asked']} stood, {piped['ahead_dropped']} "
                             "draft steps of the others reached the verifier (none of their plans moved a byte)")
        line = _per_prompt_line(block.get("runs", {}))
        if line is not None:
            lines.append(line)
        if block["summary"].get("specter", {}).get("bound_tpot_s") is not None:
            lines.append(f"{'bound':<{width}}{'':>9}{block['summary']['specter']['bound_tpot_s'] * 1e3:>10.2f}"
                         "   (no schedule of specter's rounds beats it: docs/benchmark.md)")
    return "\n".join(lines)


def _actors_row(summary: dict[str, dict], results: dict[str, Any], pipelined: bool,
                suffix: str = "") -> tuple[str, dict] | None:
    """(column, row) of the run's actors' column, if it has one: ``POLICY@actors`` / ``POLICY@pipelined``, or
    as results of 2026-12-06 and before named them whatever the policy, ``specter@…``."""
    policy = results.get("actors_policy", ACTORS_POLICY)
    for name in dict.fromkeys((actors_column(policy, pipelined, suffix), actors_column(ACTORS_POLICY, pipelined, suffix))):
        if name in summary:
            return name, summary[name]
    return None


def _in_process(summary: dict[str, dict], policy: str, pipelined: bool) -> str | None:
    """The in-process run of ``policy`` that drafts as an actors' column does — each next round during the
    verify pass (``pipelined``, the engine's default since ca79b58) or after it (``+nopipe``) — if the run
    has one: the actors' ``POLICY@actors`` column drafts unpipelined, ``POLICY@pipelined`` pipelined."""
    for name in (policy, f"{policy}+nopipe"):
        row = summary.get(name)
        if row is not None and ("ahead_asked" in row) == pipelined:
            return name
    return None


def bar(results: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The bar Specter must clear, each line (claim, passed, numbers)."""
    checks = []
    at_2x = []
    policy = results.get("actors_policy", ACTORS_POLICY)  # the actors' columns' (the run's, not a profile's)
    via = " (plain processes)" if results.get("actors_via") == "processes" else ""
    for name, block in results["profiles"].items():
        s = block["summary"]
        for pipelined, label in ((False, "actors"), (True, "pipelined actors")):
            column = _actors_row(s, results, pipelined)
            reference = _in_process(s, policy, pipelined)  # the same policy in process, drafting as the column does
            if column is not None and reference is not None:
                over = column[1]["tpot_s"] / s[reference]["tpot_s"] - 1
                checks.append((f"[{name}] {label}{via} overhead <= 5% of TPOT (against {reference} in process)",
                               over <= 0.05, f"{over:+.1%}"))
        if "specter" not in s:
            continue
        sp = s["specter"]
        at_2x.append((name, sp["speedup"]))
        for rival in RIVALS:
            if rival in s:
                ratio = s[rival]["tpot_s"] / sp["tpot_s"]
                checks.append((f"[{name}] specter >= 1.2x faster than {rival}", ratio >= 1.2, f"{ratio:.2f}x"))
        if "oracle" in s:
            ratio = sp["tpot_s"] / s["oracle"]["tpot_s"]
            checks.append((f"[{name}] specter within 1.15x of oracle", ratio <= 1.15, f"{ratio:.2f}x"))
        if sp.get("bound_tpot_s"):
            ratio = sp["tpot_s"] / sp["bound_tpot_s"]
            checks.append((f"[{name}] specter within 1.15x of its bound", ratio <= 1.15, f"{ratio:.2f}x"))
        best = min((s[p]["tpot_s"] for p in ("demand-lru", "demand-host") if p in s), default=None)
        if best is not None:
            ratio = sp["tpot_s"] / best
            checks.append((f"[{name}] specter never above 1.02x the best of demand-lru, demand-host",
                           ratio <= 1.02, f"{ratio:.2f}x"))
        checks.append((f"[{name}] prediction recall >= 0.9", sp["recall"] >= 0.9, f"{sp['recall']:.2f}"))
    at_2x = [(n, x) for n, x in at_2x if x == x]  # NaN: demand-lru was not in the run
    passed = [n for n, x in at_2x if x >= 2.0]
    numbers = ", ".join(f"{n}: {x:.2f}x" for n, x in at_2x)
    if at_2x:
        checks.insert(0, ("specter >= 2.0x faster than demand-lru under >= 2 profiles", len(passed) >= 2, numbers))
    return checks


def save(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.json plus PNG plots; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1))
    from specter.eval.plots import plot_all

    return [path, *plot_all(results, out_dir)]
