"""Prefetch policies behind one interface (``Policy``); ``make_policy`` builds one by name."""

from __future__ import annotations

from specter.plan.base import Policy
from specter.plan.demand_lru import DemandLRU
from specter.plan.gate_prefetch import GatePrefetch
from specter.plan.oracle import Oracle
from specter.plan.specmoeoff import SpecMoEOff
from specter.plan.specter import Specter
from specter.plan.specter_paper import SpecterPaper

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (DemandLRU, GatePrefetch, SpecMoEOff, SpecterPaper, Specter, Oracle)
}
DRAFT_POLICIES = {SpecMoEOff.name, SpecterPaper.name, Specter.name, Oracle.name}


def make_policy(name: str) -> Policy:
    """A fresh policy by name, or an error naming the known ones."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()
