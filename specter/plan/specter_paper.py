"""``specter-paper``: Specter's released algorithm (ASPLOS), reproduced.

After each draft step the routers' choices are added into per-(layer, expert) counters. At a plan
point the top-M experts per layer by count are prefetched (M = resident slots per layer). The first
plan point comes after max(1, ⌊0.2 K⌋) draft steps; the next one
⌈plan bytes / est. bandwidth / est. draft-step time⌉ steps later, both estimates exponential
moving averages (weight 0.25; bandwidth prior 12 GB/s). Eviction is LRU with the planned set
protected. K is chosen per model by profiling over {2, 4, 6, 8, 12, 16, 20, 24, 32}.
"""

from __future__ import annotations

import math

from specter.experts.slots import Key
from specter.plan.base import Policy
from specter.plan.draft_plans import RoundPlan
from specter.plan.schedule import prefetch, slots_per_layer
from specter.protocol import PlanDelta

EMA = 0.25
BANDWIDTH_PRIOR = 12e9
K_CANDIDATES = (2, 4, 6, 8, 12, 16, 20, 24, 32)


class SpecterPaper(Policy):
    """Counter-based window plans at bandwidth-timed plan points."""

    name = "specter-paper"
    default_window = 8

    def __init__(self) -> None:
        super().__init__()
        self.plan = RoundPlan()
        self.planned: set[Key] = set()
        self.window = self.default_window
        self.bandwidth = BANDWIDTH_PRIOR
        self.step_s: float | None = None
        self._next_point = 1
        self._last_step_end: float | None = None
        self._link_mark = (0, 0.0)

    def begin_round(self, round_id: int) -> None:
        self.plan.reset(round_id)
        self._next_point = max(1, math.floor(0.2 * self.drafts_this_round(self.window)))
        self._last_step_end = self.offload.clock.now() if self.offload is not None else None
        self._update_bandwidth()

    def on_plan(self, delta: PlanDelta) -> None:
        if self.offload is None or not self.plan.add(delta):
            return
        now = self.offload.clock.now()
        if self._last_step_end is not None:
            self.step_s = _ema(self.step_s, now - self._last_step_end)
        self._last_step_end = now
        if self.plan.steps != self._next_point:
            return
        keys = self.plan.top_per_layer(slots_per_layer(self.offload))
        self.planned = set(keys)
        issued = prefetch(self.offload, keys, self.planned)
        nbytes = len(issued) * self.offload.store.shape.nbytes
        step = self.step_s or 1e-3
        self._next_point = self.plan.steps + max(1, math.ceil(nbytes / self.bandwidth / step))

    def choose_victim(self, candidates: list[Key]) -> Key:
        assert self.offload is not None
        free = [k for k in candidates if k not in self.planned] or candidates
        return self.offload.pool.lru(free)

    def _update_bandwidth(self) -> None:
        """EMA of the bandwidth the link actually delivered since the last round."""
        if self.offload is None:
            return
        now_moved, now_busy, _ = self.offload.link.counts()  # one moment: a copy may finish meanwhile
        moved, busy = now_moved - self._link_mark[0], now_busy - self._link_mark[1]
        self._link_mark = (now_moved, now_busy)
        if moved > 0 and busy > 0:
            self.bandwidth = _ema(self.bandwidth, moved / busy)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
