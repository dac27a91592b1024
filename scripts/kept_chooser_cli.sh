#!/usr/bin/env bash
# Each prompt a separate `specter generate` (a command-line one-shot), on the as-built clock (load-
# independent): demand-lru, specter with a fresh K chooser (--chooser-cache none) and specter keeping
# its chooser between the runs (a new folder), interleaved prompt by prompt; then each one's TPOT
# over demand-lru's and their geomeans after the first prompt (docs/benchmark.md, "Kept between runs").
#
#   bash scripts/kept_chooser_cli.sh [EXTRA GENERATE FLAGS...]     e.g. --model DIR --draft DIR
set -euo pipefail
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
prompts=("The capital of France is" "Once upon a time" "def fibonacci(n):" "The quick brown fox"
         "In the beginning" "import numpy as np" "My favourite food is" "The weather today")
for i in "${!prompts[@]}"; do
  for setting in demand-lru fresh kept; do
    case $setting in
      demand-lru) flags=(--policy demand-lru) ;;
      fresh) flags=(--policy specter --chooser-cache none) ;;
      kept) flags=(--policy specter --chooser-cache "$cache") ;;
    esac
    tpot=$(specter generate "${flags[@]}" --prompt "${prompts[$i]}" --max-new-tokens 64 --clock as-built --json "$@" \
           2>/dev/null | tail -1 | python -c "import json, sys; print(json.load(sys.stdin)['stats']['tpot_s'] * 1e3)")
    echo "$i $setting $tpot"
  done
done > "$cache/tpots"
python - "$cache/tpots" <<'PY'
import math
import sys

rows: dict[int, dict[str, float]] = {}
for line in open(sys.argv[1]):
    i, setting, tpot = line.split()
    rows.setdefault(int(i), {})[setting] = float(tpot)
for i, r in sorted(rows.items()):
    base = r["demand-lru"]
    print(f"prompt {i}: demand-lru {base:.2f} ms, fresh {r['fresh']:.2f} ({r['fresh'] / base:.3f}), "
          f"kept {r['kept']:.2f} ({r['kept'] / base:.3f})")
later = [r for i, r in sorted(rows.items())][1:]
def geomean(key: str) -> float:
    return math.exp(sum(math.log(r[key] / r["demand-lru"]) for r in later) / len(later))
print(f"after the first prompt, geomean over demand-lru: fresh {geomean('fresh'):.3f}, kept {geomean('kept'):.3f}")
PY
