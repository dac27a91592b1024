"""A lower bound on TPOT: what no schedule of a run's own rounds could beat.

Given what a run did — its rounds (K, drafts, acceptance: so the same passes), each verify layer's
true routing and tokens per expert, the slot budget and the residency when decoding started — and
the cost model, no schedule of those passes, even one that knows the future, finishes sooner than:

* **Misses.** With at most S experts in a slot group's slots, at least ``M`` of the needed experts
  are not resident when their layer runs, ``M`` the fewest possible: after each layer the slots
  keep, of what they held and what the layer used, the S experts needed again soonest (Belady's
  rule with bypass, at layer granularity; the exchange argument of Belady's proof carries over).
  Each of them is moved (one transfer's time ``τ`` on the link, which moves one at a time) or
  computed on the host; ``j`` of them on the host take at least ``H_j``, the sum of the ``j``
  smallest host times of any expert use of the run.
* **The device and the host.** The device runs the drafts (``W``), every layer's dense part
  (``L``) and the experts it computes; the host's experts of a layer are computed once its dense
  part has run and must be done before the layer ends, and the host runs one at a time. With ``A``
  the device time of every needed expert and ``r`` the least host/device time ratio of any of them,
  a schedule giving the host ``H`` seconds of expert work saves the device at most ``H / r`` of it,
  so the device is busy at least ``W + L + A − H/r``. The host's work lies between its layers'
  dense parts, so the passes last at least ``L + H``. A round drafted once the pass before it
  was judged drafts while no pass runs, so while the host is idle; only a round drafted ahead
  (pipelined: during the pass before it, assuming that pass accepts every draft token) that
  stood could have drafted while the host computed — its drafting ``W_a`` (``Trace.ahead_s``; 0
  unpipelined). So the run lasts at least ``G + H`` with ``G = W − W_a + L``. In all,
  ``g(H) = max(W + L + A − H/r, G + H)``, least at ``H* = (W + L − G + A)·r/(1+r)`` and growing
  beyond it.

So ``TPOT · (N − 1) ≥ min_j max(g(max(H_j, H*)), (M − j)·τ)`` over the decode's ``N − 1`` token
intervals. It ignores that routing is only known when a layer runs,
that transfers and compute must interleave and that a layer's experts are pinned while it runs —
each makes real schedules slower, never faster — so no policy beats it (tests/test_bound.py checks
every policy on the same runs). Without a host (``host_s`` None) ``j`` is 0 and ``H`` is 0.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from specter.experts.slots import Key


@dataclass
class LayerUse:
    """One verify-pass MoE layer: its dense part's cost and each needed expert's token count."""

    layer: int
    dense_s: float
    experts: dict[int, int]  # expert → tokens routed to it


@dataclass
class Trace:
    """What the bound needs of a run's decode (recorded by the executor and the engine)."""

    capacity: dict[int, int]  # slot group → slots
    group_of: dict[int, int]  # MoE layer → its slot group
    initial: set[Key]  # resident (or on their way) when decoding started
    draft_s: float = 0.0  # the draft forwards' compute
    ahead_s: float = 0.0  # of draft_s, the rounds drafted ahead that stood (pipelined): may overlap the host
    layers: list[LayerUse] = field(default_factory=list)


@dataclass(frozen=True)
class Bound:
    """The bound's parts, in seconds over the decode."""

    device_s: float
    link_host_s: float
    misses: int  # M: the fewest needed experts not resident at their layer

    @property
    def decode_s(self) -> float:
        return max(self.device_s, self.link_host_s)


def fewest_misses(trace: Trace) -> list[tuple[Key, int]]:
    """The needed experts (with their tokens) that no slot schedule can have resident at their
    layer: the misses of Belady's rule with bypass, group by group, at layer granularity."""
    uses = trace.layers
    # next_use[i][e]: the index of the next layer use of (layer, e) after use i (len(uses): never)
    next_at: dict[Key, int] = {}
    following: list[dict[int, int]] = [{} for _ in uses]
    for i in range(len(uses) - 1, -1, -1):
        use = uses[i]
        for e in use.experts:
            key = (use.layer, e)
            following[i][e] = next_at.get(key, len(uses))
            next_at[key] = i
    # the first use of each initially resident key
    held: dict[int, dict[Key, int]] = {g: {} for g in trace.capacity}
    for key in trace.initial:
        if key in next_at:  # one never needed again cannot save a miss
            held[trace.group_of[key[0]]][key] = next_at[key]
    missed: list[tuple[Key, int]] = []
    for i, use in enumerate(uses):
        group = trace.group_of[use.layer]
        cache = held[group]
        for e, tokens in use.experts.items():
            key = (use.layer, e)
            if key not in cache:
                missed.append((key, tokens))
            cache[key] = following[i][e]
        if len(cache) > trace.capacity[group]:
            keep = heapq.nsmallest(trace.capacity[group], cache.items(), key=lambda kv: kv[1])
            held[group] = cache = dict(keep)
        for key in [k for k, nxt in cache.items() if nxt >= len(uses)]:
            del cache[key]  # never needed again: keeping it cannot save a miss
    return missed


def lower_bound(trace: Trace, expert_s, transfer_s: float, host_s=None) -> Bound:  # type: ignore[no-untyped-def]
    """The bound for ``trace``.

    Args:
        trace: the run's decode.
        expert_s: tokens → seconds of one target expert on the device.
        transfer_s: seconds one expert takes on the link.
        host_s: tokens → seconds of one expert on the host; None when there is no host compute.
    """
    layers = sum(use.dense_s for use in trace.layers)
    dense = trace.draft_s + layers
    beside = dense - trace.ahead_s  # G: what the host's work cannot overlap
    tokens = [t for use in trace.layers for t in use.experts.values()]
    device = sum(expert_s(t) for t in tokens)
    misses = len(fewest_misses(trace))
    best = Bound(dense + device, misses * transfer_s, misses)
    if host_s is None or not tokens:
        return best
    ratio = min(host_s(t) / expert_s(t) for t in tokens)
    balanced = (dense - beside + device) * ratio / (1.0 + ratio)

    def timeline(host: float) -> float:
        host = max(host, balanced)
        return max(dense + device - host / ratio, beside + host)

    cheapest = sorted(host_s(t) for t in tokens)[:misses]
    host = 0.0
    for j in range(misses + 1):
        if j:
            host += cheapest[j - 1]
        candidate = Bound(timeline(host), (misses - j) * transfer_s, misses)
        if candidate.decode_s < best.decode_s:
            best = candidate
    return best
