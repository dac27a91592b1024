"""A ``Link`` whose copies happen in another process (the transfer actor).

``submit``/``promote``/``cancel`` send ``FetchExpert``/``PromoteFetch``/``DropFetch`` over a
ZeroMQ push channel; a transfer's completion is read from the shared slots' seq table (its
``done`` is a :class:`SeqEvent`), so readiness costs no message and no Ray call. Counters come
from the transfer side's :class:`~specter.remote.counters.SharedCounters`. Setting
``timed`` (the engine's untimed prefill) sends ``LinkTiming``, so the transfer side's link model
is switched off and on exactly as an in-process ``SimulatedLink``'s.

Whether a transfer has started is also read from the table (its slot's sequence number moved
since it was submitted). A cancel that races with the copy thread starting that very transfer is
answered True here although the copy goes on: the slot then receives the old blob before any later
transfer into it (one copy thread, in order), and readers only trust a slot whose published key is
the one they wait for, so the stray copy is harmless (docs/actors.md).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any

import torch

from specter.config import LinkConfig
from specter.experts.link import DEMAND, Link, LinkError, Transfer
from specter.experts.slots import Key
from specter.protocol import DropFetch, FetchExpert, LinkTiming, PromoteFetch
from specter.remote.channel import Channel
from specter.remote.counters import SharedCounters
from specter.remote.shm import MAX_SLEEP_S, SharedSlots
from specter.timing.clock import WallClock

_FOREVER_S = 1e9
_PRUNE_AT = 4096
_POLL_S = 50e-6  # close polling around a landing (a sleep this short wakes ~20 µs late here)
_IDLE_S = 2e-3  # nothing due for this long: back off (the copy thread may be waiting on a pin)
WALL = WallClock()


def nap(counters: SharedCounters, end: float, idle: float) -> float:
    """Sleep while waiting for a blob: to just before the copy moving now lands (nothing lands
    before it: one copy thread), or a poll step once it is due; when nothing has been due for a
    while (the copy thread may be waiting on a pinned slot) back off. Returns the new ``idle``
    (how long nothing has been due). Once backing off it looks at the transfer process: gone, it
    raises ``PeerGone`` (``specter/remote/peers.py``) instead of waiting out ``end``."""
    now = time.perf_counter()
    ahead = counters.due() - now  # the moving transfer lands then (the writer's clock)
    if ahead > _POLL_S:
        time.sleep(min(ahead - _POLL_S / 2, end - now))
        return 0.0
    if idle >= _IDLE_S:  # nothing due for a while: is the transfer process still there?
        counters.writer.check("an expert was awaited")
    idle += _POLL_S
    time.sleep(_POLL_S if idle < _IDLE_S else min(idle / 8, MAX_SLEEP_S))
    return idle


class SeqEvent(threading.Event):
    """Set once ``slots`` shows ``key`` published in ``slot`` at a sequence number after ``after``
    and the blob's due time (published with it) has passed.

    ``wait`` sleeps while the transfer moving now (``counters.due``) is not due — nothing can land
    before it does: one copy thread — and polls closely once it is; when nothing has been due for a
    while (the copy thread may be waiting on a pinned slot) it backs off like ``wait_ready``. Once
    the blob is published it sleeps to its due time itself (``WallClock.wait_until``): the copy
    thread publishes as soon as the bytes are in, so its own wake-up is not on the reader's path.
    """

    def __init__(self, slots: SharedSlots, slot: int, key: Key, after: int, counters: SharedCounters):
        super().__init__()
        self.slots, self.slot, self.after, self.counters = slots, slot, after, counters
        self.key: Key = (key[0], key[1])
        self.due: float | None = None  # when the published blob lands (once seen published)

    def published(self) -> bool:
        """The blob is in the slot (it may not be due yet)."""
        if self.due is not None:
            return True
        got, seq = self.slots.read(self.slot)
        if got == self.key and seq > self.after:
            self.due = self.slots.due(self.slot)
            return True
        return False

    def is_set(self) -> bool:
        if super().is_set():
            return True
        if self.published() and time.perf_counter() >= (self.due or 0.0):
            self.set()
            return True
        return False

    def started(self) -> bool:
        """The slot has been claimed for a write since the transfer was submitted."""
        return self.due is not None or super().is_set() or self.slots.read(self.slot)[1] != self.after

    def wait(self, timeout: float | None = None) -> bool:
        end = time.perf_counter() + (_FOREVER_S if timeout is None else timeout)
        idle = 0.0  # how long nothing has been due
        while not self.published():
            if time.perf_counter() >= end:
                return False
            idle = nap(self.counters, end, idle)
        assert self.due is not None
        if self.due > end:
            return False
        WALL.wait_until(self.due)
        self.slots.wait_copy(self.slot)  # CUDA: the reader's stream waits for the copy's event
        self.set()
        return True


class RemoteLink(Link):
    """The verifier's link: commands to the transfer actor, readiness from shared memory.

    Args:
        channel: a connected push channel to the transfer actor (handshake done).
        slots: the attached shared slots (``slots.storage`` is the verifier's slot pool).
        counters: the transfer side's counters, attached.
        model: the transfer side's link model; a simulated one makes ``estimate_s`` exact, as in
            process (None: the bandwidth measured so far).
    """

    name = "remotelink"

    def __init__(self, channel: Channel, slots: SharedSlots, counters: SharedCounters,
                 model: LinkConfig | None = None):
        # No worker thread here: the transfer actor's copy thread does the work.
        self.channel, self.slots, self.counters = channel, slots, counters
        self.model = model if model is not None and model.kind == "sim" else None
        self._timed = True
        self._ids = itertools.count()
        self._id_of: weakref.WeakKeyDictionary[Transfer, int] = weakref.WeakKeyDictionary()
        self._waiting: dict[int, Transfer] = {}  # submitted, not yet seen started or cancelled
        self._closed = False

    # Counters live on the transfer side; the base class's attributes become read-only views.
    def counts(self) -> tuple[int, float, int]:
        """``(bytes_moved, busy_s, transfers)`` from one read of the shared counters."""
        return self.counters.read()

    @property
    def bytes_moved(self) -> int:  # type: ignore[override]
        return self.counts()[0]

    @property
    def busy_s(self) -> float:  # type: ignore[override]
        return self.counts()[1]

    @property
    def transfers(self) -> int:  # type: ignore[override]
        return self.counts()[2]

    def estimate_s(self, nbytes: int) -> float:
        """Seconds one transfer takes: the simulated link's own time (0 while untimed), else measured."""
        if self.model is None:
            return super().estimate_s(nbytes)
        return self.model.latency + nbytes / self.model.bandwidth if self._timed else 0.0

    def free_at(self, now: float) -> float:
        """When the transfer moving now on the transfer side is due to land (now, if none)."""
        return max(now, self.counters.due())

    def landing(self, transfer: Transfer, now: float) -> float | None:
        """When a started transfer is due (the copy thread moves one at a time, so a started one
        that has not landed is the one moving now); None if it has not started."""
        if transfer.done.is_set():
            return now
        if not self._started(transfer):
            return None
        done = transfer.done
        due = done.due if isinstance(done, SeqEvent) else None
        return max(now, self.counters.due() if due is None else due)

    @property
    def timed(self) -> bool:
        """False while the transfer side's copies skip the link model (``SimulatedLink.timed``)."""
        return self._timed

    @timed.setter
    def timed(self, value: bool) -> None:
        # The transfer side switches when it reads this, after every command sent before it; as in
        # process, each copy takes the mode of the moment it starts.
        if bool(value) != self._timed:
            self.channel.send(LinkTiming(bool(value)))
            self._timed = bool(value)

    def submit(
        self, key: Key, slot: int, src: torch.Tensor, dst: torch.Tensor, priority: int, wait_for: Any = None
    ) -> Transfer:
        """Ask the transfer actor to copy ``key`` into ``slot``; ``src`` is not used here.

        ``wait_for`` (CUDA: the event of the last kernels that read the slot) cannot be waited on by
        the other process's copy stream, so this side's stream waits on it and records the slot's
        interprocess reader event after it (``SharedSlots.mark_read``), which the copy stream waits
        on before it overwrites the slot: no host sync."""
        if wait_for is not None:
            self.slots.mark_read(slot, after=wait_for)
        return self._send_fetch(key, slot, dst, priority, timed=True)

    def place(self, placements: list[tuple[Key, int]], timeout: float) -> None:
        """Fill slots untimed (the initial residency) and wait until all are published."""
        transfers = [
            self._send_fetch(key, slot, self.slots.storage[slot], DEMAND, timed=False) for key, slot in placements
        ]
        for transfer in transfers:
            transfer.wait(timeout)

    def promote(self, transfer: Transfer) -> None:
        """Make a queued prefetch urgent."""
        if transfer.priority == DEMAND or self._started(transfer):
            return
        transfer.priority = DEMAND
        self.channel.send(PromoteFetch(self._id_of[transfer]))

    def cancel(self, transfer: Transfer) -> bool:
        """Drop a transfer that has not started (as seen in the seq table)."""
        if self._started(transfer):
            return False
        transfer.cancelled = True
        self.channel.send(DropFetch(self._id_of[transfer]))
        return True

    def queued(self) -> int:
        """Transfers submitted and not started (a started one stays started: each is checked until then)."""
        for tid, transfer in list(self._waiting.items()):
            if transfer.cancelled or self._started(transfer):
                del self._waiting[tid]
        return len(self._waiting)

    def close(self) -> None:
        """Forget the transfer actor; the channel belongs to the caller."""
        self._closed = True

    def describe(self) -> str:
        return f"remote:{self.channel.address}"

    def _send_fetch(self, key: Key, slot: int, dst: torch.Tensor, priority: int, timed: bool) -> Transfer:
        if self._closed:
            raise LinkError("the remote link is closed")
        _, seq = self.slots.read(slot)
        empty = torch.empty(0, dtype=dst.dtype)
        nbytes = dst.numel() * dst.element_size()
        event = SeqEvent(self.slots, slot, key, seq, self.counters)
        transfer = Transfer((key[0], key[1]), slot, nbytes, priority, empty, dst, None, done=event)  # type: ignore[arg-type]
        tid = next(self._ids)
        self._id_of[transfer] = tid
        if timed:
            self._waiting[tid] = transfer
            if len(self._waiting) > _PRUNE_AT:  # policies that never ask ``queued`` keep it small too
                self.queued()
        self.channel.send(FetchExpert(tid, key[0], key[1], slot, priority, timed))
        return transfer

    def _started(self, transfer: Transfer) -> bool:
        done = transfer.done
        return done.started() if isinstance(done, SeqEvent) else done.is_set()
