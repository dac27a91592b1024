"""Shared slots on a CUDA device: the storage shared by CUDA IPC, two interprocess events per slot.

``SharedSlots.create(..., device="cuda")`` makes a ``CudaSlots`` and ``SharedSlots.attach`` maps one
when the handle carries a ``CudaShare`` (``specter/remote/shm.py``: the readiness table, which stays
in host shared memory, and the seqlock rules). Each slot has two interprocess events: the *copy*
event (recorded by the writer on its copy stream after a copy into the slot, waited on by the
reader's compute stream before it reads the slot) and the *reader* event (recorded by the reader on
its compute stream as it unpins the slot, waited on by the writer's copy stream before it
overwrites the slot). Neither side syncs the host for the other. **Not run on the CPU machines this
was written on** (its calls' order is tested there with stand-ins,
``tests/actors/test_remote_link.py``); it runs on a lent GPU (``tests/gpu/test_gpu_processes.py``).
"""

from __future__ import annotations

from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import torch

from specter.remote.shm import CudaShare, SharedSlots, SlotsHandle, dtype_named


class CudaSlots(SharedSlots):
    """Storage on a CUDA device, shared by CUDA IPC; two interprocess events per slot.

    Written against torch's ``reduce_tensor`` / ``rebuild_cuda_tensor`` and
    ``torch.cuda.Event(interprocess=True)``; run on a lent GPU only. The writer makes its copy stream
    wait on a slot's reader event before the copy, and records the slot's copy event on it after the
    copy, before it publishes the sequence number; the reader's stream waits on the copy event once it
    has seen the key (``wait_copy``), and records the reader event as it unpins (``release``).
    """

    @classmethod
    def create_cuda(cls, handle: SlotsHandle, table: SharedMemory, device: torch.device) -> CudaSlots:
        from torch.multiprocessing.reductions import reduce_tensor

        dtype = dtype_named(handle.dtype)
        storage = torch.zeros(handle.num_slots, handle.numel, dtype=dtype, device=device)
        events, readers = _interprocess_events(handle.num_slots, device), _interprocess_events(handle.num_slots, device)
        _, args = reduce_tensor(storage)
        share = CudaShare(tuple(args[6:15]), [bytes(e.ipc_handle()) for e in events],
                          [bytes(e.ipc_handle()) for e in readers])
        slots = cls(msgspec.structs.replace(handle, cuda=share), table, None, owner=True, storage=storage)
        slots._events, slots._reader_events = events, readers
        return slots

    def _map_storage(self) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        share = self.handle.cuda
        assert share is not None
        size, stride = torch.Size((self.num_slots, self.numel)), (self.numel, 1)
        tensor = rebuild_cuda_tensor(
            torch.Tensor, size, stride, 0, torch.storage.TypedStorage, self.dtype, *share.ipc_args
        )
        device = torch.device("cuda", share.ipc_args[0])
        self._events = [torch.cuda.Event.from_ipc_handle(device, h) for h in share.slot_events]
        self._reader_events = [torch.cuda.Event.from_ipc_handle(device, h) for h in share.reader_events]
        return tensor

    def _record(self, slot: int, stream: Any) -> None:
        self._events[slot].record(
            stream if stream is not None else torch.cuda.current_stream(self.storage.device)
        )

    def wait_copy(self, slot: int) -> None:
        self._events[slot].wait(torch.cuda.current_stream(self.storage.device))

    def wait_reader(self, slot: int, stream: Any) -> None:
        self._reader_events[slot].wait(stream)

    def mark_read(self, slot: int, after: Any = None) -> None:
        stream = torch.cuda.current_stream(self.storage.device)
        if after is not None:
            stream.wait_event(after)
        self._reader_events[slot].record(stream)


def _interprocess_events(count: int, device: torch.device) -> list[Any]:
    """``count`` interprocess CUDA events on ``device``, each recorded once (``ipc_handle`` needs it)."""
    events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(count)]
    for event in events:
        event.record(torch.cuda.current_stream(device))
    return events
