"""The host store's arena in POSIX shared memory: written by the transfer actor, read by the verifier.

The transfer actor holds the host copy of every routed expert, because it moves them into slots.
A late expert computed on the host (``specter/experts/host.py``) needs the same blob. Rather than
send the expert's activations to the transfer actor and its output back (a message each way per
host-computed expert, on the hot path of the layer), the verifier maps the store's arena **read
only** and computes the expert itself from the very bytes the transfer actor copies: one copy of
the experts in host memory, nothing per expert on the wire, and the verifier cannot change a blob
(its mapping is ``PROT_READ``; a write would fault).

``/dev/shm/<prefix>-store``: made (0600) and filled by the transfer actor, mapped by the verifier,
unlinked with the slots when the replica is sealed (``actors/transfer.py``). On a GPU the transfer
actor page-locks its mapping (``pin``: ``cudaHostRegister``), so that its copy stream's copies from it
run asynchronously at the link's full rate, as from memory torch pinned itself.
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from multiprocessing.shared_memory import SharedMemory

import torch

from specter.remote.segments import SHM_DIR, SharedSlotsError, open_shared, shm_unlink

log = logging.getLogger(__name__)


def store_name(prefix: str) -> str:
    """The segment name of a replica's host store."""
    return f"{prefix}-store"


class SharedArena:
    """A flat tensor over a shared-memory segment: ``create`` (read-write, owner) or ``map_readonly``.

    Args:
        name: the segment's name.
        tensor: the flat view of the mapping.
        owner: whether this side made the segment (and removes its name).
    """

    def __init__(self, name: str, tensor: torch.Tensor, owner: bool, keep: SharedMemory | mmap.mmap):
        self.name, self.tensor, self.owner = name, tensor, owner
        self._mapping = keep
        self._pinned = 0  # the registered address (``pin``), 0 when not pinned

    @classmethod
    def create(cls, name: str, numel: int, dtype: torch.dtype) -> SharedArena:
        """A new zero-filled segment of ``numel`` elements (mode 0600)."""
        shm = open_shared(name, numel * dtype.itemsize)  # the slots' own constructor: 0600, untracked
        return cls(name, torch.frombuffer(shm.buf, dtype=dtype, count=numel), True, shm)

    @classmethod
    def map_readonly(cls, name: str, numel: int, dtype: torch.dtype) -> SharedArena:
        """Map an existing segment read-only; its size must hold ``numel`` elements of ``dtype``."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SharedSlotsError(f"shared memory {name!r} does not exist (creator gone or sealed?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < numel * dtype.itemsize:
                raise SharedSlotsError(f"shared memory {name!r} holds {size} bytes, {numel * dtype.itemsize} expected")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(mapping, dtype=dtype, count=numel)
        return cls(name, tensor, False, mapping)

    def pin(self) -> None:
        """Page-lock the mapping for CUDA copies (``cudaHostRegister``, portable); undone by ``close``.

        Raises:
            RuntimeError: CUDA refused (its error code, the size asked for).
        """
        if self._pinned or self.tensor.numel() == 0:
            return
        ptr, nbytes = self.tensor.data_ptr(), self.tensor.numel() * self.tensor.element_size()
        code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of shared memory {self.name!r} ({nbytes} bytes) failed: "
                               f"CUDA error {code}")
        self._pinned = ptr

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until closed); idempotent."""
        shm_unlink(self.name)

    def close(self) -> None:
        """Drop this side's view and unmap (unpinned first); the owner also removes the name."""
        if self._pinned:
            code = int(torch.cuda.cudart().cudaHostUnregister(self._pinned))
            if code != 0:
                log.warning("cudaHostUnregister of shared memory %s failed: CUDA error %d", self.name, code)
            self._pinned = 0
        self.tensor = torch.empty(0, dtype=self.tensor.dtype)
        try:
            self._mapping.close()
        except BufferError:  # a blob view is still alive somewhere; unmapped when it dies
            log.warning("shared memory %s is still referenced; it stays mapped until those views die", self.name)
        if self.owner:
            self.unlink()
