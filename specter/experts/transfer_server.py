"""The transfer side of the remote link: copy commands in, blobs into shared slots, seq table out.

``SlotWriterLink`` is a ``SimulatedLink`` (same time model: ``latency + bytes / bandwidth`` per
transfer, one at a time, demand before prefetch, queued ones cancellable) whose copies land in
:class:`~specter.experts.shm.SharedSlots`: each transfer claims its slot in the seq table, copies,
waits out the link model, counts itself in :class:`SharedCounters`, then publishes the key.
``TransferServer`` reads ``FetchExpert``/``PromoteFetch``/``DropFetch`` from a channel and drives it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from specter.actor_channel import ActorChannel
from specter.actor_messages import DropFetch, FetchExpert, PromoteFetch
from specter.config import LinkConfig
from specter.experts.link import SimulatedLink, Transfer
from specter.experts.shared_counters import SharedCounters
from specter.experts.shm import SharedSlots
from specter.experts.store import ExpertStore
from specter.protocol import Shutdown

log = logging.getLogger(__name__)

PINNED_RETRY_S = 1e-4
_PRUNE_AT = 4096


class SlotWriterLink(SimulatedLink):
    """A simulated link that writes shared slots and publishes them in their seq table.

    Args:
        slots: the shared slots (created by this process).
        counters: where to count finished timed transfers (before each publish).
        bandwidth: bytes per second.
        latency: seconds added to every transfer.
    """

    name = "slotlink"

    def __init__(self, slots: SharedSlots, counters: SharedCounters, bandwidth: float, latency: float = 0.0):
        self.slots, self.counters = slots, counters
        self.untimed: weakref.WeakSet[Transfer] = weakref.WeakSet()
        super().__init__(bandwidth, latency)

    def submit_untimed(self, key: tuple[int, int], slot: int, src, dst, priority: int) -> Transfer:  # type: ignore[no-untyped-def]
        """``submit`` a copy that skips the link model (the initial residency fill)."""
        with self._cond:  # an RLock: the copy thread cannot pick it up before it is marked
            transfer = self.submit(key, slot, src, dst, priority)
            self.untimed.add(transfer)
        return transfer

    def _move(self, transfer: Transfer) -> None:
        t0 = time.perf_counter()
        while not self.slots.begin_write(transfer.slot):  # a reader pins it (not done by the verifier yet)
            time.sleep(PINNED_RETRY_S)
        published = None
        try:
            if transfer in self.untimed:
                transfer.dst.copy_(transfer.src)
            else:
                super()._move(transfer)
                self.counters.add(transfer.nbytes, time.perf_counter() - t0)
            published = transfer.key
        finally:
            self.slots.publish(transfer.slot, published)


class TransferServer:
    """Serves copy commands from the verifier.

    Args:
        store: the host blobs.
        slots: the shared slots this process created.
        counters: the shared counters this process created.
        link: the link model (``sim``; a CUDA copy stream is the next step).
        channel: a pull channel from the verifier.
    """

    def __init__(
        self, store: ExpertStore, slots: SharedSlots, counters: SharedCounters, link: LinkConfig,
        channel: ActorChannel,
    ):
        if link.kind != "sim":
            raise ValueError("link: the transfer actor supports sim:GBPS links only so far")
        self.store, self.slots, self.channel = store, slots, channel
        self.link = SlotWriterLink(slots, counters, link.bandwidth, link.latency)
        self.transfers: dict[int, Transfer] = {}
        self.rejected = 0

    def handle(self, msg: object) -> bool:
        """Act on one message; False when it says to stop."""
        if isinstance(msg, FetchExpert):
            self._fetch(msg)
        elif isinstance(msg, PromoteFetch | DropFetch):
            transfer = self.transfers.get(msg.id)
            if transfer is None:
                return True
            if isinstance(msg, PromoteFetch):
                self.link.promote(transfer)
            else:
                self.link.cancel(transfer)
        elif isinstance(msg, Shutdown):
            return False
        else:
            log.warning("transfer: ignoring a %s message", type(msg).__name__)
        return True

    def serve(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Handle messages until ``stop`` is set or a ``Shutdown`` arrives."""
        while not stop.is_set():
            msg = self.channel.recv(poll_s)
            if msg is not None and not self.handle(msg):
                return

    def close(self) -> None:
        """Stop the copy thread (queued copies are dropped)."""
        self.link.close()

    def _fetch(self, msg: FetchExpert) -> None:
        if msg.layer not in self.store.layers or msg.expert >= self.store.num_experts or msg.slot >= self.slots.num_slots:
            self.rejected += 1
            log.warning("transfer: refusing %s (no such expert or slot)", msg)
            return
        src = self.store.blob(msg.layer, msg.expert)
        dst = self.slots.storage[msg.slot]
        key = (msg.layer, msg.expert)
        if msg.timed:
            transfer = self.link.submit(key, msg.slot, src, dst, msg.priority)
        else:
            transfer = self.link.submit_untimed(key, msg.slot, src, dst, msg.priority)
        self.transfers[msg.id] = transfer
        if len(self.transfers) > _PRUNE_AT:
            self.transfers = {i: t for i, t in self.transfers.items() if not t.done.is_set()}
