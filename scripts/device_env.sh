# Sourced by the lent-device scripts (gpu_check.sh, gpu_bench.sh, gpu_session.sh; docs/gpu.md), from the
# checkout's root with DEVICE_SCRIPT naming the caller. The device machine has torch and an older
# transformers but no msgspec and no network: the carried wheels (scripts/gpu_wheels.sh) go into a folder
# ahead on PYTHONPATH, once per shell tree, and the checkout runs from PYTHONPATH, not installed.
SITE=${SPECTER_WHEELS_SITE:-/tmp/specter-wheels}
if [ "${SPECTER_WHEELS_READY:-}" != "$SITE" ]; then
  if compgen -G "wheels/*.whl" >/dev/null; then
    python3 -m pip install --quiet --no-deps --no-index --target "$SITE" wheels/*.whl \
      || echo "$DEVICE_SCRIPT: could not install the carried wheels" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  elif ! python3 -c "import msgspec" 2>/dev/null; then
    echo "$DEVICE_SCRIPT: msgspec is missing and no wheel was carried (run scripts/gpu_wheels.sh)" >&2
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export SPECTER_WHEELS_READY="$SITE"
fi
