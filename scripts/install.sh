#!/usr/bin/env bash
# Idempotent set-up: the CPU torch wheel (only when no torch is importable), then the project.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
  # Pinned so pip takes the CPU wheel on disk instead of a multi-GB CUDA build.
  python3 -m pip install --quiet "torch==2.13.0"
fi
if ! python3 -c "import specter, ruff, mypy, pytest, matplotlib, scipy" 2>/dev/null \
   || [ pyproject.toml -nt .install-stamp ]; then
  python3 -m pip install --quiet -e ".[dev]"
  touch .install-stamp
fi
