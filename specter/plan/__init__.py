"""Prefetch policies behind one interface (``Policy``); ``make_policy`` builds one by name.

A name may carry options after ``+``: ``host`` / ``nohost`` turn host compute of late experts on
or off, ``fetch`` also moves a host-computed expert into a slot for later (implies ``host``),
``nofetch`` does not; ``nolast`` skips the extra draft forward that routes the K-th token
(``last`` runs it); ``fixed`` drafts the full window every round, ``adapt`` chooses each round's K
(``specter/plan/window.py``); ``idlefetch`` fetches a host-computed expert for later when the link
is idle; ``cachearm`` lets the K chooser measure a plain step that does so as an arm of its own (in
place of ``hindsight``, ``specter``'s default: a plain step caches them while such swaps paid, judged
on the routing that follows; ``nohindsight`` never); ``novalue`` / ``value`` turn specter's value-ordered prefetch off / on; ``pipe`` drafts the
next round in the verify pass's waits (``specter.proposer.IdleProposer``; through the actors: in the
draft actor), ``nopipe`` does not. E.g. ``specter+nohost`` is ``specter`` as it was before host
compute, ``specter-paper+host`` the released algorithm with it, ``specter+fixed`` ours at one K.
"""

from __future__ import annotations

from specter.plan.base import Policy
from specter.plan.demand_lru import DemandHost, DemandLRU
from specter.plan.gate_prefetch import GatePrefetch
from specter.plan.oracle import Oracle
from specter.plan.specmoeoff import SpecMoEOff
from specter.plan.specter import Specter
from specter.plan.specter_paper import SpecterPaper

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (DemandLRU, DemandHost, GatePrefetch, SpecMoEOff, SpecterPaper, Specter, Oracle)
}
DRAFT_POLICIES = {SpecMoEOff.name, SpecterPaper.name, Specter.name, Oracle.name}
OPTIONS = {"host": {"host_compute": True}, "nohost": {"host_compute": False, "fetch_after_host": False, "fetch_when_idle": False},
           "fetch": {"host_compute": True, "fetch_after_host": True}, "nofetch": {"fetch_after_host": False, "fetch_when_idle": False},
           "idlefetch": {"fetch_when_idle": True}, "cachearm": {"cache_arm": True, "hindsight_cache": False},
           "hindsight": {"hindsight_cache": True}, "nohindsight": {"hindsight_cache": False},
           "nolast": {"route_last_draft": False}, "last": {"route_last_draft": True},
           "fixed": {"adaptive_window": False}, "adapt": {"adaptive_window": True},
           "value": {"value_order": True}, "novalue": {"value_order": False},
           "pipe": {"pipelined": True}, "nopipe": {"pipelined": False}}


def policy_class(name: str) -> type[Policy]:
    """The class behind a policy name (options after ``+`` checked too), or an error naming the known ones."""
    base, *options = name.split("+")
    if base not in POLICIES:
        raise ValueError(f"policy: unknown policy {base!r}; known: {', '.join(sorted(POLICIES))}")
    bad = [o for o in options if o not in OPTIONS]
    if bad:
        raise ValueError(f"policy: unknown option {bad[0]!r} in {name!r}; known: {', '.join(OPTIONS)}")
    return POLICIES[base]


def drafts(name: str) -> bool:
    """Whether the policy ``name`` (options allowed) runs a draft."""
    return name.split("+")[0] in DRAFT_POLICIES


def adapts(name: str) -> bool:
    """Whether the policy ``name`` (options allowed) chooses its K per round (its window is a cap)."""
    return make_policy(name).adaptive_window


def make_policy(name: str) -> Policy:
    """A fresh policy by name (with its ``+`` options applied), or an error naming the known ones."""
    policy = policy_class(name)()
    for option in name.split("+")[1:]:
        for attr, value in OPTIONS[option].items():
            setattr(policy, attr, value)
    policy.name = name
    return policy
