"""The transfer role: the pinned host store, the shared slot storage and the copy thread (or stream).

It creates the slot pool's storage as ``SharedSlots`` (and the link counters next to it), keeps the
host store in shared memory too (``specter/remote/shared_store.py``: the verifier maps it read-only
to compute late experts on the host), makes a private ipc directory, binds the pull socket the
verifier's ``RemoteLink`` pushes commands to, and serves them in a background thread
(``specter.remote.transfer_server``). Its control plane (``info``, ``start``, ``seal``, ``counters``,
``close``) is called through Ray (``actors/transfer.py``) or a pipe (``specter/remote/processes.py``).

``seal`` runs once the verifier has mapped the shared memory and connected both sockets: it removes
the segments' names and the ipc directory. The memory and the connections live on (POSIX keeps a
segment until its last unmap; a connected socket needs no file), so a crash of any process — a
role, the driver, Ray itself — leaves nothing behind in ``/dev/shm`` or the temp directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import msgspec
import torch

from specter.config import LinkConfig, SlotConfig
from specter.experts.store import ExpertStore
from specter.models.layout import read_layout
from specter.remote.channel import Channel
from specter.remote.counters import SharedCounters
from specter.remote.endpoints import private_ipc_dir
from specter.remote.residency import SharedIndex
from specter.remote.roles.base import Metrics, NoMetrics, compute_dtype, role_device
from specter.remote.segments import new_prefix, unlink_prefix
from specter.remote.shared_store import SharedArena, store_name
from specter.remote.shm import SharedSlots
from specter.remote.transfer_server import TransferServer

log = logging.getLogger(__name__)


class TransferRole:
    """Owns the host blobs, the shared slots and the copy thread.

    Args:
        model_dir: the target checkpoint.
        budget: the device's expert budget (sizes the shared slots like the verifier's pool).
        link: the link: ``sim:…`` (a simulated one, on the CPU) or ``cuda`` (the slots on the current
            CUDA device, the host store pinned, a copy stream: ``CudaSlotWriterLink``).
        prefix: shared-memory name prefix (default: a fresh one).
        timeout_s: the handshake timeout.
        metrics: where its figures go (``actors/metrics.py: Recorder`` under Ray; default none).
        metrics_every_s: how often the link's bytes and busy fraction go to the metrics.
        dtype: the blobs' dtype (None: fp32 on a CPU, the checkpoint's on a GPU); the verifier's
            compute dtype must be the same.
    """

    def __init__(
        self, model_dir: str, budget: SlotConfig, link: LinkConfig, prefix: str | None = None, timeout_s: float = 60.0,
        metrics_every_s: float = 1.0, metrics: Metrics | None = None, dtype: torch.dtype | None = None,
    ):
        self.metrics: Metrics = metrics or NoMetrics()
        self.metrics_every_s = metrics_every_s
        device = role_device(link)
        layout = read_layout(model_dir, compute_dtype(device, dtype))  # from the checkpoint's headers: no model built
        self.layout = layout.facts()
        self.prefix = prefix or new_prefix("specter")
        numel = ExpertStore.arena_numel(layout.moe_layers, layout.num_experts, layout.shape)
        self.arena = SharedArena.create(store_name(self.prefix), numel, layout.shape.dtype)
        self.store = ExpertStore(layout.moe_layers, layout.num_experts, layout.shape, arena=self.arena.tensor)
        self.store.load(layout.checkpoint, layout.family)
        if device.type == "cuda":
            self.arena.pin()  # the copy stream's copies from it run asynchronously
        groups = budget.groups(layout.moe_layers, layout.num_experts, layout.shape.nbytes, layout.top_k)
        num_slots = sum(groups.values())
        self.slots = SharedSlots.create(self.prefix, num_slots, self.store.shape.numel, self.store.shape.dtype,
                                        device)
        self.shared_counters = SharedCounters(self.prefix, create=True)
        self.index = SharedIndex(self.prefix, max(self.store.layers) + 1, self.store.num_experts, create=True)
        self.ipc = private_ipc_dir()
        self.channel = Channel("pull", self.ipc.endpoint("transfer"), bind=True, peer="verifier")
        self.server = TransferServer(self.store, self.slots, self.shared_counters, link, self.channel, self.index,
                                     groups, timeout_s)
        self.timeout_s = timeout_s
        self.handshake_timeout_s = timeout_s
        self._stop = threading.Event()
        self._first: str | None = None  # the role of the first peer's Hello (the pull socket's handshake)
        self._thread: threading.Thread | None = None
        log.info("transfer: %d experts in host memory%s, %d shared slots on %s (%s), link %s",
                 len(self.store.layers) * self.store.num_experts, " (pinned)" if device.type == "cuda" else "",
                 num_slots, device, self.prefix, self.server.link.describe())

    def info(self) -> dict[str, Any]:
        """Where to find this process's shared memory and sockets."""
        return {
            "slots": msgspec.json.encode(self.slots.handle).decode(),
            "prefix": self.prefix,
            "ipc_dir": str(self.ipc.path),
            "endpoint": self.channel.address,
            "pid": os.getpid(),
            "layout": self.layout,
        }

    def start(self, handshake_timeout_s: float | None = None) -> None:
        """Serve commands in a background thread (after the verifier's handshake, which may come
        as late as ``handshake_timeout_s``: the other processes may still be loading)."""
        if handshake_timeout_s is not None:
            self.handshake_timeout_s = handshake_timeout_s
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="specter-transfer", daemon=True)
            self._thread.start()
            threading.Thread(target=self._publish, name="specter-transfer-metrics", daemon=True).start()

    def peers(self) -> list[str]:
        """The roles connected to the command socket so far (``verifier``, and ``draft`` for its plans)."""
        return ([self._first] if self._first else []) + list(self.server.peers)

    def seal(self, timeout_s: float, roles: tuple[str, ...] = ("verifier",)) -> None:
        """Once the peers in ``roles`` are connected, remove the names of the shared memory and the
        ipc directory (nothing else can attach or connect afterwards; nothing outlives a crash).

        Raises:
            TimeoutError: a handshake of ``roles`` did not arrive within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while missing := set(roles) - set(self.peers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer: no handshake from {sorted(missing)} within {timeout_s:.0f}s; not sealed")
            time.sleep(0.01)
        self.slots.unlink()
        self.shared_counters.unlink()
        self.index.unlink()
        self.arena.unlink()
        self.ipc.cleanup()
        log.info("transfer: sealed %s (shared memory and ipc directory unlinked, still mapped)", self.prefix)

    def wire_counters(self) -> dict[str, Any]:
        """Frames received on the command socket, dropped per reason, refused per reason; the peers
        connected to it; plan deltas the schedule dropped (rounds that had passed) or ignored (the
        verifier schedules)."""
        schedule = self.server.schedule
        return {"received": self.channel.received, "dropped": dict(self.channel.dropped),
                "refused": dict(self.server.rejections), "peers": self.peers(),
                "plans_dropped": schedule.plans_dropped if schedule is not None else 0,
                "plans_ignored": self.server.plans_ignored}

    def pid(self) -> int:
        """This worker's process id (fault-injection tests)."""
        return os.getpid()

    def counters(self) -> dict[str, float]:
        """Link counters (also mirrored in shared memory for the verifier); on a CUDA link also
        ``demand_outstanding_s`` (wall seconds during which a demand copy was queued or moving),
        ``demand_issue_s`` and ``demands_issued`` (wall seconds from a demand being asked for to its
        copy being issued, summed, and how many: ``CudaSlotWriterLink``)."""
        moved, busy, transfers = self.shared_counters.read()
        counters = {"bytes_moved": moved, "busy_s": busy, "transfers": transfers, "rejected": self.server.rejected}
        for name in ("demand_outstanding_s", "demand_issue_s", "demands_issued"):
            value = getattr(self.server.link, name, None)
            if value is not None:
                counters[name] = value
        return counters

    def close(self) -> list[str]:
        """Stop serving, close the socket, remove the ipc dir and the shared memory; returns what
        ``unlink_prefix`` still had to remove (nothing when all went well)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.server.close()
        self.channel.close()
        self.ipc.cleanup()
        self.slots.close()
        self.slots.unlink()
        self.shared_counters.close()
        self.index.close()
        del self.store  # its blob views hold the arena's mapping
        self.arena.close()
        return unlink_prefix(self.prefix)

    def _publish(self) -> None:
        """Bytes moved (counter) and the link's busy fraction over each interval (gauge)."""
        last_moved, last_busy, last_t = 0.0, 0.0, time.monotonic()
        while not self._stop.wait(self.metrics_every_s):
            try:
                moved, busy, _ = self.shared_counters.read()
            except Exception:  # closing: the counters are unmapped
                return
            now = time.monotonic()
            self.metrics.inc("specter_bytes_moved", moved - last_moved)
            self.metrics.set("specter_link_busy_fraction", min(1.0, (busy - last_busy) / max(now - last_t, 1e-9)))
            last_moved, last_busy, last_t = moved, busy, now

    def _serve(self) -> None:
        try:
            hello = self.channel.handshake("transfer", self.handshake_timeout_s)
            self._first = hello.role if hello is not None else "?"
            self.server.serve(self._stop)
        except Exception:
            log.exception("transfer: the command loop stopped")
