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
SITE=${SPECTER_WHEELS_SITE:-/tmp/specter-wheels}
if compgen -G "wheels/*.whl" >/dev/null; then  # into a folder on PYTHONPATH, ahead of the device's own
  python3 -m pip install --quiet --no-deps --no-index --target "$SITE" wheels/*.whl \
    || echo "gpu_check: could not install the carried wheels" >&2
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
elif ! python3 -c "import msgspec" 2>/dev/null; then
  echo "gpu_check: msgspec is missing and no wheel was carried (run scripts/gpu_wheels.sh)" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout "${GPU_CHECK_TIMEOUT_S:-360}" python3 scripts/gpu_check.py --out "$OUT" "$@"
status=$?
[ "$status" -eq 124 ] && echo "gpu_check: stopped at ${GPU_CHECK_TIMEOUT_S:-360} s" >&2
exit "$status"
