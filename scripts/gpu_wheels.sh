#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the lent device machine lacks for
# scripts/gpu_check.sh and scripts/gpu_bench.sh, into wheels/ (git-ignored; pass `carry: ["wheels"]`
# to the device run): msgspec (the engine's messages), pyzmq (the sockets between the three processes
# of `--processes`: tests/gpu/test_gpu_processes.py, the bench's -processes rows) and the
# transformers the project pins with
# what it needs beyond the device's own packages (the set that ran there on 2026-12-04, shared
# NOTES "First run on a GPU"), for CPython 3.12 manylinux x86-64 — about 20 MB of the 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --dest wheels --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  "msgspec==0.23.*" "pyzmq==27.*" "transformers==5.25.0" "huggingface_hub==2.4.0" "kernels==0.19.1" \
  "httpx2==2.16.2" "httpcore2==2.16.2" truststore tomlkit "click==8.5.*"
ls -l wheels
