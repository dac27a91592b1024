#!/usr/bin/env bash
# One lent-device call (docs/gpu.md, "The next lent device"): the GPU tests, then the GPU bench.
#
#   bash scripts/gpu_wheels.sh && bash scripts/device_carry.sh pack      # here, first
#   run (carry: ["wheels"]): bash scripts/gpu_session.sh [gpu_bench.py's arguments]
#
# The carried wheels are installed once (scripts/device_env.sh) for both stages. tests/gpu runs first,
# at most GPU_TESTS_TIMEOUT_S (150 s), its log in $OUT/tests.log (the bench's speculative rows are to be
# trusted only where test_steps_captured_up_front_stay_token_identical passed); then the bench, at most
# GPU_BENCH_TIMEOUT_S (360 s), its figures in $OUT/bench after every repeat. The exit status is the
# first stage's failure, or 0; each stage runs whatever the other did.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
DEVICE_SCRIPT=gpu_session
# shellcheck source=scripts/device_env.sh
source scripts/device_env.sh
TESTS_K=${GPU_TESTS_K:-not coarse}
echo "gpu_session: tests/gpu -k '$TESTS_K' (at most ${GPU_TESTS_TIMEOUT_S:-150} s) -> $OUT/tests.log" >&2
timeout "${GPU_TESTS_TIMEOUT_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu -k "$TESTS_K" \
  >"$OUT/tests.log" 2>&1
tests=$?
[ "$tests" -eq 124 ] && echo "gpu_session: tests stopped at ${GPU_TESTS_TIMEOUT_S:-150} s" >>"$OUT/tests.log"
tail -n 20 "$OUT/tests.log" >&2
echo "gpu_session: the bench $* -> $OUT/bench" >&2
OUT="$OUT/bench" bash scripts/gpu_bench.sh "$@"
bench=$?
echo "gpu_session: tests exit $tests, bench exit $bench" >&2
[ "$tests" -ne 0 ] && exit "$tests"
exit "$bench"
