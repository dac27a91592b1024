"""``demand-lru``: mixtral-offloading's policy. No prediction; fetch on miss, evict the LRU expert.

``demand-host``: Fiddler's idea over the same cache. No prediction; a missing expert is computed
on the host when that finishes before its transfer would land, else fetched into an LRU slot.
"""

from __future__ import annotations

from specter.plan.base import Policy


class DemandLRU(Policy):
    """The true routing decides; missing experts are fetched on demand into LRU-freed slots."""

    name = "demand-lru"


class DemandHost(DemandLRU):
    """Demand misses go to the host when it is the faster path; the rest are fetched, LRU."""

    name = "demand-host"
    host_compute = True
