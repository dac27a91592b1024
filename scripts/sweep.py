"""Sweeps on the virtual clock: ρ, budget, and the machine (host→device link × host memory).

    python scripts/sweep.py rho --rhos 1,3,10,30,100 --budget 0.25
    python scripts/sweep.py budget --budgets 0.125,0.25,0.5,0.75
    python scripts/sweep.py machine --links pcie3,pcie4,pcie5,c2c --hosts ddr4,ddr5,lpddr5x --budgets 0.125,0.4
    python scripts/sweep.py grid --rhos 1,3,10,30,100 --budgets 0.125,0.25,0.5,0.75
    python scripts/sweep.py grid --num-prompts 8 --skip-prompts 8      # the same on the next 8 prompts

Every point is one ``specter bench`` run (same prompts, policies interleaved) on the virtual clock,
so a sweep takes minutes and its figures do not depend on this machine's load. ``machine`` keeps
the profile's GPU and model and swaps its link and host CPU (docs/profiles.md derives each one);
it prints the speedup of each policy over ``demand-lru`` and over ``demand-host`` and plots speedup
against link bandwidth. ``grid`` runs every ρ × budget and prints, per cell, ``specter``'s TPOT over
the best of ``demand-lru`` and ``demand-host`` (the adaptive window's promise: never above 1.02)
and over its own bound. Results go to ``--out`` as JSON (and PNG for ``machine`` and ``grid``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specter.assets import DEFAULT_MODEL
from specter.eval import bench
from specter.eval.prompts import load_prompts
from specter.plan import adapts
from specter.timing.profiles import GB, PROFILES, TFLOPS, Host

# Host→device links, pinned copies as achieved in practice (docs/profiles.md).
LINKS = {
    "pcie3": ("PCIe 3.0 x16", 12 * GB),
    "pcie4": ("PCIe 4.0 x16", 25 * GB),
    "pcie5": ("PCIe 5.0 x16", 50 * GB),
    "c2c": ("NVLink-C2C (Grace Hopper)", 0.8 * 450 * GB),
}
# Host CPUs and their memory: DRAM peak × 0.5 for a batch-1 GEMV, fp32 FMA peak × 0.3.
HOSTS = {
    "ddr4": Host("AMD EPYC 7763, 8x DDR4-3200", 0.5 * 204.8 * GB, 0.3 * 5.0 * TFLOPS),
    "ddr5": Host("Intel Xeon Platinum 8480+, 8x DDR5-4800", 0.5 * 307.2 * GB, 0.3 * 7.2 * TFLOPS),
    # Grace: 72 Neoverse V2 cores × 3.1 GHz × 32 fp32 flops/cycle (4 × 128-bit FMA) = 7.1 TFLOPS;
    # LPDDR5X 480 GB/s (the 480 GB configuration's published bandwidth).
    "lpddr5x": Host("NVIDIA Grace, LPDDR5X", 0.5 * 480 * GB, 0.3 * 7.1 * TFLOPS),
}
POLICIES = "demand-lru,demand-host,specter-paper+host,specter"


def _config(args: argparse.Namespace, profiles: list[str], budget: float | None, rho: float | None) -> bench.BenchConfig:
    held_out = load_prompts(args.model, None, args.skip_prompts + args.num_prompts)
    if len(held_out) < args.skip_prompts + args.num_prompts:
        raise SystemExit(f"--skip-prompts {args.skip_prompts} --num-prompts {args.num_prompts}: the held-out set has "
                         f"only {len(held_out)} prompts")
    prompts = held_out[args.skip_prompts:]
    policies = [p for p in args.policies.split(",") if p]
    windows = {p: args.window for p in policies if bench.drafts(p) and not adapts(p)}  # adaptive: its own cap
    config = bench.BenchConfig(args.model, args.model + "-awq", prompts, profiles, policies, windows, budget,
                               new_tokens=args.new_tokens)
    config.rho = rho
    return config


def _point(config: bench.BenchConfig) -> dict[str, Any]:
    results = bench.run(config, progress=False)
    return {name: {"rho": block["rho"], "budget": block["budget"],
                   "tpot_ms": {p: s["tpot_s"] * 1e3 for p, s in block["summary"].items()}}
            for name, block in results["profiles"].items()}


def _print_rows(title: str, rows: list[tuple[str, dict[str, float]]]) -> None:
    policies = list(rows[0][1])
    print(f"\n{title}\n{'point':<28}" + "".join(f"{p:>20}" for p in policies)
          + f"{'best baseline/specter':>23}")
    for label, tpot in rows:
        best = min(tpot.get("demand-lru", float("inf")), tpot.get("demand-host", float("inf")))
        ratio = best / tpot["specter"] if "specter" in tpot else float("nan")
        print(f"{label:<28}" + "".join(f"{tpot[p]:>17.2f} ms" for p in policies) + f"{ratio:>22.2f}x")


def sweep_rho(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for rho in (float(x) for x in args.rhos.split(",")):
        out[rho] = _point(_config(args, [args.profile], args.budget, rho))[args.profile]
    _print_rows(f"rho sweep ({args.profile}, budget {args.budget or PROFILES[args.profile].budget:.0%}, virtual clock)",
                [(f"rho {rho:g}", p["tpot_ms"]) for rho, p in out.items()])
    return out


def sweep_budget(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for budget in (float(x) for x in args.budgets.split(",")):
        out[budget] = _point(_config(args, [args.profile], budget, args.rho))[args.profile]
    _print_rows(f"budget sweep ({args.profile}, rho {out[next(iter(out))]['rho']:.1f}, virtual clock)",
                [(f"budget {b:.1%}", p["tpot_ms"]) for b, p in out.items()])
    return out


def sweep_grid(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rhos = [float(x) for x in args.rhos.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    for budget in budgets:
        for rho in rhos:
            results = bench.run(_config(args, [args.profile], budget, rho), progress=False)
            summary = results["profiles"][args.profile]["summary"]
            point = {"rho": rho, "budget": budget,
                     "tpot_ms": {p: s["tpot_s"] * 1e3 for p, s in summary.items()},
                     "bound_ms": {p: s["bound_tpot_s"] * 1e3 for p, s in summary.items() if s.get("bound_tpot_s")},
                     "mean_window": {p: s["mean_window"] for p, s in summary.items()}}
            out[f"{rho:g}@{budget:g}"] = point
            t = point["tpot_ms"]
            print(f"  rho {rho:g} budget {budget:.1%}: " + ", ".join(f"{p} {v:.2f} ms" for p, v in t.items()), flush=True)
    print(f"\ngrid ({args.profile}, virtual clock): specter TPOT / best of demand-lru, demand-host"
          " | specter TPOT / its bound | specter's mean K")
    print(f"{'budget':<8}" + "".join(f"{f'rho {r:g}':>26}" for r in rhos))
    worst = 0.0
    for budget in budgets:
        cells = []
        for rho in rhos:
            p = out[f"{rho:g}@{budget:g}"]
            ratio = p["tpot_ms"]["specter"] / min(p["tpot_ms"]["demand-lru"], p["tpot_ms"]["demand-host"])
            worst = max(worst, ratio)
            cells.append(f"{ratio:.2f}x | {p['tpot_ms']['specter'] / p['bound_ms']['specter']:.2f}x | "
                         f"{p['mean_window']['specter']:4.1f}")
        print(f"{budget:<8.1%}" + "".join(f"{c:>26}" for c in cells))
    print(f"worst specter / best baseline: {worst:.3f}x (promise: <= 1.02x)")
    _plot_grid(out, rhos, budgets, Path(args.out))
    return out


def _plot_grid(out: dict[str, Any], rhos: list[float], budgets: list[float], folder: Path) -> None:
    """Specter's TPOT over the best non-speculative baseline's, and over its bound, against ρ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, budget in enumerate(budgets):
        points = [out[f"{rho:g}@{budget:g}"] for rho in rhos]
        best = [min(p["tpot_ms"]["demand-lru"], p["tpot_ms"]["demand-host"]) for p in points]
        axes[0].plot(rhos, [p["tpot_ms"]["specter"] / b for p, b in zip(points, best, strict=True)], marker="o",
                     color=f"C{i}", label=f"budget {budget:.1%}")
        axes[1].plot(rhos, [p["tpot_ms"]["specter"] / p["bound_ms"]["specter"] for p in points], marker="o",
                     color=f"C{i}", label=f"budget {budget:.1%}")
    axes[0].axhline(1.02, color="grey", ls="--", lw=0.8, label="1.02")
    axes[0].set_ylabel("specter TPOT / best of demand-lru, demand-host")
    axes[1].axhline(1.15, color="grey", ls="--", lw=0.8, label="1.15")
    axes[1].set_ylabel("specter TPOT / its bound")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("rho (a fully-missed token's transfers / all-resident step)")
        ax.legend(fontsize=7)
    fig.suptitle("adaptive window, virtual clock")
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / "grid.png", dpi=120)


def sweep_machine(args: argparse.Namespace) -> dict[str, Any]:
    base = PROFILES[args.profile]
    out: dict[str, Any] = {}
    for budget in (float(x) for x in args.budgets.split(",")):
        for host_name in args.hosts.split(","):
            for link_name in args.links.split(","):
                name = f"{args.profile}/{link_name}/{host_name}"
                label, bandwidth = LINKS[link_name]
                PROFILES[name] = dataclasses.replace(base, name=name, link_bytes_per_s=bandwidth,
                                                     host=HOSTS[host_name], description=f"{base.name} over {label}")
                try:
                    point = _point(_config(args, [name], budget, None))[name]
                finally:
                    del PROFILES[name]
                point.update(link=link_name, host=host_name, link_gb_s=bandwidth / GB)
                out[f"{name}@{budget:g}"] = point
                print(f"  {name} budget {budget:.1%}: rho {point['rho']:.2f} done", flush=True)
    print(f"\nmachine sweep ({args.profile}'s model and GPU; speedup of specter over demand-lru | demand-host)")
    print(f"{'budget':<8}{'host':<10}" + "".join(f"{link:>20}" for link in args.links.split(",")))
    for budget in (float(x) for x in args.budgets.split(",")):
        for host_name in args.hosts.split(","):
            cells = []
            for link_name in args.links.split(","):
                t = out[f"{args.profile}/{link_name}/{host_name}@{budget:g}"]["tpot_ms"]
                cells.append(f"{t['demand-lru'] / t['specter']:.2f}x | {t['demand-host'] / t['specter']:.2f}x")
            print(f"{budget:<8.1%}{host_name:<10}" + "".join(f"{c:>20}" for c in cells))
    _plot_machine(out, Path(args.out))
    return out


def _plot_machine(out: dict[str, Any], folder: Path) -> None:
    """Speedup over demand-lru against link bandwidth: one panel per budget, a colour per policy,
    a line style per host memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, ScalarFormatter

    budgets = sorted({p["budget"] for p in out.values()})
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4.2), sharey=True, squeeze=False)
    styles = dict(zip(HOSTS, ("-", "--", ":"), strict=True))
    colours: dict[str, str] = {}
    for ax, budget in zip(axes[0], budgets, strict=True):
        series: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for point in out.values():
            if point["budget"] != budget:
                continue
            t = point["tpot_ms"]
            for policy in t:
                if policy != "demand-lru":
                    series.setdefault((policy, point["host"]), []).append((point["link_gb_s"], t["demand-lru"] / t[policy]))
        for (policy, host), xy in sorted(series.items()):
            xy.sort()
            colour = colours.setdefault(policy, f"C{len(colours)}")
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", color=colour, ls=styles.get(host, "-"),
                    label=f"{policy}, {host}")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([v / 1e9 for _, v in LINKS.values()]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(FixedLocator([]))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"budget {budget:.0%}")
        ax.set_xlabel("host→device link, GB/s (PCIe 3/4/5 x16, NVLink-C2C)")
    axes[0][0].set_ylabel("speedup over demand-lru (TPOT, virtual clock)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / "machine_sweep.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("rho", "budget", "machine", "grid"))
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--profile", default="qwen2moe-pcie4", choices=list(PROFILES))
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--skip-prompts", type=int, default=0,
                        help="start after this many held-out prompts (another set of prompts: e.g. 8, 16 with --num-prompts 8)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=8, help="K of the drafting policies at a fixed K (no scan); specter chooses its own")
    parser.add_argument("--rhos", default="1,3,10,30,100")
    parser.add_argument("--rho", type=float, default=None, help="budget sweep: at this rho (default: profile's)")
    parser.add_argument("--budget", type=float, default=None, help="rho sweep: at this budget (default: profile's)")
    parser.add_argument("--budgets", default="0.125,0.25,0.5,0.75")
    parser.add_argument("--links", default="pcie3,pcie4,pcie5,c2c")
    parser.add_argument("--hosts", default="ddr4,ddr5,lpddr5x")
    parser.add_argument("--out", default="runs/sweep")
    args = parser.parse_args()
    torch.set_num_threads(1)  # virtual figures do not depend on threads; one keeps parallel runs from thrashing
    t0 = time.perf_counter()
    if args.kind == "grid" and args.policies == POLICIES:
        args.policies = "demand-lru,demand-host,specter"
    out = {"rho": sweep_rho, "budget": sweep_budget, "machine": sweep_machine, "grid": sweep_grid}[args.kind](args)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.kind}.json").write_text(json.dumps({str(k): v for k, v in out.items()}, indent=1))
    print(f"\n{args.kind} sweep: {len(out)} points in {time.perf_counter() - t0:.0f} s -> {folder}/{args.kind}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
