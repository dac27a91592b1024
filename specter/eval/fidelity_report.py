"""The fidelity report: one row of measures per method, the markdown table, the AWQ-vs-RTN verdict.

The measures come from ``specter.eval.fidelity``'s tallies (and ``measure_acceptance``);
``paired_bootstrap`` resamples prompts to say which differences between two rows are clear of
sampling noise. ``scripts/fidelity.py`` writes the report (its markdown: ``scripts/fidelity_doc.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from specter.eval.fidelity import FidelityTally, fraction, merge


def row_measures(
    tallies: Sequence[FidelityTally], acceptance: dict[int, dict[str, Any]], pick: Sequence[int] | None = None
) -> dict[str, float]:
    """The flat measures of one method's row (the table's columns), over prompts ``pick`` (default all)."""
    pick = range(len(tallies)) if pick is None else pick
    summary = merge(tallies[i] for i in pick).summary()
    row = {"topk_set_mean": summary["topk_set_mean"], "topk_set_min": summary["topk_set_min"]}
    for k, value in summary["recall"].items():
        row[f"recall@{k}"] = value
    row["next_token"] = summary["next_token"]
    for k, acc in sorted(acceptance.items()):
        parts = [acc["per_prompt"][i] for i in pick]
        row[f"accepted@K={k}"] = fraction(sum(p[0] for p in parts), sum(p[1] for p in parts))
    return row


def paired_bootstrap(
    a: tuple[Sequence[FidelityTally], dict[int, dict[str, Any]]],
    b: tuple[Sequence[FidelityTally], dict[int, dict[str, Any]]],
    samples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, tuple[float, float]]:
    """Interval of (row a − row b) per measure, resampling prompts with replacement (paired)."""
    n = len(a[0])
    if n != len(b[0]):
        raise ValueError(f"paired_bootstrap: {n} prompts vs {len(b[0])}")
    gen = torch.Generator().manual_seed(seed)
    diffs: dict[str, list[float]] = {}
    for _ in range(samples):
        pick = torch.randint(0, n, (n,), generator=gen).tolist()
        ra, rb = row_measures(*a, pick=pick), row_measures(*b, pick=pick)
        for name in ra:
            diffs.setdefault(name, []).append(ra[name] - rb[name])
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    out = {}
    for name, values in diffs.items():
        t = torch.tensor([v for v in values if not math.isnan(v)], dtype=torch.float64)
        out[name] = (float(t.quantile(lo_q)), float(t.quantile(hi_q))) if t.numel() else (math.nan, math.nan)
    return out


_HEADERS = {"topk_set_mean": "top-k set (mean)", "topk_set_min": "top-k set (min layer)",
            "next_token": "next-token"}


def header(name: str) -> str:
    if name.startswith("accepted@"):
        return "accepted " + name.removeprefix("accepted@")
    return _HEADERS.get(name, name.replace("recall@", "R@"))


def markdown_table(rows: dict[str, dict[str, float]]) -> str:
    """One markdown table: a row per method, a column per measure."""
    columns = list(next(iter(rows.values())))
    lines = [
        "| method | " + " | ".join(header(c) for c in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for method, row in rows.items():
        cells = [_fmt(c, row.get(c, math.nan)) for c in columns]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(column: str, value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.2f}" if column.startswith("accepted") else f"{value:.3f}"


def awq_verdict(
    rows: dict[str, dict[str, float]], interval: dict[str, tuple[float, float]] | None = None
) -> dict[str, Any]:
    """"AWQ must be no worse than RTN on any measure and better on at least one", on the exact numbers.

    ``interval`` (AWQ − RTN per measure, e.g. from ``paired_bootstrap``) adds which differences
    are clear of sampling noise: ``clearly_worse`` / ``clearly_better`` (interval excludes 0).
    """
    if "awq" not in rows or "rtn" not in rows:
        return {"verdict": "n/a", "reason": "needs both awq and rtn rows"}
    awq, rtn = rows["awq"], rows["rtn"]
    worse: list[str] = []
    better: list[str] = []
    equal: list[str] = []
    for name in awq:
        a, r = awq[name], rtn.get(name, math.nan)
        if math.isnan(a) or math.isnan(r):
            continue
        (worse if a < r else better if a > r else equal).append(name)
    ok = not worse and bool(better)
    deltas = {name: awq[name] - rtn[name] for name in awq if name in rtn}
    out: dict[str, Any] = {"verdict": "PASS" if ok else "FAIL", "worse": worse, "better": better,
                           "equal": equal, "delta_awq_minus_rtn": deltas}
    if interval is not None:
        out["interval_awq_minus_rtn"] = interval
        out["clearly_worse"] = [n for n in awq if n in interval and interval[n][1] < 0]
        out["clearly_better"] = [n for n in awq if n in interval and interval[n][0] > 0]
    return out


def verdict_line(
    v: dict[str, Any], rows: dict[str, dict[str, float]], names: tuple[str, str] = ("AWQ", "RTN")
) -> str:
    """A one-line statement of the verdict with the numbers behind it (``names``: what the rows
    ``awq`` and ``rtn`` of ``awq_verdict`` stand for)."""
    a, b = names
    if v["verdict"] == "n/a":
        return f"{a} vs {b}: n/a ({v['reason']})"

    def show(names: list[str]) -> str:
        return ", ".join(
            f"{header(n)} {rows['awq'][n]:.4f} vs {rows['rtn'][n]:.4f}" for n in names
        ) or "none"

    line = (
        f"{a} vs {b}: **{v['verdict']}** — better on: {show(v['better'])}; worse on: {show(v['worse'])}; "
        f"equal on: {', '.join(header(n) for n in v['equal']) or 'none'}."
    )
    if "interval_awq_minus_rtn" in v:
        clear_w = ", ".join(header(n) for n in v["clearly_worse"]) or "none"
        clear_b = ", ".join(header(n) for n in v["clearly_better"]) or "none"
        line += (
            f" Paired bootstrap over prompts (95 % interval of {a} − {b} excludes 0): clearly better on {clear_b}; "
            f"clearly worse on {clear_w}."
        )
    return line
