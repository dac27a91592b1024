#!/usr/bin/env bash
# The GPU check of issue 18, prepared to run once on a lent device machine (docs/gpu.md):
#
#   bash scripts/gpu_wheels.sh       # here, with a network: the wheels the device machine lacks
#   run: bash scripts/gpu_check.sh   # there, carrying wheels/: figures under $OUT
#
# The device machine has torch and an older transformers but no msgspec (the engine's messages) and
# no network, so the carried wheels go in first; the checkout runs from PYTHONPATH, not installed.
# On a CPU the same command runs the probes that need no CUDA and says which it skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
DEVICE_SCRIPT=gpu_check
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh
timeout "${GPU_CHECK_TIMEOUT_S:-360}" python3 scripts/gpu_check.py --out "$OUT" "$@"
status=$?
[ "$status" -eq 124 ] && echo "gpu_check: stopped at ${GPU_CHECK_TIMEOUT_S:-360} s" >&2
exit "$status"
