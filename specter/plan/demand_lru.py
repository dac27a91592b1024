"""``demand-lru``: mixtral-offloading's policy. No prediction; fetch on miss, evict the LRU expert."""

from __future__ import annotations

from specter.plan.base import Policy


class DemandLRU(Policy):
    """The true routing decides; missing experts are fetched on demand into LRU-freed slots."""

    name = "demand-lru"
