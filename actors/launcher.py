"""Launch the three actors of one engine replica in a placement group, wired and handshaken.

``launch`` returns an ``EngineHandle``: ``generate`` (one Ray call per request) and ``shutdown``
(actors closed and killed, sockets closed, ipc directory removed, shared memory unlinked,
placement group removed). Once wired, a replica is *sealed* (``TransferActor.seal``): its shared
memory and ipc directory have no names left, so a crash anywhere leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft import DraftActor
from actors.transfer import TransferActor
from actors.verifier import MAX_BATCH, VerifierActor
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import check_draft_matches
from specter.models.checkpoint import read_config_dict
from specter.remote.segments import unlink_prefix
from specter.remote.wiring import seal, wire

log = logging.getLogger(__name__)

BUNDLE_CPUS = 0.25  # logical CPUs per actor: a few replicas fit a 2-CPU local Ray


@dataclass
class EngineHandle:
    """A launched replica: its actors, placement group, shared-memory prefix and ipc directory."""

    replica: str
    pg: PlacementGroup
    transfer: Any
    verifier: Any
    draft: Any | None
    prefix: str
    ipc_dir: str
    policy: str
    names: list[str] = field(default_factory=list)
    closed: bool = False

    def generate(self, prompt_ids: list[int], max_new_tokens: int, **options: Any) -> dict[str, Any]:
        """``{"tokens", "stats"}`` for one prompt (``VerifierActor.generate``'s options)."""
        return ray.get(self.verifier.generate.remote(prompt_ids, max_new_tokens, **options))

    def link_counters(self) -> dict[str, float]:
        """The transfer actor's link counters (control plane)."""
        return ray.get(self.transfer.counters.remote())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tear everything down; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for actor in (self.verifier, self.draft, self.transfer):  # the verifier first: it says Shutdown
            if actor is None:
                continue
            try:
                ray.get(actor.close.remote(), timeout=timeout_s)
            except Exception as exc:  # a dead actor: its resources are swept below
                log.warning("shutdown of %s: %s", self.replica, exc)
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.pg)
        if os.path.isdir(self.ipc_dir):  # same node as the actors: sweep what a crash left
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        unlink_prefix(self.prefix)


def launch(
    model: str | Path,
    draft: str | Path | None,
    budget: SlotConfig,
    link: LinkConfig,
    policy: str = "specter",
    replica: str | None = None,
    timeout_s: float = 60.0,
    cpus_per_actor: float = BUNDLE_CPUS,
    node_ip: str | None = None,
    gpu: bool = False,
    startup_timeout_s: float = 300.0,
    sealed: bool = True,
    host_profile: str | None = None,
    draft_mode: str = "auto",
    max_batch: int = MAX_BATCH,
) -> EngineHandle:
    """Start the actors of one replica and wire them (Ray must be initialized).

    Args:
        model: the target checkpoint folder (readable on the node the actors land on).
        draft: the draft folder, or None for policies without a draft (no draft actor).
        budget: the device's expert budget.
        link: the link model (``sim`` only, so far).
        policy: the verifier's policy.
        replica: a name for this replica (actor names are ``specter-<replica>-<role>``).
        timeout_s: handshake, transfer and draft timeouts.
        cpus_per_actor: logical CPUs of each actor's bundle.
        node_ip: pin the replica to this node (its ``node:IP`` resource); None lets Ray choose.
        gpu: the trio claims one GPU between them (a third each), so replicas land one per device.
        startup_timeout_s: how long the actors may take to start and load the model (worker start-up
            and loading, slow on a busy machine; separate from the peer timeouts).
        max_batch: streams the verifier decodes together (``specter/batching.py``).
        draft_mode: how the draft actor computes its experts (``load_draft``'s ``mode``; ``auto`` times
            the modes on its node).
        host_profile: the profile whose host computes late experts (``simulated_host``; None: the
            default profile's rates relative to the link's, as in process).
        sealed: unlink the shared memory and the ipc directory once wired (False keeps the sockets
            reachable for the wire fuzzer, which connects peers of its own later).

    Raises:
        ValueError: the draft does not match the target (checked here when both folders are
            readable from this process, before any actor starts).
        TimeoutError: the cluster has no room for the placement group (or an actor did not start).
    """
    if draft is not None and Path(draft, "config.json").is_file() and Path(model, "config.json").is_file():
        check_draft_matches(read_config_dict(Path(draft)), read_config_dict(Path(model)))
    replica = replica or secrets.token_hex(3)
    roles = ["transfer", "verifier"] + (["draft"] if draft is not None else [])
    bundle: dict[str, float] = {"CPU": cpus_per_actor}
    if gpu:
        bundle["GPU"] = round(1 / len(roles), 4)
    if node_ip is not None:
        bundle[f"node:{node_ip}"] = 0.001
    pg = _reserve(replica, len(roles), bundle, max(timeout_s, 10.0))

    def where(role: str) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=roles.index(role))
        return {"name": f"specter-{replica}-{role}", "scheduling_strategy": strategy, "num_cpus": cpus_per_actor,
                "num_gpus": bundle.get("GPU", 0)}

    prefix = f"specter-{replica}-{secrets.token_hex(4)}"
    transfer = TransferActor.options(**where("transfer")).remote(  # type: ignore[attr-defined]
        str(model), budget, link, prefix, timeout_s, replica
    )
    verifier = VerifierActor.options(**where("verifier")).remote(  # type: ignore[attr-defined]
        str(model), budget, policy, timeout_s, replica, link, host_profile, "transfer", max_batch
    )
    draft_actor = None
    if draft is not None:
        draft_actor = DraftActor.options(**where("draft")).remote(str(draft), timeout_s, replica, draft_mode)  # type: ignore[attr-defined]
    handle = EngineHandle(replica, pg, transfer, verifier, draft_actor, prefix, "", policy,
                          [f"specter-{replica}-{r}" for r in roles])
    try:
        handle.ipc_dir, slots = wire(_ray_call, handle.transfer, handle.verifier, handle.draft, startup_timeout_s)
        log.info("replica %s: %d slots, actors %s", handle.replica, slots, ", ".join(handle.names))
        if sealed:
            seal(_ray_call, handle.transfer, handle.draft is not None, startup_timeout_s)
    except BaseException:
        handle.shutdown()
        raise
    return handle


def _ray_call(actor: Any, method: str, *args: Any, timeout: float) -> Any:
    return ray.get(getattr(actor, method).remote(*args), timeout=timeout)


def _reserve(replica: str, count: int, bundle: dict[str, float], timeout_s: float) -> Any:
    """A STRICT_PACK placement group of ``count`` bundles, ready (one node holds the whole trio)."""
    pg = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK", name=f"specter-{replica}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"replica {replica}: no node has room for {count} x {bundle} within {timeout_s:.0f}s"
        ) from None
    return pg
