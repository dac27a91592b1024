#!/usr/bin/env bash
# The main job: install (idempotent), then a real speculative generation through the Ray actors on a
# local Ray, on the embedded default:
# the project's own trained MoE as the offloaded target and its AWQ int4 draft.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec specter generate --address local --draft specter/assets/moe-fine-awq --policy specter "$@"
