"""The host→device link: a worker thread moves expert blobs into slots, one transfer at a time
(``PipelinedLink``: up to ``in_flight`` issued to a copy engine, a second thread waiting for them).

``CudaLink`` copies pinned host blobs on a dedicated copy stream; ``SimulatedLink`` copies on the
CPU and then holds the transfer until ``latency + bytes / bandwidth`` has passed since it started,
so that a CPU run feels the link as a GPU run would. Either way the copy runs in the link's own
thread, asynchronous with the compute of the caller, and urgent (demand) transfers jump ahead of
queued prefetches. The same link on a virtual clock, with no thread:
``specter/experts/virtual_link.py``.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.timing.clock import WallClock

DEMAND, PREFETCH = 0, 1
_PRIOR_BYTES_PER_S = 12e9  # before anything has moved: PCIe 4.0 x16 in practice, pageable
_WALL = WallClock()


class LinkError(RuntimeError):
    """A transfer failed, or the link stalled past its timeout."""


@dataclass(eq=False)
class Transfer:
    """One blob on its way into one slot."""

    key: tuple[int, int]
    slot: int
    nbytes: int
    priority: int
    src: torch.Tensor = field(repr=False)
    dst: torch.Tensor = field(repr=False)
    wait_for: Any = field(default=None, repr=False)
    submitted: float = field(default_factory=time.perf_counter)
    started: bool = False
    started_at: float = 0.0
    due: float = 0.0  # on a virtual link: when it lands (set as it starts)
    cancelled: bool = False
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    copied: threading.Event = field(default_factory=threading.Event, repr=False)  # bytes in the slot

    def wait(self, timeout: float, copied: bool = False) -> float:
        """Block until the transfer has landed (``copied``: until its bytes are in the slot, which a
        simulated link's waiter then holds to the due time itself); returns the seconds waited."""
        t0 = time.perf_counter()
        if not (self.copied if copied else self.done).wait(timeout):
            raise LinkError(f"transfer of expert {self.key} into slot {self.slot} did not finish in {timeout:.1f}s")
        if self.error is not None:
            raise LinkError(f"transfer of expert {self.key} failed: {self.error}") from self.error
        return time.perf_counter() - t0


class Link:
    """Base class: a priority queue drained by one worker thread (``_run``); subclasses do the copy."""

    name = "link"

    def __init__(self) -> None:
        self.bytes_moved = 0
        self.busy_s = 0.0
        self.transfers = 0
        self._heap: list[tuple[int, int, Transfer]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._current: Transfer | None = None  # the transfer being moved now
        self._counts_lock = threading.Lock()  # the three counters change together (``counts``)
        self._start_worker()

    def _start_worker(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"specter-{self.name}", daemon=True)
        self._thread.start()

    def submit(
        self, key: tuple[int, int], slot: int, src: torch.Tensor, dst: torch.Tensor, priority: int, wait_for: Any = None
    ) -> Transfer:
        """Queue ``src`` (host blob) → ``dst`` (slot); demand transfers go before prefetches."""
        transfer = Transfer(key, slot, src.numel() * src.element_size(), priority, src, dst, wait_for)
        with self._cond:
            if self._closed:
                raise LinkError("the link is closed")
            heapq.heappush(self._heap, (priority, next(self._seq), transfer))
            self._cond.notify()
        return transfer

    def promote(self, transfer: Transfer) -> None:
        """Make a queued prefetch urgent (a pass needs it now)."""
        with self._cond:
            if not transfer.started and transfer.priority != DEMAND:
                transfer.priority = DEMAND
                heapq.heappush(self._heap, (DEMAND, next(self._seq), transfer))
                self._cond.notify()

    def cancel(self, transfer: Transfer) -> bool:
        """Drop a transfer that has not started; returns whether it was dropped."""
        with self._cond:
            if transfer.started:
                return False
            transfer.cancelled = True
            return True

    def estimate_s(self, nbytes: int) -> float:
        """Seconds one transfer of ``nbytes`` takes: the bandwidth measured so far, else a prior."""
        moved, busy, _ = self.counts()  # one read (a remote link's counters are in shared memory)
        rate = moved / busy if busy > 0 else _PRIOR_BYTES_PER_S
        return nbytes / rate

    def free_at(self, now: float) -> float:
        """When the transfer moving now (if any) is expected to land; queued ones come after it."""
        current = self._current
        if current is None or current.done.is_set():
            return now
        return max(now, current.started_at + self.estimate_s(current.nbytes))

    def landing(self, transfer: Transfer, now: float) -> float | None:
        """When a started transfer is expected to land (None if it has not started)."""
        if transfer.done.is_set():
            return now
        if not transfer.started:
            return None
        return max(now, transfer.started_at + self.estimate_s(transfer.nbytes))

    def wait(self, transfer: Transfer, timeout: float) -> float:
        """Block until ``transfer`` has landed; returns the seconds waited."""
        return transfer.wait(timeout)

    def queued(self) -> int:
        with self._cond:
            return sum(1 for _, _, t in self._heap if not (t.started or t.cancelled))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def closing(self) -> bool:
        """Whether ``close`` was called (a copy waiting on something outside the link gives up then)."""
        return self._closed

    def _next(self, block: bool = True) -> Transfer | None:
        """The most urgent queued transfer, marked started; None when the link is closed (or, not
        blocking, when nothing is queued)."""
        with self._cond:
            while True:
                while self._heap:
                    _, _, transfer = heapq.heappop(self._heap)
                    if not (transfer.started or transfer.cancelled):
                        transfer.started = True
                        transfer.started_at = time.perf_counter()
                        self._current = transfer
                        return transfer
                if self._closed or not block:
                    return None
                self._cond.wait()

    def _run(self) -> None:
        while (transfer := self._next()) is not None:
            t0 = time.perf_counter()
            busy = None
            try:
                busy = self._move(transfer)
            except BaseException as exc:  # reported to the waiter, never kills the thread
                transfer.error = exc
            self._count(transfer, busy if busy is not None else time.perf_counter() - t0)
            transfer.copied.set()
            if transfer.error is None:
                self._land(transfer)
            transfer.done.set()

    def _count(self, transfer: Transfer, busy: float) -> None:
        """One finished transfer in the link's counters."""
        with self._counts_lock:
            self.busy_s += busy
            self.bytes_moved += transfer.nbytes
            self.transfers += 1

    def counts(self) -> tuple[int, float, int]:
        """``(bytes_moved, busy_s, transfers)`` at one moment: never a transfer's bytes without its count
        (the link's thread counts while the caller reads)."""
        with self._counts_lock:
            return self.bytes_moved, self.busy_s, self.transfers

    def _move(self, transfer: Transfer) -> float | None:
        """Move one blob; returns the link's busy seconds for it (None: the time the call took)."""
        raise NotImplementedError

    def _land(self, transfer: Transfer) -> None:
        """After the copy: hold the transfer until it is due (a simulated link); nothing by default."""


class SimulatedLink(Link):
    """A CPU stand-in for PCIe: a transfer takes ``latency + bytes / bandwidth`` seconds.

    Args:
        bandwidth: bytes per second.
        latency: seconds added to every transfer.
    """

    name = "simlink"

    def __init__(self, bandwidth: float, latency: float = 0.0):
        if not bandwidth > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bandwidth}")
        if not latency >= 0:
            raise ValueError(f"link latency must be >= 0 s, got {latency}")
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.timed = True  # False: copies complete at memcpy speed (untimed phases of a benchmark)
        self._due = 0.0  # when the last timed transfer was due to land
        super().__init__()

    def estimate_s(self, nbytes: int) -> float:
        """Exactly the simulated time (0 while untimed)."""
        return self.latency + nbytes / self.bandwidth if self.timed else 0.0

    def wait(self, transfer: Transfer, timeout: float) -> float:
        """Block until ``transfer`` has landed: its bytes are copied and its due time has passed.

        The waiter sleeps to the due time itself (``WallClock.wait_until``) instead of waiting for
        the link thread to wake at it and hand over: that hand-off is a cost of simulating a link
        with a thread (a DMA engine's completion needs no interpreter lock), and a link thread that
        spins to be on time takes the lock from the compute thread (``docs/benchmark.md``)."""
        t0 = time.perf_counter()
        transfer.wait(timeout, copied=True)
        _WALL.wait_until(transfer.due)
        return time.perf_counter() - t0

    def _move(self, transfer: Transfer) -> float | None:
        if not self.timed:
            transfer.dst.copy_(transfer.src)
            self._due = transfer.due = time.perf_counter()
            return None
        begin, transfer.due = self._schedule(transfer)
        transfer.dst.copy_(transfer.src)
        return transfer.due - begin

    def _land(self, transfer: Transfer) -> None:
        """Sleep until the transfer is due (no spinning: its waiter keeps the time, ``wait``)."""
        remaining = transfer.due - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def _schedule(self, transfer: Transfer) -> tuple[float, float]:
        """When ``transfer`` starts and lands. A copy engine starts a transfer when it is submitted
        or when the one before it is due, not when this thread happens to wake up: the thread's own
        latency is not the link's."""
        begin = max(transfer.submitted, self._due)
        transfer.started_at = begin
        self._due = begin + self.latency + transfer.nbytes / self.bandwidth
        return begin, self._due

    def describe(self) -> str:
        return f"sim:{self.bandwidth / 1e9:g}GB/s,{self.latency * 1e6:g}us"


class PipelinedLink(Link):
    """A link whose copies are issued to an engine that runs them in order on its own, up to
    ``in_flight`` at a time, so consecutive copies run back to back instead of each waiting for a
    host round trip. Two threads: one issues (``_run``: the most urgent queued transfer, as soon as
    fewer than ``in_flight`` are issued and not done), one waits for the issued copies in order
    (``_finish``). A transfer submitted while a copy moves is therefore issued at once, behind it
    on the engine, not when that copy is done: the engine has no gap between them. Transfers not
    issued yet stay in the priority queue (a demand still jumps every queued prefetch; an issued
    one can no longer be cancelled). Subclasses implement ``_issue`` and ``_complete``.

    Args:
        in_flight: transfers issued and not yet completed, at most (1: one at a time).
    """

    def __init__(self, in_flight: int = 2):
        if in_flight < 1:
            raise ValueError(f"in_flight: must be >= 1, got {in_flight}")
        self.in_flight = in_flight
        self._room = threading.Semaphore(in_flight)  # issued and not done: fewer than in_flight
        self._issued: queue.SimpleQueue[tuple[Transfer, Any] | None] = queue.SimpleQueue()
        self._last: Transfer | None = None  # the latest issued
        super().__init__()

    def _start_worker(self) -> None:
        self._finisher = threading.Thread(target=self._finish, name=f"specter-{self.name}-done", daemon=True)
        self._finisher.start()
        super()._start_worker()

    def _run(self) -> None:
        """Issue transfers, most urgent first, while fewer than ``in_flight`` are not done."""
        try:
            while True:
                self._room.acquire()
                transfer = self._next()
                if transfer is None:
                    return
                ahead = self._last
                if ahead is not None and not ahead.done.is_set():  # it lands after the one before it on the engine
                    transfer.started_at = max(transfer.started_at, ahead.started_at + self.estimate_s(ahead.nbytes))
                try:
                    handle = self._issue(transfer)
                except BaseException as exc:  # reported to the waiter, never kills the thread
                    transfer.error = exc
                    transfer.copied.set()
                    transfer.done.set()
                    self._room.release()
                    continue
                self._last = transfer
                self._issued.put((transfer, handle))
        finally:
            self._issued.put(None)  # the finisher ends after the copies issued before it

    def _finish(self) -> None:
        """Wait for each issued copy in order; count it, mark it done, make room for the next."""
        while (item := self._issued.get()) is not None:
            transfer, handle = item
            busy = 0.0
            try:
                busy = self._complete(transfer, handle)
            except BaseException as exc:
                transfer.error = exc
            self._count(transfer, busy)
            transfer.copied.set()
            transfer.done.set()
            self._room.release()

    def close(self) -> None:
        super().close()
        self._finisher.join(timeout=5)

    def _issue(self, transfer: Transfer) -> Any:
        """Hand the copy to the engine (asynchronously); returns what ``_complete`` waits on."""
        raise NotImplementedError

    def _complete(self, transfer: Transfer, handle: Any) -> float:
        """Block until the issued copy is done; returns the engine's busy seconds for it."""
        raise NotImplementedError


class CudaLink(PipelinedLink):
    """Pinned host blob → device slot on a dedicated copy stream, ordered by CUDA events.

    Each copy first makes the stream wait for the slot's last reader (``wait_for``: compute that
    still reads the old occupant), and is timed by a pair of CUDA timing events around the copy
    alone, so ``busy_s`` is the copy engine's time, not the time spent waiting for that reader.
    Two copies are in flight by default (``PipelinedLink``).
    """

    name = "cudalink"

    def __init__(self, device: torch.device, in_flight: int = 2):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        super().__init__(in_flight)

    def _issue(self, transfer: Transfer) -> Any:
        with torch.cuda.stream(self.stream):
            if transfer.wait_for is not None:
                self.stream.wait_event(transfer.wait_for)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            transfer.dst.copy_(transfer.src, non_blocking=True)
            end.record(self.stream)
        return start, end

    def _complete(self, transfer: Transfer, handle: Any) -> float:
        start, end = handle
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def describe(self) -> str:
        return f"cuda:{self.device}"
