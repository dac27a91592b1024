"""The policy interface: who decides what moves when, over one slot pool and one link."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specter.experts.slots import Key

if TYPE_CHECKING:
    from specter.experts.executor import OffloadedExperts


class Policy:
    """Base policy: no prediction, least-recently-used eviction.

    Subclasses override the hooks they need; every hook runs on the compute thread.
    """

    name = "base"

    def __init__(self) -> None:
        self.offload: OffloadedExperts | None = None

    def bind(self, offload: OffloadedExperts) -> None:
        """Called once when the policy is attached to a target's experts."""
        self.offload = offload

    def before_layer(self, layer: int, hidden: torch.Tensor, needed: list[int]) -> None:
        """Called at each MoE layer once its true routing is known, before any expert runs."""

    def choose_victim(self, candidates: list[Key]) -> Key:
        """Which of ``candidates`` (evictable experts) gives up its slot."""
        assert self.offload is not None
        return self.offload.pool.lru(candidates)
