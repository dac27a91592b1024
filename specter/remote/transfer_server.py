"""The transfer side of the remote link: copy commands in, blobs into shared slots, seq table out.

``SlotWriterLink`` is a ``SimulatedLink`` (same time model: ``latency + bytes / bandwidth`` per
transfer, one at a time, demand before prefetch, queued ones cancellable) whose copies land in
:class:`~specter.remote.shm.SharedSlots`: each transfer claims its slot in the seq table, copies,
counts itself in :class:`SharedCounters`, publishes the key with the time it lands (the link
model's), and sleeps to that time before the next copy; the reader waits to it itself.
``TransferServer`` reads ``FetchExpert``/``PromoteFetch``/``DropFetch``/``LinkTiming`` from a
channel and drives it. A command that names no real expert, slot or transfer, or a message meant
for another actor, is refused before it indexes anything, counted in ``rejections`` by reason and
logged at most once per second per reason; nothing a peer sends stops the loop but ``Shutdown``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from specter.config import LinkConfig
from specter.experts.link import SimulatedLink, Transfer
from specter.experts.store import ExpertStore
from specter.protocol import DropFetch, FetchExpert, LinkTiming, PromoteFetch, Shutdown
from specter.remote.channel import Channel, DropLog
from specter.remote.counters import SharedCounters
from specter.remote.shm import SharedSlots

log = logging.getLogger(__name__)

OUT_OF_RANGE, UNKNOWN_ID, DUPLICATE_ID, UNEXPECTED = "out_of_range", "unknown_id", "duplicate_id", "unexpected"
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
        untimed = transfer in self.untimed or not self.timed
        begin, due = (t0, t0) if untimed else self._schedule(transfer)
        transfer.due = due
        # due before the slot turns odd: a reader that sees the copy started also sees when it lands
        self.counters.moving(due)
        while not self.slots.begin_write(transfer.slot):  # a reader pins it (not done by the verifier yet)
            time.sleep(PINNED_RETRY_S)
        published = None
        try:
            transfer.dst.copy_(transfer.src)
            if untimed:
                self._due = max(self._due, time.perf_counter())  # the next timed copy starts after it
                due = transfer.due = time.perf_counter()
            if transfer not in self.untimed:  # the initial fill is not the link's work
                self.counters.add(transfer.nbytes, max(due, time.perf_counter()) - begin)
            published = transfer.key
        finally:
            # Published as soon as the bytes are in, with when they land: the reader waits to
            # that time itself, and this thread sleeps to it (``_land``) before the next copy.
            self.slots.publish(transfer.slot, published, due=due if published is not None else 0.0)


class TransferServer:
    """Serves copy commands from the verifier.

    Args:
        store: the host blobs.
        slots: the shared slots this process created.
        counters: the shared counters this process created.
        link: the link model (``sim``; a CUDA copy stream is the next step).
        channel: a pull channel from the verifier.

    Attributes:
        rejections: refused commands per reason: ``out_of_range`` (no such layer, expert or slot),
            ``unknown_id`` (promote/drop of a transfer never fetched), ``duplicate_id`` (a fetch
            reusing the id of a pending transfer), ``unexpected`` (a message for another actor).
    """

    def __init__(
        self, store: ExpertStore, slots: SharedSlots, counters: SharedCounters, link: LinkConfig,
        channel: Channel,
    ):
        if link.kind != "sim":
            raise ValueError("link: the transfer actor supports sim:GBPS links only so far")
        self.store, self.slots, self.channel = store, slots, channel
        self.link = SlotWriterLink(slots, counters, link.bandwidth, link.latency)
        self.transfers: dict[int, Transfer] = {}
        self._layers = frozenset(store.layers)
        self._refuse = DropLog("transfer", (OUT_OF_RANGE, UNKNOWN_ID, DUPLICATE_ID, UNEXPECTED))
        self.rejections: dict[str, int] = self._refuse.counts

    @property
    def rejected(self) -> int:
        """Commands refused so far, all reasons."""
        return self._refuse.total

    def handle(self, msg: object) -> bool:
        """Act on one message; False when it says to stop."""
        if isinstance(msg, FetchExpert):
            self._fetch(msg)
        elif isinstance(msg, PromoteFetch | DropFetch):
            self._promote_or_drop(msg)
        elif isinstance(msg, LinkTiming):
            self.link.timed = msg.timed
        elif isinstance(msg, Shutdown):
            return False
        else:
            self._refuse(UNEXPECTED, f"a {type(msg).__name__} message is not for the transfer actor")
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

    def _promote_or_drop(self, msg: PromoteFetch | DropFetch) -> None:
        transfer = self.transfers.get(msg.id)
        if transfer is None:
            self._refuse(UNKNOWN_ID, f"{msg}: no transfer has this id")
        elif isinstance(msg, PromoteFetch):
            self.link.promote(transfer)
        else:
            self.link.cancel(transfer)

    def _fetch(self, msg: FetchExpert) -> None:
        if msg.layer not in self._layers or msg.expert >= self.store.num_experts or msg.slot >= self.slots.num_slots:
            self._refuse(OUT_OF_RANGE, f"{msg}: no such expert or slot")
            return
        pending = self.transfers.get(msg.id)
        if pending is not None and not (pending.done.is_set() or pending.cancelled):
            self._refuse(DUPLICATE_ID, f"{msg}: transfer {msg.id} is still pending")
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
            self.transfers = {i: t for i, t in self.transfers.items() if not (t.done.is_set() or t.cancelled)}
