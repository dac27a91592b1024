"""The transfer process's link on a GPU: pinned host blobs into the shared device slots on a copy stream.

``CudaSlotWriterLink`` is ``transfer_server.SlotWriterLink``'s counterpart when the slots are on a
CUDA device (``--processes --link cuda``): the same seq-table protocol, with the copy ordered against
the verifier's kernels by the slots' two interprocess events (``specter/remote/shm.py``) instead of
by the host. ``CopyStream`` holds the CUDA calls themselves (a stand-in replaces it in the CPU tests
of the order of calls, ``tests/actors/test_remote_link.py``).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from specter.experts.link import DEMAND, PipelinedLink, Transfer
from specter.remote.counters import SharedCounters
from specter.remote.shm import SharedSlots


class CopyStream:
    """A CUDA copy stream and the calls ``CudaSlotWriterLink`` issues on it (a stand-in replaces it
    in the CPU tests of the link's order of calls).

    Args:
        device: the slots' device.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """On the stream: copy ``src`` → ``dst`` between two timing events (returned: what
        :meth:`seconds` waits on)."""
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        return start, end

    def seconds(self, handle: Any) -> float:
        """Wait for an issued copy; the copy engine's seconds for it (the reader wait not included)."""
        start, end = handle
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


class CudaSlotWriterLink(PipelinedLink):
    """The transfer process's CUDA link: pinned host blobs into the shared device slots on a copy
    stream of its own, two copies in flight (``PipelinedLink``: demands still jump every copy not
    issued yet).

    Each copy claims its slot in the seq table (waiting while the verifier pins it), makes the copy
    stream wait on the slot's reader event (the kernels that last read the slot), copies, records the
    slot's copy event on the stream and publishes the key at once: the verifier's compute stream waits
    on that event, so neither side syncs the host for the other; the published due time is the issue
    time (the reader does not wait on the host). Bytes and transfers are counted as each copy is
    published, busy seconds from CUDA timing events around the copy alone once it is done. The link
    model's ``timed`` switch (``LinkTiming``) has nothing to switch here: copies take what they take.

    Two figures say where a demand's time goes before its bytes move: ``demand_outstanding_s`` (wall
    seconds during which some demand copy was queued or moving: the copy engine's busy seconds over it
    is its share of that time) and ``demand_issue_s`` over ``demands_issued`` (the mean wall time from a
    demand being asked for — submitted as one, or a prefetch promoted — to its copy being issued on the
    stream: the command's hand-off to the copy thread, a pinned slot, the copies ahead of it).

    Args:
        slots: the shared slots (created by this process, on the device).
        counters: the shared counters.
        copies: the copy stream (default: a new one on the slots' device).
        in_flight: copies issued and not yet done, at most.
    """

    name = "cudaslots"

    def __init__(self, slots: SharedSlots, counters: SharedCounters, copies: CopyStream | None = None,
                 in_flight: int = 2):
        self.slots, self.counters = slots, counters
        self.copies = copies if copies is not None else CopyStream(slots.storage.device)
        self.untimed: weakref.WeakSet[Transfer] = weakref.WeakSet()
        self.timed = True
        self.demand_outstanding_s = 0.0  # wall seconds during which a timed demand copy was queued or moving
        self._demands: weakref.WeakSet[Transfer] = weakref.WeakSet()  # those queued or moving now
        self._outstanding_since = 0.0
        self.demand_issue_s = 0.0  # wall seconds from a demand being asked for to its copy issued, summed
        self.demands_issued = 0
        self._promoted: weakref.WeakKeyDictionary[Transfer, float] = weakref.WeakKeyDictionary()  # prefetch → when made a demand
        super().__init__(in_flight)

    def submit(self, key: tuple[int, int], slot: int, src: torch.Tensor, dst: torch.Tensor, priority: int,
               wait_for: Any = None) -> Transfer:
        transfer = super().submit(key, slot, src, dst, priority, wait_for)
        if priority == DEMAND:
            self._outstanding(transfer, True)
        return transfer

    def promote(self, transfer: Transfer) -> None:
        if transfer.priority != DEMAND:
            self._promoted[transfer] = time.perf_counter()  # before: the copy thread may issue it at once
        super().promote(transfer)
        if transfer.priority != DEMAND:  # it had started: never a demand
            self._promoted.pop(transfer, None)
        if transfer.priority == DEMAND and not transfer.done.is_set():
            self._outstanding(transfer, True)

    def cancel(self, transfer: Transfer) -> bool:
        dropped = super().cancel(transfer)
        if dropped:
            self._outstanding(transfer, False)
        return dropped

    def _outstanding(self, transfer: Transfer, waiting: bool) -> None:
        """Count the wall time some demand copy is queued or moving (``demand_outstanding_s``: the
        copy engine's busy seconds over it is its share of that time, for a demand-only policy)."""
        with self._cond:
            if waiting and transfer not in self.untimed:
                if not self._demands:
                    self._outstanding_since = time.perf_counter()
                self._demands.add(transfer)
            elif transfer in self._demands:
                self._demands.discard(transfer)
                if not self._demands:
                    self.demand_outstanding_s += time.perf_counter() - self._outstanding_since

    def submit_untimed(self, key: tuple[int, int], slot: int, src, dst, priority: int) -> Transfer:  # type: ignore[no-untyped-def]
        """``submit`` a copy that is not the link's work in the counters (the initial residency fill)."""
        with self._cond:
            transfer = super().submit(key, slot, src, dst, priority)
            self.untimed.add(transfer)
        return transfer

    def _issue(self, transfer: Transfer) -> Any:
        try:
            self.slots.claim(transfer.slot, transfer.key, self.closing)  # waits while the verifier pins it
        except BaseException:
            self._outstanding(transfer, False)  # it never completes
            raise
        published, handle = None, None
        try:
            self.slots.wait_reader(transfer.slot, self.copies.stream)  # the kernels that last read the slot
            if transfer.priority == DEMAND and transfer not in self.untimed:  # asked for at submit, or when promoted
                self.demand_issue_s += time.perf_counter() - self._promoted.pop(transfer, transfer.submitted)
                self.demands_issued += 1
            handle = self.copies.copy(transfer.dst, transfer.src)
            published = transfer.key
        except BaseException:
            self._outstanding(transfer, False)  # it never completes
            raise
        finally:
            now = time.perf_counter()
            if published is not None:
                self.counters.moving(now + self.estimate_s(transfer.nbytes))
                if transfer not in self.untimed:
                    self.counters.add(transfer.nbytes, 0.0)
            # the copy event is recorded on the copy stream before the even sequence number
            self.slots.publish(transfer.slot, published, stream=self.copies.stream, due=now if published else 0.0)
        return handle

    def _complete(self, transfer: Transfer, handle: Any) -> float:
        try:
            busy = self.copies.seconds(handle)
        finally:
            self._outstanding(transfer, False)
        if transfer not in self.untimed:
            self.counters.add(0, busy, transfers=0)
        return busy

    def describe(self) -> str:
        return f"cuda-slots:{self.slots.storage.device}"
