"""``specmoeoff``: SpecMoEOff's policy — an int4 draft with K = 3 and frequency-ranked prefetch of
the drafted experts at 0.2 and 0.6 of the window; LRU eviction with the planned set protected."""

from __future__ import annotations

import math

from specter.experts.slots import Key
from specter.plan.base import Policy
from specter.plan.draft_plans import RoundPlan
from specter.plan.schedule import prefetch, slots_per_layer
from specter.protocol import PlanDelta

SPECMOEOFF_WINDOW = 3
PLAN_POINTS = (0.2, 0.6)


class SpecMoEOff(Policy):
    """Two plan points per round, each prefetching the top-M experts per layer by draft count."""

    name = "specmoeoff"
    default_window = SPECMOEOFF_WINDOW

    def __init__(self) -> None:
        super().__init__()
        self.plan = RoundPlan()
        self.planned: set[Key] = set()
        self.window = SPECMOEOFF_WINDOW

    def begin_round(self, round_id: int) -> None:
        self.plan.reset(round_id)

    def on_plan(self, delta: PlanDelta) -> None:
        if self.offload is None or not self.plan.add(delta):
            return
        points = {max(1, math.ceil(f * self.drafts_this_round(self.window))) for f in PLAN_POINTS}
        if self.plan.steps in points:
            keys = self.plan.top_per_layer(slots_per_layer(self.offload))
            self.planned = set(keys)
            prefetch(self.offload, keys, self.planned)

    def choose_victim(self, candidates: list[Key]) -> Key:
        assert self.offload is not None
        free = [k for k in candidates if k not in self.planned] or candidates
        return self.offload.pool.lru(free)
