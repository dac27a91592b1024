"""The transfer side's link counters, mirrored into a small shared-memory segment.

Six float64 words at ``/dev/shm/<prefix>-counters``: bytes moved, seconds the link was busy,
transfers done, when the transfer moving now is due to land (``time.perf_counter`` seconds:
``CLOCK_MONOTONIC``, one clock for every process of the machine), a sequence number and the writing
process's pid (a reader's waits end when that process is gone: ``specter/remote/peers.py``). One writing
process (the transfer actor's link threads: the due time when a copy starts, the rest before it
publishes a slot; on a CUDA link also the copy engine's seconds once a copy is done) and any number of
readers (the verifier's ``RemoteLink``), so a reader that has seen an expert land also sees the
counters that include it, and can tell, as in process, when the link is free again. The first three
change together: a writer takes a lock and makes the sequence number odd while it adds, and ``read``
retries until it copied them between two equal even sequence numbers (a seqlock), so no reader sees a
transfer's bytes without its count. Named under the slots' prefix so ``unlink_prefix`` removes it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from specter.remote.peers import Peer
from specter.remote.segments import attach_shared, fence, open_shared, shm_unlink

WORDS = 6  # bytes moved, busy seconds, transfers, due time of the transfer moving now, sequence number, pid
SEQ = 4
PID = 5
TORN_WAIT_S = 0.05  # how long ``read`` retries while a writer is adding


class SharedCounters:
    """``(bytes_moved, busy_s, transfers)`` in shared memory.

    Args:
        prefix: the shared slots' name prefix; the segment is ``<prefix>-counters``.
        create: make the segment (the transfer side) or attach to it (the verifier).
    """

    def __init__(self, prefix: str, create: bool):
        self.name = f"{prefix}-counters"
        self.owner = create
        self._shm = open_shared(self.name, 8 * WORDS) if create else attach_shared(self.name)
        self._words = np.ndarray((WORDS,), dtype="<f8", buffer=self._shm.buf)
        self._write = threading.Lock()  # the writing process's threads add one at a time
        if create:
            self._words[:] = 0.0
            self._words[PID] = os.getpid()
            fence()
        # the process that writes them (the transfer side's): a reader's waits look at it (``link.nap``)
        self.writer = Peer("transfer", int(self._words[PID]))

    def add(self, nbytes: int, busy_s: float, transfers: int = 1) -> None:
        """Count one finished transfer (writer side only)."""
        with self._write:
            seq = self._words[SEQ]
            self._words[SEQ] = seq + 1  # odd: the counters are changing
            fence()
            self._words[0] += nbytes
            self._words[1] += busy_s
            self._words[2] += transfers
            fence()
            self._words[SEQ] = seq + 2
            fence()

    def moving(self, due: float) -> None:
        """The transfer that starts now is due to land at ``due`` (writer side only)."""
        self._words[3] = due
        fence()

    def due(self) -> float:
        """When the transfer moving now (or the last one) is due to land."""
        fence()
        return float(self._words[3])

    def read(self) -> tuple[int, float, int]:
        """``(bytes_moved, busy_s, transfers)`` now, all three from the same moment (a writer killed between
        its two sequence numbers would leave them odd for good: after ``TORN_WAIT_S`` the copy is taken as is)."""
        end = time.perf_counter() + TORN_WAIT_S
        while True:
            fence()
            seq = self._words[SEQ]
            words = self._words[:3].copy()
            fence()
            if (seq % 2 == 0 and self._words[SEQ] == seq) or time.perf_counter() > end:
                return int(words[0]), float(words[1]), int(words[2])
            time.sleep(0)  # a writer is between its two sequence numbers: a few µs

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid); idempotent."""
        shm_unlink(self.name)

    def close(self) -> None:
        """Unmap; the creator also removes the name."""
        self._words = np.zeros(WORDS, dtype="<f8")
        self._shm.close()
        if self.owner:
            self.unlink()
