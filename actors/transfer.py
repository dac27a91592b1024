"""TransferActor: the transfer role (``specter/remote/roles/transfer.py``) as a Ray actor.

The role owns the host store in shared memory, the shared slot storage, the command socket and the
copy thread; this shell adds the process setup and Ray's metrics. ``specter/remote/processes.py``
runs the same role as a plain process.
"""

from __future__ import annotations

import ray
import torch

from actors.metrics import Recorder
from specter.config import LinkConfig, SlotConfig
from specter.remote.roles.base import setup_process
from specter.remote.roles.transfer import TransferRole


@ray.remote(num_cpus=0)
class TransferActor(TransferRole):
    """``TransferRole`` with its figures in Ray's metrics (tagged ``replica``, ``actor=transfer``)."""

    def __init__(
        self, model_dir: str, budget: SlotConfig, link: LinkConfig, prefix: str | None = None, timeout_s: float = 60.0,
        replica: str = "", metrics_every_s: float = 1.0, dtype: torch.dtype | None = None,
    ):
        setup_process()
        super().__init__(model_dir, budget, link, prefix, timeout_s, metrics_every_s, Recorder(replica, "transfer"), dtype)
