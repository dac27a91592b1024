"""scripts/device_carry.sh fits the tree into a device's 64 MiB carry and puts it back, in a clone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_pack_fits_the_carry_and_unpack_restores_the_tree(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    shutil.copy(ROOT / "scripts" / "device_carry.sh", clone / "scripts")  # this checkout's, committed or not
    status = ["git", "-C", str(clone), "status", "--porcelain"]
    before = subprocess.run(status, capture_output=True, text=True).stdout
    script = ["bash", str(clone / "scripts" / "device_carry.sh")]
    packed = subprocess.run([*script, "pack"], capture_output=True, text=True, timeout=120)
    assert packed.returncode == 0, packed.stderr
    assert "limit 64" in packed.stdout and not (clone / "specter/assets/moe-coarse").exists()
    assert (clone / "specter/assets/moe-fine").is_dir()  # what the device runs read stays
    again = subprocess.run([*script, "pack"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "unpack first" in again.stderr
    assert subprocess.run([*script, "unpack"], capture_output=True, text=True, timeout=120).returncode == 0
    assert subprocess.run(status, capture_output=True, text=True).stdout == before  # nothing left moved
