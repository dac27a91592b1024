"""``specter``: our policy. Plans stream per draft step; the link always works on the most urgent
missing expert; the slot given up is the one whose next predicted use is furthest away.

* Need order: the verify pass runs MoE layers in order, so a predicted expert of an earlier layer
  is needed sooner; within a layer, more draft votes (then a higher router weight) first.
* Eviction: an expert the round does not predict goes first (least recently used first), then
  one whose layer the running verify pass has already passed; a predicted expert is given up only
  for a more urgent one. Pinned experts (the running pass's) are never candidates.
* Demand misses go ahead of every prefetch (the link's priority queue). When a layer's true
  routing is known, queued prefetches for that layer's unneeded experts are cancelled, and the
  schedule is refilled so the link is never idle while a predicted expert is missing.
* Window: K is chosen per round from what the run measures (``specter/plan/window.py``), K = 0
  (a plain decode step with host compute) included; the engine's window is only its cap.
  ``specter+fixed`` drafts the full window every round.
* Host compute: an expert the link would bring later than the host could compute it is computed
  on the host (its queued prefetch cancelled), so the link spends itself on experts that arrive
  in time (``docs/benchmark.md`` measures fetching it for later as well: ``specter+fetch``).
"""

from __future__ import annotations

import torch

from specter.experts.slots import Key
from specter.plan.base import Policy
from specter.plan.draft_plans import RoundPlan
from specter.plan.schedule import cancel_queued, prefetch
from specter.protocol import PlanDelta

_PASSED = 1e6
_UNPREDICTED = 1e9


class Specter(Policy):
    """Need-ordered streaming prefetch with furthest-next-use eviction."""

    name = "specter"
    default_window = 16  # the cap of the adaptive K
    route_last_draft = True
    host_compute = True
    adaptive_window = True

    def __init__(self) -> None:
        super().__init__()
        self.plan = RoundPlan()
        self.current = -1  # the MoE layer the verify pass is at; -1 while drafting
        self.position: dict[int, int] = {}
        self._rank: dict[Key, int] = {}
        self._issued: set[Key] = set()

    def bind(self, offload) -> None:  # type: ignore[no-untyped-def]
        super().bind(offload)
        self.position = {layer: i for i, layer in enumerate(offload.store.layers)}

    def begin_round(self, round_id: int) -> None:
        assert self.offload is not None
        stale = [k for k in self._issued if self.offload.pool.is_loading(k)]
        cancel_queued(self.offload, stale)
        self._issued.clear()
        self.plan.reset(round_id)
        self.current = -1

    def on_plan(self, delta: PlanDelta) -> None:
        if self.plan.add(delta):
            self.schedule()

    def begin_verify(self, round_id: int, positions: int) -> None:
        self.current = -1

    def before_layer(self, layer: int, hidden: torch.Tensor, needed: list[int]) -> None:
        assert self.offload is not None
        self.current = self.position[layer]
        wanted = set(needed)
        wasted = [k for k in self._issued if k[0] == layer and k[1] not in wanted]
        cancel_queued(self.offload, wasted)
        self.schedule()

    def end_round(self, round_id: int, accepted: int, true_routing: dict[int, set[int]]) -> None:
        self.current = -1

    def schedule(self) -> None:
        """Issue prefetches for missing predicted experts, most urgent first."""
        assert self.offload is not None
        self._rank = {k: i for i, k in enumerate(self.offload.pool.recency)}
        ahead = [k for k in self.plan.counts if self.position[k[0]] > self.current]
        ahead.sort(key=self.next_use)
        self._issued.update(prefetch(self.offload, ahead, set(), self.next_use))

    def next_use(self, key: Key) -> float:
        """Smaller is sooner. Fractional parts order experts within a layer."""
        count = self.plan.counts.get(key)
        if count is None:
            return _UNPREDICTED - self._rank.get(key, 0)
        if self.position[key[0]] <= self.current:
            return _PASSED - count
        return self.position[key[0]] + 1.0 / (1 + count + self.plan.weight.get(key, 0.0))

    def choose_victim(self, candidates: list[Key]) -> Key:
        assert self.offload is not None
        self._rank = {k: i for i, k in enumerate(self.offload.pool.recency)}
        return max(candidates, key=self.next_use)
