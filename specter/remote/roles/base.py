"""What every role needs beside its own work: the compute device and dtype, a metrics sink.

The roles (``transfer.py``, ``draft.py``, ``verifier.py``) are the three processes of an engine
replica as plain classes: the Ray actors (``actors/``) are thin shells around them, and
``specter/remote/processes.py`` runs them as plain processes without Ray. Both paths run this code.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

DEVICE = torch.device("cpu")  # CUDA roles (CUDA IPC slots, copy streams) are the next step


class Metrics(Protocol):
    """Where a role's figures go (``actors/metrics.py: Recorder`` under Ray)."""

    def inc(self, name: str, value: float = 1.0) -> None: ...

    def set(self, name: str, value: float) -> None: ...

    def request(self, stats: dict[str, Any]) -> None: ...


class NoMetrics:
    """A role's metrics where nothing collects them (plain processes: the stats come back with each request)."""

    def inc(self, name: str, value: float = 1.0) -> None:
        pass

    def set(self, name: str, value: float) -> None:
        pass

    def request(self, stats: dict[str, Any]) -> None:
        pass


def setup_process(threads: int = 1) -> None:
    """One compute thread per role (as the in-process tests run), INFO logging."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def compute_dtype() -> torch.dtype:
    """fp32 on a CPU, as ``OffloadedTarget.load`` chooses (keeps speculation token-identical)."""
    return torch.float32
