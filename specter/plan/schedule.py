"""Shared scheduling pieces: issuing prefetches in need order, next-use eviction, stale plans."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from specter.experts.link import PREFETCH
from specter.experts.slots import Key
from specter.plan.base import Offload

NEVER = float("inf")


def slots_per_layer(offload: Offload) -> int:
    """M: how many experts of one layer can be resident at once (per-layer groups or an even share)."""
    layers = offload.store.layers
    if offload.pool.per_layer:
        return offload.pool.capacity(layers[0])
    return max(1, offload.pool.num_slots // len(layers))


def prefetch(
    offload: Offload, keys: Iterable[Key], protect: set[Key], next_use: Callable[[Key], float] | None = None,
) -> list[Key]:
    """Start moving ``keys`` (most urgent first) that are not resident; returns those issued.

    Without ``next_use``, victims are the policy's choice. With it, a victim must be needed later
    than the expert it makes room for (furthest next use first), so a prefetch never pushes out
    something more urgent than itself; issuing stops at the first key that cannot be placed.
    """
    issued: list[Key] = []
    pool = offload.pool
    if next_use is not None:  # fixed while issuing: each expert's next use is computed once
        next_use = functools.cache(next_use)
    victims: dict[int, list[Key]] = {}  # per slot group: the evictable, furthest next use last
    empty: dict[int, int] = {}  # per slot group: its empty slots (a fetch fills one before it evicts)
    for key in keys:
        if pool.holds(key):
            continue
        choose = None
        group = pool.group_of(key[0])
        if group not in empty:
            empty[group] = pool.empty_count(key[0])
        if next_use is not None and not empty[group]:
            if group not in victims:  # ties: the first in slot order goes first, as max() would pick
                ranked = sorted(enumerate(pool.evictable(key[0], protect)), key=lambda c: (next_use(c[1]), -c[0]))
                victims[group] = [k for _, k in ranked]
            queue = victims[group]
            if not queue or next_use(queue[-1]) <= next_use(key):
                break
            choose = _fixed(queue.pop())
        if offload.fetch(key, PREFETCH, protect, choose) is None:
            break
        empty[group] = max(0, empty[group] - 1)
        issued.append(key)
    return issued


def _fixed(victim: Key | None) -> Callable[[list[Key]], Key]:
    def choose(candidates: list[Key]) -> Key:
        return victim if victim in candidates else candidates[0]

    return choose


def cancel_queued(offload: Offload, keys: Iterable[Key]) -> int:
    """Cancel prefetches of ``keys`` that have not started moving; returns how many."""
    return sum(offload.cancel(key) for key in list(keys))
