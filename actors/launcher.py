"""Launch the three actors of one engine replica in a placement group, wired and handshaken.

``launch`` returns an ``EngineHandle``: ``generate`` (one Ray call per request; ``stream``, the same
handing out the tokens as they commit) and ``shutdown`` (actors closed and killed, sockets closed,
ipc directory removed, shared memory unlinked, placement group removed). Once wired, a replica is
*sealed* (``TransferActor.seal``): its shared memory and ipc directory have no names left, so a crash
anywhere leaves nothing behind.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import ray
import torch
from ray.exceptions import RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft import DraftActor
from actors.transfer import TransferActor
from actors.verifier import MAX_BATCH, VerifierActor
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import check_draft_matches
from specter.models.checkpoint import read_config_dict
from specter.remote.roles.base import RoleStartError
from specter.remote.segments import unlink_prefix
from specter.remote.wiring import seal, wire

log = logging.getLogger(__name__)

BUNDLE_CPUS = 0.25  # logical CPUs per actor: a few replicas fit a 2-CPU local Ray
DEFAULT_SIM_LINK = LinkConfig(kind="sim", bandwidth=1e9, latency=10e-6)  # sim:1,10 where no GPU and no --link


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
    cut_short: bool = False  # a request whose caller stopped waiting (Ctrl-C) may still run in the actors

    def generate(self, prompt_ids: list[int], max_new_tokens: int, **options: Any) -> dict[str, Any]:
        """``{"tokens", "stats"}`` for one prompt (``VerifierActor.generate``'s options).

        Raises:
            ValueError: the verifier refused the request (its own message, without Ray's wrapping
                and the actor's traceback).
        """
        self.cut_short = True
        try:
            out = ray.get(self.verifier.generate.remote(prompt_ids, max_new_tokens, **options))
        except RayTaskError as exc:
            self.cut_short = False
            _raise_refusal(exc)
        self.cut_short = False
        return out

    def stream(self, prompt_ids: list[int], max_new_tokens: int, on_tokens: Callable[[list[int]], None],
               **options: Any) -> dict[str, Any]:
        """``generate``, handing ``on_tokens`` each step's or round's tokens as the verifier commits them
        (``VerifierActor.stream``); the same result, the same errors."""
        self.cut_short = True
        tokens: list[int] = []
        try:
            for ref in self.verifier.stream.remote(uuid.uuid4().hex, prompt_ids, max_new_tokens, **options):
                chunk = ray.get(ref)
                if chunk["tokens"]:
                    tokens += chunk["tokens"]
                    on_tokens(chunk["tokens"])
                if "stats" in chunk:
                    self.cut_short = False
                    return {"tokens": tokens, "stats": chunk["stats"]} | ({"chooser": chunk["chooser"]} if "chooser" in chunk else {})
        except RayTaskError as exc:
            self.cut_short = False
            _raise_refusal(exc)
        raise RuntimeError(f"replica {self.replica}: the verifier's stream ended without its figures")

    def prepare_steps(self, window: int) -> dict[str, int]:
        """Every step shape of windows up to ``window`` made ready before a request runs one, in the
        verifier and the draft actor (``ProcessEngine.prepare_steps``'s, through Ray): each one's count
        of token counts made ready (0 where its steps are eager)."""
        out = {"verifier": int(ray.get(self.verifier.prepare_steps.remote(window)))}
        if self.draft is not None:
            out["draft"] = int(ray.get(self.draft.prepare_steps.remote(window)))
        return out

    def link_counters(self) -> dict[str, float]:
        """The transfer actor's link counters (control plane)."""
        return ray.get(self.transfer.counters.remote())

    def shutdown(self, timeout_s: float = 10.0, close: bool = True) -> None:
        """Tear everything down; safe to call twice. Each actor is asked to ``close`` first unless
        ``close`` is False or a request was cut short (``cut_short``: the actors are inside it, and
        would answer once it is done): then they are killed at once, and what they held swept here."""
        if self.closed:
            return
        self.closed = True
        close = close and not self.cut_short
        for actor in (self.verifier, self.draft, self.transfer):  # the verifier first: it says Shutdown
            if actor is None:
                continue
            if close:
                try:
                    ray.get(actor.close.remote(), timeout=timeout_s)
                except Exception as exc:  # a dead actor: its resources are swept below
                    log.warning("shutdown of %s: %s", self.replica, exc)
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.pg)
        if os.path.isdir(self.ipc_dir):  # same node as the actors: sweep what a crash left
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        unlink_prefix(self.prefix)


def _raise_refusal(exc: RayTaskError) -> NoReturn:
    """The verifier's refusal (a ``ValueError``) as its own message, without Ray's wrapping and the
    actor's traceback; anything else as it came."""
    if isinstance(exc.cause, ValueError):
        raise ValueError(str(exc.cause)) from None
    raise exc


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
    startup_timeout_s: float = 300.0,
    sealed: bool = True,
    host_profile: str | None = None,
    draft_mode: str = "auto",
    max_batch: int = MAX_BATCH,
    dtype: torch.dtype | None = None,
    step: str = "auto",
) -> EngineHandle:
    """Start the actors of one replica and wire them (Ray must be initialized).

    Args:
        model: the target checkpoint folder (readable on the node the actors land on).
        draft: the draft folder, or None for policies without a draft (no draft actor).
        budget: the device's expert budget.
        link: how experts move: ``sim`` (the actors compute on their node's CPU) or ``cuda`` (the trio
            claims one GPU between them, ``placement``: the transfer actor's copy stream and pinned
            store, the slots shared by CUDA IPC, the verifier's and the draft's compute on it).
        policy: the verifier's policy.
        replica: a name for this replica (actor names are ``specter-<replica>-<role>``).
        timeout_s: handshake, transfer and draft timeouts.
        cpus_per_actor: logical CPUs of each actor's bundle.
        node_ip: pin the replica to this node (its ``node:IP`` resource); None lets Ray choose.
        startup_timeout_s: how long the actors may take to start and load the model (worker start-up
            and loading, slow on a busy machine; separate from the peer timeouts).
        max_batch: streams the verifier decodes together (``specter/batching.py``).
        dtype: the target's compute dtype (None: fp32 on a CPU, the checkpoint's on a GPU).
        step: how the verifier's and the draft's steps run (``OffloadedTarget.load``'s: ``auto`` graphs
            them on CUDA; ``EngineHandle.prepare_steps`` makes them ready before a request).
        draft_mode: how the draft actor computes its experts (``load_draft``'s ``mode``; ``auto`` times
            the modes on its node).
        host_profile: the profile whose host computes late experts (``simulated_host``; None: the
            default profile's rates relative to the link's, as in process).
        sealed: unlink the shared memory and the ipc directory once wired (False keeps the sockets
            reachable for the wire fuzzer, which connects peers of its own later).

    Raises:
        ValueError: the draft does not match the target (checked here when both folders are
            readable from this process, before any actor starts), or a ``cuda`` link on a cluster
            without a GPU.
        TimeoutError: the cluster has no room for the placement group (or an actor did not start).
    """
    if draft is not None and Path(draft, "config.json").is_file() and Path(model, "config.json").is_file():
        check_draft_matches(read_config_dict(Path(draft)), read_config_dict(Path(model)))
    replica = replica or secrets.token_hex(3)
    roles = ["transfer", "verifier"] + (["draft"] if draft is not None else [])
    bundles, options = placement(roles, link, cpus_per_actor, node_ip)
    pg = _reserve(replica, bundles, max(timeout_s, 10.0))

    def where(role: str) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=options[role]["bundle"])
        return {"name": f"specter-{replica}-{role}", "scheduling_strategy": strategy, "num_cpus": cpus_per_actor,
                "num_gpus": options[role]["gpus"]}

    prefix = f"specter-{replica}-{secrets.token_hex(4)}"
    transfer = TransferActor.options(**where("transfer")).remote(  # type: ignore[attr-defined]
        str(model), budget, link, prefix, timeout_s, replica, dtype=dtype
    )
    verifier = VerifierActor.options(**where("verifier")).remote(  # type: ignore[attr-defined]
        str(model), budget, policy, timeout_s, replica, link, host_profile, "transfer", max_batch, dtype, step
    )
    draft_actor = None
    if draft is not None:
        draft_actor = DraftActor.options(**where("draft")).remote(str(draft), timeout_s, replica, draft_mode, link,  # type: ignore[attr-defined]
                                                                  step)
    handle = EngineHandle(replica, pg, transfer, verifier, draft_actor, prefix, "", policy,
                          [f"specter-{replica}-{r}" for r in roles])
    try:
        handle.ipc_dir, slots = wire(_ray_call, handle.transfer, handle.verifier, handle.draft, startup_timeout_s)
        log.info("replica %s: %d slots, actors %s", handle.replica, slots, ", ".join(handle.names))
        if sealed:
            seal(_ray_call, handle.transfer, handle.draft is not None, startup_timeout_s)
    except ray.exceptions.ActorDiedError as exc:
        handle.shutdown()
        if not getattr(exc, "_actor_init_failed", False):
            raise
        raise RoleStartError(_start_failure(replica, roles, exc.error_msg)) from None
    except BaseException:
        handle.shutdown()
        raise
    return handle


def _start_failure(replica: str, roles: list[str], message: str) -> str:
    """One line out of Ray's report of an actor whose ``__init__`` raised: which actor, and the
    exception's last line (Ray keeps only the text of the exception)."""
    role = next((r for r in roles if f"specter-{replica}-{r}:" in message), None)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    who = f"the {role} actor" if role else "an actor"
    return f"replica {replica}: {who} could not start: {lines[-1] if lines else message}"


def _ray_call(actor: Any, method: str, *args: Any, timeout: float) -> Any:
    return ray.get(getattr(actor, method).remote(*args), timeout=timeout)


def cluster_link(link: LinkConfig | None) -> LinkConfig:
    """``link``, or where none was chosen the cluster's (Ray must be initialized): ``cuda`` where it
    has a GPU, else the simulated ``sim:1,10`` (``--link``'s documented default)."""
    if link is not None:
        return link
    if ray.cluster_resources().get("GPU", 0) >= 1:
        return LinkConfig(kind="cuda")
    return DEFAULT_SIM_LINK


def require_gpu() -> None:
    """Raise ``ValueError`` (one line, what to do) unless the cluster has a GPU: what a ``cuda`` link needs."""
    if ray.cluster_resources().get("GPU", 0) < 1:
        raise ValueError("link: cuda puts the actors on a GPU, and this Ray cluster has none (ray status shows no "
                         "GPU); start its nodes on GPU machines, or use --link sim:GBPS")


def placement(
    roles: list[str], link: LinkConfig, cpus_per_actor: float = BUNDLE_CPUS, node_ip: str | None = None,
) -> tuple[list[dict[str, float]], dict[str, dict[str, Any]]]:
    """The placement group's bundles and each role's ``{"bundle": index, "gpus": share}``.

    On a ``sim`` link a bundle per role, no GPU. On a ``cuda`` link one bundle holding a whole GPU and
    the trio's CPUs, each role a share of that GPU: Ray hands every actor of the bundle the bundle's
    own device, so the three see the same GPU (CUDA IPC between the transfer actor and the verifier
    needs it) and a replica claims one device (replicas spread one per GPU).

    Raises:
        ValueError: a ``cuda`` link on a cluster whose resources name no GPU.
    """
    node = {f"node:{node_ip}": 0.001} if node_ip is not None else {}
    if link.kind != "cuda":
        return [{"CPU": cpus_per_actor, **node} for _ in roles], {r: {"bundle": i, "gpus": 0} for i, r in enumerate(roles)}
    require_gpu()
    share = math.floor(1e4 / len(roles)) / 1e4  # Ray counts GPUs to 4 decimals: the shares sum to <= 1
    return [{"CPU": cpus_per_actor * len(roles), "GPU": 1.0, **node}], {r: {"bundle": 0, "gpus": share} for r in roles}


def _reserve(replica: str, bundles: list[dict[str, float]], timeout_s: float) -> Any:
    """A STRICT_PACK placement group of ``bundles``, ready (one node holds the whole trio)."""
    pg = placement_group([dict(b) for b in bundles], strategy="STRICT_PACK", name=f"specter-{replica}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"replica {replica}: no node has room for {bundles} within {timeout_s:.0f}s"
        ) from None
    return pg
