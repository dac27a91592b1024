#!/usr/bin/env bash
# Idempotent set-up: the CPU torch wheel (only when no torch is installed), then the project.
set -euo pipefail
cd "$(dirname "$0")/.."
# What is installed is found without importing it (``find_spec``: ~0.5 s, where importing the lot
# took ~20 s of every run of the test command).
found() {  # exit 0 when every module named is installed
  (cd / && python3 -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@") \
    2>/dev/null
}
if ! found torch; then
  # Pinned so pip takes the CPU wheel on disk instead of a multi-GB CUDA build.
  python3 -m pip install --quiet "torch==2.13.0"
fi
# Reinstall also when the installed package is another checkout's (it must import from here even
# outside this folder: Ray workers and `ray job submit` entrypoints run elsewhere).
installed=$(cd / && python3 -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(os.path.realpath(u.find_spec('specter').origin))))" \
            2>/dev/null || true)
if ! found specter ruff mypy pytest matplotlib compressed_tensors openai httpx fastapi ray.serve; then
  python3 -m pip install --quiet -e ".[dev]"
  touch .install-stamp
elif [ "$installed" != "$(pwd -P)" ] || [ pyproject.toml -nt .install-stamp ]; then
  # Everything is there: point the package at this checkout (a fresh clone: ~5 s, where the whole
  # resolve takes ~25 s), then resolve everything only if pip finds a requirement of ours unmet
  # (a dependency this checkout's pyproject.toml added).
  python3 -m pip install --quiet --no-deps -e .
  if python3 -m pip check 2>/dev/null | grep -q "^specter-moe "; then
    python3 -m pip install --quiet -e ".[dev]"
  fi
  touch .install-stamp
fi
# AutoAWQ builds the AutoAWQ-format drafts of tests/draft/test_published_drafts.py with its own
# packing code. It is archived and pins an older torch, so it goes in without its dependencies
# (the one it needs to import, datasets, is in the dev extra).
if ! found awq; then
  python3 -m pip install --quiet --no-deps --no-build-isolation "autoawq==0.2.9"
fi
