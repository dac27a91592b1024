"""The device slot pool: room for a budget of expert blobs, and which expert sits where.

Slots are grouped: one group for the whole model (a global budget) or one per MoE layer (a
per-layer budget, as mixtral-offloading and Specter's released code do). An expert is *ready*
in a slot, *loading* into one, or absent. Slots used by the running pass are pinned and never
evicted; which unpinned expert to evict is the policy's choice, least recently used by default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from specter.experts.link import Transfer
from specter.experts.store import ExpertShape

Key = tuple[int, int]  # (layer, expert)
ChooseVictim = Callable[[list[Key]], Key]


class SlotPool:
    """Slots on ``device`` plus the residency map.

    Args:
        shape: every expert's shape (one slot holds one blob).
        groups: slots per group, e.g. ``{-1: 24}`` (global) or ``{layer: 6, ...}`` (per layer).
        device: where the slots live.
        storage: the slots' memory when it is not this pool's own (``(num_slots, numel)`` of the
            shape's dtype: the transfer actor's shared slots); default a fresh tensor on ``device``.
    """

    def __init__(
        self, shape: ExpertShape, groups: dict[int, int], device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
    ):
        self.shape = shape
        self.per_layer = -1 not in groups
        self.num_slots = sum(groups.values())
        if storage is None:
            storage = torch.empty(self.num_slots, shape.numel, dtype=shape.dtype, device=device)
        elif tuple(storage.shape) != (self.num_slots, shape.numel) or storage.dtype != shape.dtype:
            raise ValueError(
                f"storage: expected ({self.num_slots}, {shape.numel}) {shape.dtype} for these slots, "
                f"got {tuple(storage.shape)} {storage.dtype}"
            )
        self.storage = storage
        self.group_slots: dict[int, list[int]] = {}
        start = 0
        for group, count in groups.items():
            self.group_slots[group] = list(range(start, start + count))
            start += count
        self.owner: list[Key | None] = [None] * self.num_slots
        self.where: dict[Key, int] = {}
        self.loading: dict[Key, Transfer] = {}
        self.pins = [0] * self.num_slots
        self.last_use: list[Any] = [None] * self.num_slots  # CUDA event of the last compute that read it
        self.recency: OrderedDict[Key, None] = OrderedDict()
        self.version = 0  # grows whenever an expert enters, leaves or finishes loading into a slot

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def group_of(self, layer: int) -> int:
        return layer if self.per_layer else -1

    def capacity(self, layer: int) -> int:
        return len(self.group_slots[self.group_of(layer)])

    def is_ready(self, key: Key) -> bool:
        return key in self.where and key not in self.loading

    def is_loading(self, key: Key) -> bool:
        return key in self.loading

    def holds(self, key: Key) -> bool:
        """Whether ``key`` has a slot (ready or loading)."""
        return key in self.where

    def transfer_of(self, key: Key) -> Transfer | None:
        """The transfer moving ``key`` into its slot, None when it is not loading."""
        return self.loading.get(key)

    def is_pinned(self, key: Key) -> bool:
        """Whether a running layer reads ``key``'s slot (it must not move or be evicted)."""
        return key in self.where and self.pins[self.where[key]] > 0

    def empty_slot(self, layer: int) -> int | None:
        """A slot of ``layer``'s group that holds nothing, if any."""
        return next((s for s in self.group_slots[self.group_of(layer)] if self.owner[s] is None), None)

    def empty_count(self, layer: int) -> int:
        """How many slots of ``layer``'s group hold nothing."""
        return sum(self.owner[s] is None for s in self.group_slots[self.group_of(layer)])

    def unpinned_per_group(self) -> dict[int, int]:
        """Per slot group, the slots no running layer reads (room for what the policy keeps)."""
        return {g: sum(1 for s in slots if not self.pins[s]) for g, slots in self.group_slots.items()}

    def recency_rank(self) -> dict[Key, int]:
        """Every resident expert's rank by last use: 0 the least recently used."""
        return {k: i for i, k in enumerate(self.recency)}

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s memory (where a blob is copied to)."""
        return self.storage[slot]

    def last_reader(self, slot: int) -> Any:
        """The CUDA event of the last compute that read ``slot`` (None on a CPU)."""
        return self.last_use[slot]

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def resident(self, layer: int | None = None) -> list[Key]:
        """Experts ready or loading, optionally of one layer."""
        return [k for k in self.where if layer is None or k[0] == layer]

    def loading_keys(self, group: int | None = None) -> list[Key]:
        """Experts on their way into a slot (of ``group``), oldest transfer first."""
        return [k for k in self.loading if group is None or self.group_of(k[0]) == group]

    def layer_slots(self, layer: int, num_experts: int) -> list[int] | None:
        """The slot of each of ``layer``'s experts when all of them are ready in slots, else None."""
        slots = []
        for expert in range(num_experts):
            slot = self.where.get((layer, expert))
            if slot is None or (layer, expert) in self.loading:
                return None
            slots.append(slot)
        return slots

    def view(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) views of the slot holding ``key``."""
        return self.shape.split(self.storage[self.where[key]])

    def touch(self, key: Key) -> None:
        self.recency.pop(key, None)
        self.recency[key] = None

    def pin(self, key: Key) -> None:
        self.pins[self.where[key]] += 1

    def unpin(self, key: Key, event: Any = None) -> None:
        slot = self.where[key]
        self.pins[slot] -= 1
        if event is not None:
            self.last_use[slot] = event

    def mark_read(self, slots: Iterable[int], event: Any) -> None:
        """A compute that read ``slots`` without pinning them (a fully resident layer) ends at ``event``."""
        for slot in slots:
            self.last_use[slot] = event

    def evictable(self, layer: int, protect: Iterable[Key] = ()) -> list[Key]:
        """Experts of ``layer``'s group that may be evicted: ready, unpinned, not protected."""
        keep = set(protect)
        slots = self.group_slots[self.group_of(layer)]
        return [
            key
            for s in slots
            if (key := self.owner[s]) is not None
            and self.pins[s] == 0
            and key not in self.loading
            and key not in keep
        ]

    def lru(self, candidates: list[Key]) -> Key:
        """The least recently used of ``candidates``."""
        chosen = set(candidates)
        return next(k for k in self.recency if k in chosen)

    def reserve(self, key: Key, protect: Iterable[Key] = (), choose: ChooseVictim | None = None) -> int | None:
        """A slot for ``key`` in its group: an empty one, else one freed by evicting a victim.

        Returns None when every slot of the group is pinned, loading or protected.
        """
        empty = self.empty_slot(key[0])
        if empty is not None:
            return empty
        candidates = self.evictable(key[0], protect)
        if not candidates:
            return None
        victim = (choose or self.lru)(candidates)
        return self.evict(victim)

    def evict(self, key: Key) -> int:
        self.version += 1
        slot = self.where.pop(key)
        self.owner[slot] = None
        self.recency.pop(key, None)
        return slot

    def start_loading(self, key: Key, slot: int, transfer: Transfer) -> None:
        self.version += 1
        self.owner[slot] = key
        self.where[key] = slot
        self.loading[key] = transfer
        self.touch(key)

    def finish_loading(self, key: Key) -> None:
        self.version += 1
        self.loading.pop(key, None)

    def place(self, key: Key, slot: int, blob: torch.Tensor) -> None:
        """Put a blob into a slot synchronously (initial fill, outside any timed work)."""
        self.storage[slot].copy_(blob)
        self.claim(key, slot)

    def claim(self, key: Key, slot: int) -> None:
        """Record ``key`` as resident in ``slot`` (its bytes are put there by the caller)."""
        self.version += 1
        self.owner[slot] = key
        self.where[key] = slot
        self.touch(key)
