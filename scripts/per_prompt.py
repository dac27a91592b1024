"""Two policies of one bench run, prompt by prompt: how the ratio of their TPOTs spreads.

    python scripts/per_prompt.py RESULTS.json [--policy specter] [--against specter-paper+host+pipe]

``RESULTS.json`` is what ``specter bench --out DIR`` writes (``DIR/results.json``). The bench's table
compares medians over prompts; a ratio of medians can sit a few per cent away from how the two policies
compare on each prompt (the median prompt of one is not the other's). For each profile this prints the
ratio of medians, the median and geometric mean of the per-prompt ratios, the ratio of the summed TPOTs,
the range, and on how many prompts the policy was faster or slower by more than 1 %
(``specter.eval.bench.per_prompt``; the bench prints the geometric mean for ``specter`` against the run's
fastest other policy under each profile's table). Ratios are the policy's TPOT over the other's: below 1
is faster.
"""

from __future__ import annotations

import argparse
import json
import sys

from specter.eval.bench import per_prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a bench run's results.json")
    parser.add_argument("--policy", default="specter")
    parser.add_argument("--against", default="specter-paper+host+pipe")
    args = parser.parse_args(argv)
    try:
        with open(args.results, encoding="utf-8") as f:
            profiles = json.load(f)["profiles"]
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"results: {args.results} is not a bench run's results.json ({exc})")
    summaries = {}
    for name, profile in profiles.items():
        try:
            summaries[name] = per_prompt(profile["runs"], args.policy, args.against)
        except (ValueError, KeyError) as exc:
            parser.error(f"{name}: {exc}")
    print(f"{args.policy} over {args.against}, per prompt (below 1: faster)")
    print("profile              prompts  of medians  median  geo-mean  of sums   range        faster  slower")
    for name, s in summaries.items():
        print(f"{name:20} {s['prompts']:7d}  {s['ratio_of_medians']:10.3f}  {s['median_ratio']:6.3f}  "
              f"{s['geometric_mean']:8.3f}  {s['ratio_of_sums']:7.3f}   {s['best']:.2f}–{s['worst']:.2f}"
              f"  {s['faster']:6d}  {s['slower']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
