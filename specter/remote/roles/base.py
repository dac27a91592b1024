"""What every role needs beside its own work: the compute device and dtype, a metrics sink.

A replica runs on the CPU, or on one CUDA device when its link is ``cuda`` (``role_device``): the
transfer process then creates the slots on the device and pins the host store, the verifier computes
on the slots' device (read from the slots' handle), the draft on the same device.

The roles (``transfer.py``, ``draft.py``, ``verifier.py``) are the three processes of an engine
replica as plain classes: the Ray actors (``actors/``) are thin shells around them, and
``specter/remote/processes.py`` runs them as plain processes without Ray. Both paths run this code.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Protocol

import torch

from specter.config import LinkConfig


class RoleStartError(RuntimeError):
    """A role could not be built where it runs (a Ray actor's ``__init__`` raised: Ray returns only
    its text, which this carries in one line)."""


def role_device(link: LinkConfig | None) -> torch.device:
    """Where a replica computes: the current CUDA device for a ``cuda`` link, else the CPU.

    Raises:
        ValueError: a ``cuda`` link where torch sees no CUDA device.
    """
    if link is None or link.kind != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("link: cuda needs a CUDA device, and torch sees none here (use sim:GBPS)")
    return torch.device("cuda", torch.cuda.current_device())


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


LOG_LEVEL_ENV = "SPECTER_LOG_LEVEL"  # the roles' logging level (a name: INFO, WARNING, …); INFO where unset


def setup_process(threads: int = 1) -> None:
    """One compute thread per role (as the in-process tests run), logging at ``$SPECTER_LOG_LEVEL``
    (INFO where unset; ``specter generate`` sets WARNING unless ``-v``: its text goes to the same
    terminal), and no traceback for an exit that lands in a finalizer (``quiet_exit_in_finalizers``)."""
    torch.set_num_threads(threads)
    level = logging.getLevelName(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.unraisablehook = quiet_exit_in_finalizers


def quiet_exit_in_finalizers(unraisable: Any) -> None:
    """``sys.unraisablehook`` for a role's process: a ``SystemExit`` raised inside a finalizer is the
    exit the process was asked for, and passes silently; anything else is reported as Python does.

    Ray's SIGTERM handler raises ``SystemExit`` wherever the main thread is. When ``ray.kill`` ends an
    actor whose interpreter is already tearing down (shared-memory segments' ``__del__`` running), it
    lands in one and Python printed "Exception ignored in ... SystemExit: 1" with a traceback into the
    driver's log (seen at ``specter serve``'s Ctrl-C under CI load, 2026-12-07)."""
    if isinstance(unraisable.exc_value, SystemExit):
        return
    sys.__unraisablehook__(unraisable)


def compute_dtype(device: torch.device | None = None, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The target's compute dtype, as ``OffloadedTarget.load`` chooses it: ``dtype`` if given, else fp32
    on a CPU (keeps speculation token-identical) and the checkpoint's own (None) on a GPU. The
    transfer process stores the blobs in it and the verifier computes in it: both ask this."""
    if dtype is not None:
        return dtype
    return torch.float32 if device is None or device.type == "cpu" else None
