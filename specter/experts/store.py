"""Host memory for routed experts: one contiguous blob per (layer, expert), pinned on CUDA (in
chunks of at most 1 GiB, whole blobs each).

A blob holds ``[gate (I×H) | up (I×H) | down (H×I)]`` in the model's dtype, so one copy moves an
expert and the fused ``gate_up`` view of the blob is exactly transformers' ``gate_up_proj[e]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specter.models.checkpoint import Checkpoint, CheckpointError, TensorEntry, read_into
from specter.models.families import Family

log = logging.getLogger(__name__)

PINNED_CHUNK_BYTES = 1 << 30  # one pinned allocation: a power of two, so the allocator rounds nothing up


@dataclass(frozen=True)
class ExpertShape:
    """Shape of one routed expert: hidden size H, intermediate size I, dtype."""

    hidden: int
    intermediate: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def split(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(gate_up (2I, H), down (H, I))`` of a blob or a slot; no copy."""
        cut = 2 * self.intermediate * self.hidden
        gate_up = blob[:cut].view(2 * self.intermediate, self.hidden)
        return gate_up, blob[cut:].view(self.hidden, self.intermediate)

    def split_rows(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(gate_up (S, 2I, H), down (S, H, I))`` of ``(S, numel)`` stacked blobs (a slot pool); no copy."""
        cut = 2 * self.intermediate * self.hidden
        gate_up = storage[:, :cut].view(-1, 2 * self.intermediate, self.hidden)
        return gate_up, storage[:, cut:].view(-1, self.hidden, self.intermediate)


class ExpertStore:
    """Every routed expert of the target, in host memory, one blob each.

    Args:
        layers: the MoE layer indices (dense layers hold no routed experts).
        num_experts: routed experts per MoE layer.
        shape: the shape every expert shares.
        pin: page-lock the host memory (CUDA only; makes copies asynchronous and faster).
        arena: memory to hold the blobs instead of a new allocation (e.g. shared memory,
            ``specter/remote/shared_store.py``): a flat tensor of ``arena_numel`` elements.
        chunk_bytes: the most one allocation holds (whole blobs); default ``PINNED_CHUNK_BYTES``
            when pinned, else one allocation for everything.
    """

    def __init__(self, layers: list[int], num_experts: int, shape: ExpertShape, pin: bool = False,
                 arena: torch.Tensor | None = None, chunk_bytes: int | None = None):
        self.layers = list(layers)
        self.num_experts = num_experts
        self.shape = shape
        numel = self.arena_numel(self.layers, num_experts, shape)
        count = len(self.layers) * num_experts
        if arena is None:  # each blob a contiguous slice of a chunk; a blob never spans two
            if chunk_bytes is None:
                chunk_bytes = PINNED_CHUNK_BYTES if pin else None
            self.per_chunk = self.blobs_per_chunk(shape, count, chunk_bytes)
            self._chunks = [
                torch.empty(min(self.per_chunk, count - start) * shape.numel, dtype=shape.dtype, pin_memory=pin)
                for start in range(0, count, self.per_chunk)
            ]
        elif arena.dim() != 1 or arena.numel() != numel or arena.dtype != shape.dtype:
            raise ValueError(f"arena: expected a flat {shape.dtype} tensor of {numel} elements, got "
                             f"{arena.dtype} of shape {tuple(arena.shape)}")
        else:
            self.per_chunk, self._chunks = max(1, count), [arena]
        self._row = {layer: i for i, layer in enumerate(self.layers)}

    @staticmethod
    def blobs_per_chunk(shape: ExpertShape, count: int, chunk_bytes: int | None) -> int:
        """How many blobs one allocation of at most ``chunk_bytes`` holds (at least one; None: all).

        Pinned stores use ``PINNED_CHUNK_BYTES``: torch's pinned allocator rounds every allocation
        up to a power of two — one arena for ~90 GB of Mixtral experts would ask for 128 GB — and a
        chunk of exactly that size wastes less than one blob."""
        if chunk_bytes is None:
            return max(1, count)
        return max(1, min(count, chunk_bytes // shape.nbytes))

    @staticmethod
    def arena_numel(layers: list[int], num_experts: int, shape: ExpertShape) -> int:
        """Elements of the arena that holds every blob."""
        return len(layers) * num_experts * shape.numel

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in self._chunks)

    @property
    def chunks(self) -> int:
        """Host allocations holding the blobs (1 unless pinned and larger than one chunk)."""
        return len(self._chunks)

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """The 1-D host blob of one expert."""
        chunk, index = divmod(self._row[layer] * self.num_experts + expert, self.per_chunk)
        return self._chunks[chunk][index * self.shape.numel : (index + 1) * self.shape.numel]

    def load(self, checkpoint: Checkpoint, family: Family, progress: bool = False) -> None:
        """Stream every expert from disk into its blob, one expert (three tensors) at a time."""
        total = len(self.layers) * self.num_experts
        for n, (layer, expert) in enumerate((lay, e) for lay in self.layers for e in range(self.num_experts)):
            self._load_one(checkpoint, family, layer, expert)
            if progress and (n + 1) % max(1, total // 10) == 0:
                log.info("loaded %d/%d experts", n + 1, total)

    def _load_one(self, checkpoint: Checkpoint, family: Family, layer: int, expert: int) -> None:
        blob = self.blob(layer, expert)
        per_proj = self.shape.hidden * self.shape.intermediate
        for part, (entry, start) in enumerate(self._sources(checkpoint, family, layer, expert)):
            target = blob[part * per_proj : (part + 1) * per_proj]
            _read_part(entry, start, target)

    def _sources(
        self, checkpoint: Checkpoint, family: Family, layer: int, expert: int
    ) -> list[tuple[TensorEntry, int]]:
        """(entry, absolute start byte) of the gate, up and down parts of one expert."""
        h, i = self.shape.hidden, self.shape.intermediate
        keys = family.expert_keys(layer, expert)
        if all(k in checkpoint.entries for k in keys):
            for key, want in zip(keys, [(i, h), (i, h), (h, i)], strict=True):
                _check_shape(checkpoint.entry(key), key, want)
            return [(checkpoint.entry(k), checkpoint.entry(k).start) for k in keys]
        gate_up_key, down_key = family.fused_keys(layer)
        if gate_up_key in checkpoint.entries and down_key in checkpoint.entries:
            _check_shape(checkpoint.entry(gate_up_key), gate_up_key, (self.num_experts, 2 * i, h))
            _check_shape(checkpoint.entry(down_key), down_key, (self.num_experts, h, i))
            entry, start, row = checkpoint.read_slice(gate_up_key, expert)
            down, down_start, _ = checkpoint.read_slice(down_key, expert)
            return [(entry, start), (entry, start + row // 2), (down, down_start)]
        missing = next(k for k in keys if k not in checkpoint.entries)
        raise CheckpointError(f"expert ({layer}, {expert}): tensor {missing!r} is missing from {checkpoint.dir}")


def _check_shape(entry: TensorEntry, key: str, want: tuple[int, ...]) -> None:
    if entry.shape != want:
        raise CheckpointError(f"tensor {key!r} in {entry.path} has shape {entry.shape}, expected {want}")


def _read_part(entry: TensorEntry, start: int, target: torch.Tensor) -> None:
    """Read one projection (I×H elements) into ``target``, converting dtype only when they differ."""
    count = target.numel()
    if entry.dtype == target.dtype:
        read_into(entry, target.view(torch.uint8), start, count * target.element_size())
        return
    scratch = torch.empty(count, dtype=entry.dtype)
    read_into(entry, scratch.view(torch.uint8), start, count * entry.dtype.itemsize)
    target.copy_(scratch)
