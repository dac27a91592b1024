"""Which slot each expert was given, published by the transfer actor for the verifier.

When the schedule runs in the transfer actor (``specter/remote/scheduler.py``) the residency map is
its own; the verifier learns where an expert is from this table: one int32 word per (layer, expert)
at ``/dev/shm/<prefix>-index``, the slot it was given (``-1``: none). The transfer side writes a
key's word when it reserves the slot (before the copy is queued) and clears it when the key is
evicted or its queued copy is dropped. The word is only a hint: whether the slot *holds* the blob
is the seq table's word (``SharedSlots.read``), which the verifier checks before it trusts a slot,
and a slot it computes with is pinned there first.

A second table, one int64 per (layer, expert), is the verifier's: after it computed an expert from a
slot it writes there the number of the layer visit (``LayerNeeds.visit``), so the transfer side
can tell, while a pass streams more experts through a slot group than it holds, which of the
layer's experts are done with their slots. Visit numbers never repeat on one index: a reader made
for a new policy counts on from the highest visit in the table (``last_visit``), or an expert done in
the old pass's visit would read as done in the new pass's, its slot free to be given up while the
verifier still waits for it. Named under the slots' prefix so ``unlink_prefix``
removes it.
"""

from __future__ import annotations

import numpy as np

from specter.experts.slots import Key
from specter.remote.segments import attach_shared, fence, open_shared, shm_unlink

NONE = -1


class SharedIndex:
    """``slot_of[(layer, expert)]`` in shared memory.

    Args:
        prefix: the shared slots' name prefix; the segment is ``<prefix>-index``.
        layers: one more than the highest MoE layer index.
        num_experts: routed experts per layer.
        create: make the segment (the transfer side) or attach to it (the verifier).
    """

    def __init__(self, prefix: str, layers: int, num_experts: int, create: bool):
        if layers < 1 or num_experts < 1:
            raise ValueError(f"index: expected at least one layer and one expert, got {layers} x {num_experts}")
        self.name = f"{prefix}-index"
        self.owner = create
        self.shape = (layers, num_experts)
        cells = layers * num_experts
        size = 12 * cells
        self._shm = open_shared(self.name, size) if create else attach_shared(self.name)
        if self._shm.size < size:
            raise ValueError(f"index {self.name}: {self._shm.size} bytes, expected {size} for {layers} x {num_experts}")
        self._done = np.ndarray(self.shape, dtype="<i8", buffer=self._shm.buf)
        self._words = np.ndarray(self.shape, dtype="<i4", buffer=self._shm.buf, offset=8 * cells)
        if create:
            self._words[:] = NONE
            self._done[:] = -1

    def set(self, key: Key, slot: int) -> None:
        """``key`` was given ``slot`` (writer side only)."""
        self._words[key[0], key[1]] = slot
        fence()

    def clear(self, key: Key) -> None:
        """``key`` has no slot any more (writer side only)."""
        self._words[key[0], key[1]] = NONE
        fence()

    def clear_all(self) -> None:
        """No expert has a slot (writer side only)."""
        self._words[:] = NONE
        fence()

    def slot(self, key: Key) -> int | None:
        """The slot ``key`` was given, None if none."""
        fence()
        slot = int(self._words[key[0], key[1]])
        return None if slot == NONE else slot

    def mark_done(self, key: Key, visit: int) -> None:
        """The verifier computed ``key`` in layer visit ``visit`` (reader side)."""
        fence()  # the compute's reads of the slot come before the mark
        self._done[key[0], key[1]] = visit

    def done(self, key: Key, visit: int) -> bool:
        """Whether the verifier computed ``key`` in layer visit ``visit``."""
        fence()
        return int(self._done[key[0], key[1]]) == visit

    def last_visit(self) -> int:
        """The highest layer visit any expert is marked done in (-1: none). A new reader numbers its
        visits past it: a number reused would mark the experts of an earlier pass done in the new one."""
        fence()
        return int(self._done.max())

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid); idempotent."""
        shm_unlink(self.name)

    def close(self) -> None:
        """Unmap; the creator also removes the name."""
        self._words = np.full(self.shape, NONE, dtype="<i4")
        self._done = np.full(self.shape, -1, dtype="<i8")
        self._shm.close()
        if self.owner:
            self.unlink()
