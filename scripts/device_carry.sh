#!/usr/bin/env bash
# Fit the working tree into a lent device's 64 MiB carry (docs/gpu.md), and put it back after:
#
#   bash scripts/device_carry.sh pack     # move the trained moe-coarse models, docs/results and docs/images aside
#   (device calls, carry: ["wheels"])
#   bash scripts/device_carry.sh unpack   # move them back (run it before any commit)
#
# The device tool sends the checkout's tracked and untracked-not-ignored files; the tracked tree is
# ~97 MiB (four trained checkpoints ~79 MB, docs/results ~6 MB, docs/images 0.5 MB) and the carried
# wheels ~19 MB. `pack` moves what the device runs never read into the git-ignored .device-stash/ and prints what would
# travel; `unpack` restores it. While packed, `git status` shows the moved files as deleted: unpack
# before committing.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=.device-stash
AWAY=(specter/assets/moe-coarse specter/assets/moe-coarse-awq docs/results docs/images)
case "${1:-}" in
  pack)
    for path in "${AWAY[@]}"; do
      if [ -e "$STASH/$path" ]; then echo "device_carry: $STASH/$path exists: unpack first" >&2; exit 1; fi
    done
    for path in "${AWAY[@]}"; do
      [ -e "$path" ] || continue
      mkdir -p "$STASH/$(dirname "$path")"
      mv "$path" "$STASH/$path"
    done
    tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}' || true)
    wheels=0
    if [ -d wheels ]; then wheels=$(du -sb wheels | cut -f1); fi
    total=$(( (tracked + wheels) / 1048576 ))
    echo "device_carry: packed; tree ${tracked} B + wheels ${wheels} B = ${total} MiB (limit 64)"
    [ "$total" -lt 64 ] || { echo "device_carry: still over 64 MiB" >&2; exit 1; }
    ;;
  unpack)
    for path in "${AWAY[@]}"; do
      [ -e "$STASH/$path" ] || continue
      if [ -e "$path" ]; then echo "device_carry: $path exists beside its stashed copy; left both" >&2; exit 1; fi
      mkdir -p "$(dirname "$path")"
      mv "$STASH/$path" "$path"
    done
    echo "device_carry: unpacked"
    ;;
  *)
    echo "usage: bash scripts/device_carry.sh pack|unpack" >&2
    exit 2
    ;;
esac
