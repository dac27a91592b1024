"""What the actor shells share: the CPU compute dtype, slot groups, per-process torch setup."""

from __future__ import annotations

import logging

import torch

from specter.config import SlotConfig
from specter.models.loader import LoadedModel
from specter.target import _groups

DEVICE = torch.device("cpu")  # CUDA actors (CUDA IPC slots, copy streams) are the next step


def setup_process(threads: int = 1) -> None:
    """One compute thread per actor (as the in-process tests run), INFO logging."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def compute_dtype() -> torch.dtype:
    """fp32 on a CPU, as ``OffloadedTarget.load`` chooses (keeps speculation token-identical)."""
    return torch.float32


def slot_groups(budget: SlotConfig, loaded: LoadedModel) -> dict[int, int]:
    """Slots per group, exactly as the in-process target sizes its pool."""
    return _groups(budget, loaded)
