"""Prefetch policies behind one interface (``Policy``); ``make_policy`` builds one by name."""

from __future__ import annotations

from specter.plan.base import Policy
from specter.plan.demand_lru import DemandLRU

POLICIES: dict[str, type[Policy]] = {DemandLRU.name: DemandLRU}


def make_policy(name: str) -> Policy:
    """A fresh policy by name, or an error naming the known ones."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
