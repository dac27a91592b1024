"""The host→device link on a virtual clock (``specter/timing/clock.py``): no thread, no sleep.

``VirtualLink`` is ``specter.experts.link.SimulatedLink``'s time model on the run's virtual clock.
Each operation first plays the link forward to the clock's now — transfers start, in priority
order, when the link is free, and land ``latency + bytes / bandwidth`` later — and waiting for a
transfer plays it forward to its landing and moves the clock there.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from specter.experts.link import LinkError, SimulatedLink, Transfer
from specter.timing.clock import VirtualClock


class VirtualLink(SimulatedLink):
    """``SimulatedLink`` on a virtual clock: transfers start and land at virtual times.

    Args:
        clock: the run's virtual clock.
        bandwidth: bytes per (virtual) second.
        latency: seconds added to every transfer.
    """

    name = "virtuallink"

    def __init__(self, clock: VirtualClock, bandwidth: float, latency: float = 0.0):
        self.clock = clock
        self._free = 0.0  # when the transfer moving now (or the last one) lands
        super().__init__(bandwidth, latency)

    def _start_worker(self) -> None:
        """No thread: the clock's readers play the link forward."""

    def submit(
        self, key: tuple[int, int], slot: int, src: torch.Tensor, dst: torch.Tensor, priority: int, wait_for: Any = None
    ) -> Transfer:
        now = self._play(self.clock.now())
        transfer = Transfer(key, slot, src.numel() * src.element_size(), priority, src, dst, wait_for, submitted=now)
        if self._closed:
            raise LinkError("the link is closed")
        heapq.heappush(self._heap, (priority, next(self._seq), transfer))
        return transfer

    def promote(self, transfer: Transfer) -> None:
        self._play(self.clock.now())
        super().promote(transfer)

    def cancel(self, transfer: Transfer) -> bool:
        self._play(self.clock.now())
        return super().cancel(transfer)

    def free_at(self, now: float) -> float:
        self._play(now)
        return super().free_at(now)

    def landing(self, transfer: Transfer, now: float) -> float | None:
        self._play(now)
        return super().landing(transfer, now)

    def queued(self) -> int:
        self._play(self.clock.now())
        return super().queued()

    def wait(self, transfer: Transfer, timeout: float) -> float:
        """Play the link forward until ``transfer`` lands and move the clock there."""
        now = self._play(self.clock.now())
        if transfer.cancelled and not transfer.started:
            raise LinkError(f"transfer of expert {transfer.key} was cancelled before it started")
        while not transfer.done.is_set():
            if not self._step(float("inf")):
                raise LinkError(f"transfer of expert {transfer.key} is not on the link")
        waited = self.clock.wait_until(max(now, transfer.due))
        if transfer.error is not None:
            raise LinkError(f"transfer of expert {transfer.key} failed: {transfer.error}") from transfer.error
        return waited

    def close(self) -> None:
        self._closed = True

    def _play(self, until: float) -> float:
        """Start and land every transfer the link would have by ``until``; returns ``until``."""
        while self._step(until):
            pass
        return until

    def _step(self, until: float) -> bool:
        """Land the moving transfer or start the next one, if that happens by ``until``."""
        current = self._current
        if current is not None and not current.done.is_set():
            if current.due > until:
                return False
            with self.clock.excluded():  # the copy is the link's work, not the device's
                current.dst.copy_(current.src)
            self.busy_s += current.due - current.started_at
            self.bytes_moved += current.nbytes
            self.transfers += 1
            current.done.set()
            return True
        while self._heap and (self._heap[0][2].started or self._heap[0][2].cancelled):
            heapq.heappop(self._heap)
        if not self._heap:
            return False
        _, _, transfer = self._heap[0]
        start = max(self._free, min(t.submitted for _, _, t in self._heap))
        if start > until:
            return False
        heapq.heappop(self._heap)
        transfer.started, transfer.started_at = True, max(start, transfer.submitted)
        self._free = transfer.due = transfer.started_at + self.estimate_s(transfer.nbytes)
        self._current = transfer
        return True

    def describe(self) -> str:
        return f"virtual:{self.bandwidth / 1e9:g}GB/s,{self.latency * 1e6:g}us"
