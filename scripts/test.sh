#!/usr/bin/env bash
# The test command: install (idempotent), lint, type-check, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check specter actors scripts tests
# mypy's cache outside the checkout: a fresh clone re-checks only what differs from the last run here
python3 -m mypy --cache-dir "${XDG_CACHE_HOME:-$HOME/.cache}/specter/mypy" specter actors
set +e
python3 -m pytest -q --durations=12 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
