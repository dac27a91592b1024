"""What the actor shells share: the CPU compute device and dtype, per-process torch setup."""

from __future__ import annotations

import logging

import torch

DEVICE = torch.device("cpu")  # CUDA actors (CUDA IPC slots, copy streams) are the next step


def setup_process(threads: int = 1) -> None:
    """One compute thread per actor (as the in-process tests run), INFO logging."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def compute_dtype() -> torch.dtype:
    """fp32 on a CPU, as ``OffloadedTarget.load`` chooses (keeps speculation token-identical)."""
    return torch.float32
