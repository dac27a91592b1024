"""Where the project's own small trained checkpoints live inside the package."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL = ASSETS / "moe-fine"
DEFAULT_DRAFT = ASSETS / "moe-fine-awq"  # its AWQ int4 draft (``specter quantize``)
COARSE_MODEL = ASSETS / "moe-coarse"
