#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the lent device machine lacks for
# scripts/gpu_check.sh: msgspec for CPython 3.12 manylinux x86-64, into wheels/ (git-ignored;
# pass `carry: ["wheels"]` to the device run).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --dest wheels --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 msgspec
ls -l wheels
