"""The verifier's side of offloaded experts when the host blobs live in the transfer actor.

``ShapeStore`` stands in for the ``ExpertStore`` (layers, expert count and shape, no blobs);
``RemoteExperts`` is ``OffloadedExperts`` whose initial residency is filled by the transfer actor
(untimed copies through the ``RemoteLink``) instead of local copies. Everything else (policies,
residency map, the MoE forward) is the in-process code, unchanged.
"""

from __future__ import annotations

import torch

from specter.experts.executor import OffloadedExperts
from specter.experts.remote_link import RemoteLink
from specter.experts.store import ExpertShape, ExpertStore


class ShapeStore(ExpertStore):
    """An ``ExpertStore`` without blobs: what the policies and the executor read of it."""

    def __init__(self, layers: list[int], num_experts: int, shape: ExpertShape):  # no super(): no arena
        self.layers = list(layers)
        self.num_experts = num_experts
        self.shape = shape
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._empty = torch.empty(0, dtype=shape.dtype)

    @property
    def nbytes(self) -> int:
        return 0

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """An empty tensor: the blob is copied on the transfer side."""
        return self._empty


class RemoteExperts(OffloadedExperts):
    """``OffloadedExperts`` over a ``RemoteLink``."""

    def prefill_slots(self) -> None:
        """Same order as the in-process fill (expert 0 of every layer, then 1, …), done remotely."""
        link = self.link
        assert isinstance(link, RemoteLink)
        placements = self.claim_initial_slots()
        link.place(placements, self.timeout)
