"""VerifierActor: the verifier role (``specter/remote/roles/verifier.py``) as a Ray actor.

The role holds the target's dense parts and runs each request's rounds; this shell adds the process
setup, Ray's metrics, a concurrency group so that ``pid``, ``progress`` and ``cancel`` answer while a
request runs, and one of ``STREAMS`` threads for ``stream`` (a generator: Ray's streaming generator
hands its chunks to the caller one at a time), so that concurrent streams reach the batcher together. ``specter/remote/processes.py`` runs the same role as a plain process.
"""

from __future__ import annotations

import ray
import torch

from actors.metrics import Recorder
from specter.config import LinkConfig, SlotConfig
from specter.remote.roles.base import setup_process
from specter.remote.roles.verifier import MAX_BATCH, PIPELINED, SCHEDULES, VerifierRole

__all__ = ["PIPELINED", "SCHEDULES", "VerifierActor"]


STREAMS = 64  # threads for concurrent streams (batched ones share the engine's steps; the rest wait their turn)


# Out of order: no call depends on the order of another's arrival (a cancel that comes before its stream is
# kept, ``VerifierRole.cancel``), and Ray's in-order sequencing stalls the actor 30 s, then fails every
# queued call, when a caller's stream is dropped midway (seen with ``specter serve`` and a client that
# closes its stream: ``Timed out waiting for seq_no``, Ray 2.60).
@ray.remote(num_cpus=0, concurrency_groups={"control": 1, "streams": STREAMS},  # type: ignore[call-overload]
            allow_out_of_order_execution=True)
class VerifierActor(VerifierRole):
    """``VerifierRole`` with its figures in Ray's metrics (tagged ``replica``, ``actor=verifier``)."""

    def __init__(self, model_dir: str, budget: SlotConfig, policy: str, timeout_s: float = 60.0, replica: str = "",
                 link: LinkConfig | None = None, host_profile: str | None = None, schedule: str = "transfer",
                 max_batch: int = MAX_BATCH, dtype: torch.dtype | None = None, step: str = "auto"):
        setup_process()
        super().__init__(model_dir, budget, policy, timeout_s, link, host_profile, schedule,
                         Recorder(replica, "verifier"), max_batch, dtype, step)

    @ray.method(concurrency_group="control")
    def pid(self) -> int:  # type: ignore[override]
        return super().pid()

    @ray.method(concurrency_group="control")
    def cancel(self, request_id: str) -> None:  # type: ignore[override]
        super().cancel(request_id)

    @ray.method(concurrency_group="control")
    def concurrency(self) -> int:  # type: ignore[override]
        return super().concurrency()

    @ray.method(concurrency_group="streams")
    def stream(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, **options):  # type: ignore[no-untyped-def,override]
        yield from super().stream(request_id, prompt_ids, max_new_tokens, **options)

    @ray.method(concurrency_group="control")
    def chooser_states(self) -> dict[int, dict]:  # type: ignore[override]
        return super().chooser_states()

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[str, int | bool]:  # type: ignore[override]
        return super().progress()
