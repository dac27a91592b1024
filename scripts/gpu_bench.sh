#!/usr/bin/env bash
# The GPU bench (issue 34), prepared to run once on a lent device machine (docs/gpu.md):
#
#   bash scripts/gpu_wheels.sh       # here, with a network: the wheels the device machine lacks
#   run: bash scripts/gpu_bench.sh   # there, carrying wheels/: figures under $OUT
#
# Synthetic models at Qwen1.5-MoE and Mixtral-8x7B expert shapes are built on the device (nothing
# large travels), an RTN draft of each, then every setting interleaved, three repeats, medians
# (scripts/gpu_bench.py). The carried wheels go into a folder on PYTHONPATH, as gpu_check.sh's do.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-bench}
DEVICE_SCRIPT=gpu_bench
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh
timeout "${GPU_BENCH_TIMEOUT_S:-360}" python3 scripts/gpu_bench.py --out "$OUT" "$@"
status=$?
[ "$status" -eq 124 ] && echo "gpu_bench: stopped at ${GPU_BENCH_TIMEOUT_S:-360} s (figures so far in $OUT)" >&2
exit "$status"
