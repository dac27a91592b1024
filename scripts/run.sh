#!/usr/bin/env bash
# The main job: install (idempotent), then a real generation on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec specter generate "$@"
