"""The slot pool's storage, shared by two processes without copies, and its readiness table.

``SharedSlots.create`` (transfer side) makes the storage, a ``(num_slots, numel)`` tensor, and a
readiness table; ``SharedSlots.attach(handle)`` (verifier side) maps the same memory. On a CPU
both live in POSIX shared memory (``/dev/shm/<prefix>-data``, ``/dev/shm/<prefix>-table``). On
CUDA the storage is a device tensor shared through torch's CUDA IPC, with two interprocess events
per slot (``specter/remote/cuda_slots.py``); the table stays in host shared memory.

Readiness is a seqlock per slot (docs/wire.md): the writer makes the slot's sequence number odd,
writes the blob, the owner key and when the blob counts as landed (its *due* time: a simulated
link's landing, ``time.perf_counter`` seconds), then makes it even; a reader reads the number, the
key, and the number again, and trusts the key only if both reads agree and are even, and the blob
only from its due time on. A reader *pins* a slot while it computes with it; the writer does not
start writing a pinned slot (Dekker-style: each side stores, fences, then loads the other side's word).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import numpy as np
import torch

from specter.experts.slots import Key
from specter.remote.segments import (
    SharedSlotsError,
    attach_shared,
    check_prefix,
    close_shared,
    fence,
    open_shared,
    segment_name,
    shm_unlink,
    unlink_all,
)

log = logging.getLogger(__name__)

MAGIC = 0x544F4C5352545053  # b"SPTRSLOT" read as a little-endian int64
LAYOUT_VERSION = 2  # 2: a fifth word per row, the blob's due time
HEADER_WORDS = 8  # magic, layout version, num_slots, numel, itemsize, 3 reserved
SEQ, LAYER, EXPERT, PINS, DUE = range(5)  # the words of one table row (DUE a float64, the rest int64)
ROW_WORDS = 5
EMPTY = -1  # LAYER/EXPERT of a slot that holds nothing
SPIN_S = 50e-6  # wait_ready spins this long before it starts to sleep
MAX_SLEEP_S = 1e-3
PINNED_RETRY_S = 1e-4  # a writer waiting for a reader to unpin a slot looks again this soon


class SlotTimeout(SharedSlotsError, TimeoutError):
    """An expert did not become ready in its slot in time."""


class CudaShare(msgspec.Struct, frozen=True):
    """What another process needs to map a CUDA storage and its per-slot events.

    Attributes:
        ipc_args: ``rebuild_cuda_tensor``'s arguments after ``dtype``, as ``reduce_tensor`` made
            them: device, handle, storage size and offset in bytes, requires_grad, ref-counter
            handle and offset, event handle, event_sync_required (bytes, ints, bools, None).
        slot_events: ``ipc_handle()`` of each slot's copy event (writer → reader).
        reader_events: ``ipc_handle()`` of each slot's reader event (reader → writer).
    """

    ipc_args: tuple[int, bytes, int, int, bool, bytes, int, bytes | None, bool]
    slot_events: list[bytes]
    reader_events: list[bytes]


class SlotsHandle(msgspec.Struct, frozen=True):
    """A small description of shared slots, to send to the process that attaches them.

    Encode with ``msgspec.json`` or ``msgspec.msgpack``; names are POSIX shm names (no slash).
    """

    prefix: str
    num_slots: int
    numel: int
    dtype: str
    table_name: str
    data_name: str = ""  # empty when the storage is a CUDA tensor
    cuda: CudaShare | None = None


class SharedSlots:
    """``storage`` (num_slots, numel) plus the readiness table, shared between processes.

    Build with :meth:`create` (owner) or :meth:`attach`; see the module docstring for the rules.
    The writer side calls :meth:`begin_write` / :meth:`publish` (or :meth:`write`); the reader
    side calls :meth:`wait_ready`, or :meth:`acquire` / :meth:`release` around a use.
    Only one process writes slots and only one pins them.
    """

    def __init__(
        self,
        handle: SlotsHandle,
        table: SharedMemory,
        data: SharedMemory | None,
        owner: bool,
        storage: torch.Tensor | None = None,
    ):
        self.handle, self.owner = handle, owner
        self.num_slots, self.numel = handle.num_slots, handle.numel
        self.dtype = dtype_named(handle.dtype)
        self._table_shm, self._data_shm = table, data
        self.table = np.ndarray(
            (handle.num_slots, ROW_WORDS), dtype="<i8", buffer=table.buf, offset=8 * HEADER_WORDS
        )
        self._due = self.table.view("<f8")[:, DUE]  # the same words, read as seconds
        self._events: list[Any] = []  # CUDA: per slot, the copy event (writer → reader)
        self._reader_events: list[Any] = []  # CUDA: per slot, the reader event (reader → writer)
        self.storage = self._map_storage() if storage is None else storage
        names = [handle.table_name, handle.data_name]
        self._unlinker = weakref.finalize(self, unlink_all, names) if owner else None

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name_prefix: str,
        num_slots: int,
        numel: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> SharedSlots:
        """Make new shared slots (all empty); the caller owns them and unlinks them at the end.

        Raises:
            ValueError: bad sizes or prefix.
            SharedSlotsError: a segment of that name exists already.
        """
        check_prefix(name_prefix)
        if num_slots < 1 or numel < 1:
            raise ValueError(f"num_slots and numel must be >= 1, got {num_slots} and {numel}")
        on_cuda = torch.device(device).type == "cuda"
        table, data = open_shared(f"{name_prefix}-table", 8 * (HEADER_WORDS + ROW_WORDS * num_slots)), None
        try:
            data = None if on_cuda else open_shared(f"{name_prefix}-data", num_slots * numel * dtype.itemsize)
            dtype_name = str(dtype).removeprefix("torch.")
            handle = SlotsHandle(
                name_prefix, num_slots, numel, dtype_name, segment_name(table), segment_name(data) if data else ""
            )
            _write_header(table, num_slots, numel, dtype.itemsize)
            if on_cuda:
                from specter.remote.cuda_slots import CudaSlots

                return CudaSlots.create_cuda(handle, table, torch.device(device))
            return cls(handle, table, data, owner=True)
        except BaseException:
            for shm in (data, table):
                close_shared(shm)
                shm_unlink(segment_name(shm) if shm else "")
            raise

    @classmethod
    def attach(cls, handle: SlotsHandle) -> SharedSlots:
        """Map slots that another process created.

        Raises:
            SharedSlotsError: a segment is missing or does not match the handle.
        """
        table = attach_shared(handle.table_name)
        _check_header(table, handle)
        if handle.cuda is not None:
            from specter.remote.cuda_slots import CudaSlots

            return CudaSlots(handle, table, None, owner=False)
        return cls(handle, table, attach_shared(handle.data_name), owner=False)

    def _map_storage(self) -> torch.Tensor:
        assert self._data_shm is not None
        nbytes = self.num_slots * self.numel * self.dtype.itemsize
        # Through uint8: torch.frombuffer reads any dtype, but a byte view also covers bf16 cleanly.
        flat = torch.frombuffer(self._data_shm.buf, dtype=torch.uint8, count=nbytes)
        return flat.view(self.dtype).view(self.num_slots, self.numel)

    # --- writer side (transfer) ------------------------------------------------------------

    def begin_write(self, slot: int) -> bool:
        """Claim ``slot`` for writing (its sequence number turns odd); False if a reader pins it."""
        seq = int(self.table[slot, SEQ])
        self.table[slot, SEQ] = seq + 1
        fence()  # the odd number is visible before we look at the pins (Dekker with acquire())
        if self.table[slot, PINS] > 0:
            self.table[slot, SEQ] = seq
            return False
        return True

    def claim(self, slot: int, key: Key, closing: Callable[[], bool]) -> None:
        """:meth:`begin_write`, waiting while a reader pins ``slot`` (looking again every
        ``PINNED_RETRY_S``) until the writer is ``closing()``.

        Raises:
            SharedSlotsError: the writer closes while a reader still pins the slot (a reader that
                died pinning it would otherwise hold the copy, and the writer's shutdown, for good).
        """
        while not self.begin_write(slot):
            if closing():
                raise SharedSlotsError(
                    f"slot {slot} of {self.handle.prefix} is still pinned by a reader as its writer closes; "
                    f"the copy of expert {tuple(key)} into it is given up"
                )
            time.sleep(PINNED_RETRY_S)

    def publish(self, slot: int, key: Key | None, stream: Any = None, due: float = 0.0) -> int:
        """Finish a write begun by :meth:`begin_write`: ``key`` now sits in ``slot``, to be read from
        ``due`` on (``time.perf_counter`` seconds; 0: at once).

        Returns the slot's new (even) sequence number.
        """
        layer, expert = key if key is not None else (EMPTY, EMPTY)
        self.table[slot, LAYER], self.table[slot, EXPERT] = layer, expert
        self._due[slot] = due
        self._record(slot, stream)
        fence()  # release: blob and key are visible before the even number
        seq = int(self.table[slot, SEQ]) + 1
        self.table[slot, SEQ] = seq
        return seq

    def write(self, slot: int, key: Key, blob: torch.Tensor) -> int:
        """Copy ``blob`` into ``slot`` and publish it; returns the new sequence number.

        Raises:
            SharedSlotsError: a reader has the slot pinned.
        """
        if not self.begin_write(slot):
            raise SharedSlotsError(f"slot {slot} is pinned by a reader; cannot write expert {key} into it")
        self.storage[slot].copy_(blob.reshape(-1), non_blocking=self.storage.is_cuda)
        return self.publish(slot, key)

    def _record(self, slot: int, stream: Any) -> None:
        """CPU: nothing (the copy is done). CUDA: see ``CudaSlots`` (``specter/remote/cuda_slots.py``)."""

    def wait_reader(self, slot: int, stream: Any) -> None:
        """Order a copy into ``slot`` on ``stream`` after the kernels of the slot's last reader (call
        after :meth:`begin_write` succeeded, before the copy). CPU: nothing, the reader computed
        before it unpinned. CUDA: ``stream`` waits on the slot's reader event: no host sync."""

    # --- reader side (verifier) ------------------------------------------------------------

    def read(self, slot: int) -> tuple[Key | None, int]:
        """``(key, seq)`` of a stable state of ``slot``; key None while empty or being written."""
        while True:
            seq = int(self.table[slot, SEQ])
            fence()  # acquire: the key is read after the number
            layer, expert = int(self.table[slot, LAYER]), int(self.table[slot, EXPERT])
            fence()
            if int(self.table[slot, SEQ]) == seq:
                break
        if seq % 2 or layer == EMPTY:
            return None, seq
        return (layer, expert), seq

    def due(self, slot: int) -> float:
        """When the blob published in ``slot`` counts as landed (read it after :meth:`read` saw the
        key, and trust it while :meth:`is_current` says the slot has not been claimed since)."""
        fence()
        return float(self._due[slot])

    def is_current(self, slot: int, seq: int) -> bool:
        """True while ``slot`` has not been claimed for a write since ``seq`` was read."""
        fence()
        return int(self.table[slot, SEQ]) == seq

    def wait_ready(self, slot: int, key: Key, seq: int = 0, timeout_s: float = 5.0) -> int:
        """Wait until ``slot`` holds ``key`` at a sequence number >= ``seq``, landed (its due time
        passed); returns that number.

        Spins for ``SPIN_S``, then sleeps with a backoff doubling up to ``MAX_SLEEP_S``.

        Raises:
            SlotTimeout: not ready within ``timeout_s`` (says what the slot holds instead).
        """
        start = time.monotonic()
        sleep = SPIN_S / 2
        while True:
            got, now_seq = self.read(slot)
            if got == tuple(key) and now_seq >= seq:
                ahead = self.due(slot) - time.perf_counter()
                if ahead > 0:  # published, not landed yet
                    time.sleep(ahead)
                return now_seq
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise SlotTimeout(self._not_ready(slot, key, seq, got, now_seq, timeout_s))
            if waited > SPIN_S:
                time.sleep(sleep)
                sleep = min(sleep * 2, MAX_SLEEP_S)

    def acquire(self, slot: int, key: Key, seq: int = 0, timeout_s: float = 5.0) -> int:
        """Wait for ``key`` in ``slot`` and pin it so the writer leaves it alone until :meth:`release`."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.wait_ready(slot, key, seq, max(deadline - time.monotonic(), 0.0))
            self.table[slot, PINS] += 1
            fence()  # the pin is visible before we re-read the number (Dekker with begin_write())
            if self.is_current(slot, ready):
                self.wait_copy(slot)
                return ready
            self.table[slot, PINS] -= 1

    def try_pin(self, slot: int, seq: int) -> bool:
        """Pin ``slot`` if it has not been claimed for a write since ``seq`` was read (then the
        writer leaves it alone until :meth:`release`); False, and nothing pinned, otherwise."""
        self.table[slot, PINS] += 1
        fence()  # the pin is visible before we re-read the number (Dekker with begin_write())
        if self.is_current(slot, seq):
            return True
        self.table[slot, PINS] -= 1
        return False

    def pinned(self, slot: int) -> bool:
        """Whether a reader pins ``slot`` now (the writer's schedule leaves its expert alone)."""
        return int(self.table[slot, PINS]) > 0

    def release(self, slot: int) -> None:
        """Unpin a slot pinned by :meth:`acquire` or :meth:`try_pin` (CUDA: after recording the slot's
        reader event on the current stream, so that the writer's next copy into it waits for the
        kernels that read it)."""
        self.mark_read(slot)
        fence()  # the reader event is recorded before the writer can see the slot unpinned
        self.table[slot, PINS] -= 1

    def mark_read(self, slot: int, after: Any = None) -> None:
        """Record that the reader's kernels enqueued so far (and, if given, those before the local
        event ``after``) read ``slot``: the writer's next copy into it waits for them. CPU: nothing.
        A reader that does not pin slots in the table (the verifier's own schedule, whose copy
        commands name the slot) calls it before it sends the copy command."""

    def wait_copy(self, slot: int) -> None:
        """Order the reader's next kernels after the copy into ``slot`` (call once the slot shows the
        key). CPU: nothing, the bytes are there. CUDA: the current stream waits on the slot's
        interprocess event, recorded on the copy stream before the publish: no host sync."""

    def _not_ready(self, slot: int, key: Key, seq: int, got: Key | None, now: int, timeout_s: float) -> str:
        state = "being written" if now % 2 else f"holding {got}" if got else "empty"
        return (
            f"expert {tuple(key)} (seq >= {seq}) not ready in slot {slot} of {self.handle.prefix} "
            f"within {timeout_s:.3f}s; the slot is {state} at seq {now}"
        )

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap this process's view (the segments stay until :meth:`unlink`)."""
        self.storage = torch.empty(0, self.numel, dtype=self.dtype)
        self.table = np.empty((0, ROW_WORDS), dtype="<i8")
        self._due = self.table.view("<f8")[:, DUE]
        self._events, self._reader_events = [], []
        for shm in (self._data_shm, self._table_shm):
            close_shared(shm)

    def unlink(self) -> None:
        """Remove the segments' names (either side may; mappings stay valid until closed)."""
        unlink_all([self.handle.table_name, self.handle.data_name])
        if self._unlinker is not None:
            self._unlinker.detach()

    def __enter__(self) -> SharedSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()


# --- helpers ---------------------------------------------------------------------------------


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype a handle names (``bfloat16``, ``float32``, …)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SharedSlotsError(f"unknown dtype {name!r} in a slots handle")
    return dtype


def _write_header(table: SharedMemory, num_slots: int, numel: int, itemsize: int) -> None:
    header = np.ndarray((HEADER_WORDS,), dtype="<i8", buffer=table.buf)
    header[:5] = (MAGIC, LAYOUT_VERSION, num_slots, numel, itemsize)
    rows = np.ndarray((num_slots, ROW_WORDS), dtype="<i8", buffer=table.buf, offset=8 * HEADER_WORDS)
    rows[:] = (0, EMPTY, EMPTY, 0, 0)  # due 0.0: the bits of a float64 zero
    del header, rows  # release the buffer exports so that close() can unmap


def _check_header(table: SharedMemory, handle: SlotsHandle) -> None:
    header = np.ndarray((HEADER_WORDS,), dtype="<i8", buffer=table.buf)
    found = tuple(int(x) for x in header[:5])
    del header
    want = (MAGIC, LAYOUT_VERSION, handle.num_slots, handle.numel, dtype_named(handle.dtype).itemsize)
    if found != want:
        close_shared(table)
        raise SharedSlotsError(
            f"shared memory {handle.table_name!r} does not match its handle: {found} != {want}"
        )
