"""PNG plots of a benchmark run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(results["profiles"])
    policies = list(next(iter(results["profiles"].values()))["summary"])
    files = []
    for metric, label, name in (("tpot_s", "TPOT (ms)", "tpot.png"), ("speedup", "speedup over demand-lru", "speedup.png")):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            values = [results["profiles"][p]["summary"][policy][metric] * (1e3 if metric == "tpot_s" else 1)
                      for p in profiles]
            ax.bar([x + i * width for x in range(len(profiles))], values, width, label=policy)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(profiles))], profiles)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, profile in enumerate(profiles):
        summary = results["profiles"][profile]["summary"]
        for i, policy in enumerate(policies):
            s = summary[policy]
            x = j * (len(policies) + 1) + i
            host = s.get("host_wait_s_per_token", 0.0)
            compute = s["verify_s_per_token"] - s["wait_s_per_token"] - host
            parts = [s["draft_s_per_token"], compute, s["wait_s_per_token"], host]
            bottom = 0.0
            names = ("draft", "verify compute", "waiting on the link", "waiting on the host")
            colors = ("tab:blue", "tab:green", "tab:red", "tab:orange")
            for part, color, label in zip(parts, colors, names, strict=True):
                ax.bar(x, part * 1e3, bottom=bottom, color=color, label=label if (i, j) == (0, 0) else None)
                bottom += part * 1e3
    ax.set_ylabel("ms per token")
    ax.set_title("where the time goes (" + ", ".join(profiles) + ")", fontsize=9)
    ax.legend(fontsize=7)
    ax.set_xticks([j * (len(policies) + 1) + i for j in range(len(profiles)) for i in range(len(policies))],
                  [p for _ in profiles for p in policies], rotation=70, fontsize=6)
    fig.tight_layout()
    fig.savefig(out_dir / "time_split.png", dpi=110)
    plt.close(fig)
    files.append(out_dir / "time_split.png")
    files.append(_recall_vs_k(plt, results, profiles, out_dir))
    return files


def _recall_vs_k(plt: Any, results: dict[str, Any], profiles: list[str], out_dir: Path) -> Path:
    """Prediction recall against the window K: the K scan's curve per drafting policy, and each
    profile's run at its chosen K as a point."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, by_k in results.get("window_recall", {}).items():
        ks = sorted(by_k, key=int)
        ax.plot([int(k) for k in ks], [by_k[k] for k in ks], marker="o", label=f"{policy} (K scan)")
    for profile in profiles:
        for policy, s in results["profiles"][profile]["summary"].items():
            if s.get("window", 0) > 0:
                ax.scatter([s["window"]], [s["recall"]], marker="x", label=f"{policy} @ {profile}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window K (draft tokens per round)")
    ax.set_ylabel("prediction recall")
    ax.set_title("routing recall |predicted ∩ used| / |used| by window", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = out_dir / "recall_vs_k.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
