"""DraftActor: the draft role (``specter/remote/roles/draft.py``) as a Ray actor.

The role holds the draft and its KV cache and serves rounds to the verifier over ZeroMQ; this shell
adds the process setup and Ray's metrics. ``specter/remote/processes.py`` runs the same role as a
plain process.
"""

from __future__ import annotations

import ray

from actors.metrics import Recorder
from specter.config import LinkConfig
from specter.remote.roles.base import setup_process
from specter.remote.roles.draft import DraftRole


@ray.remote(num_cpus=0)
class DraftActor(DraftRole):
    """``DraftRole`` with its figures in Ray's metrics (tagged ``replica``, ``actor=draft``)."""

    def __init__(self, draft_dir: str, timeout_s: float = 60.0, replica: str = "", mode: str = "auto",
                 link: LinkConfig | None = None, step: str = "auto"):
        setup_process()
        super().__init__(draft_dir, timeout_s, mode, Recorder(replica, "draft"), link, step)
