"""``specter``: our policy. Plans stream per draft step; each step it decides which predicted
experts are worth a slot and link time, moves those in need order, and gives up the slot whose
next predicted use is furthest away.

* Value (``select``): a predicted expert is worth its chance of being used — the draft's measured
  agreement at its vote count — times the time it saves when resident (its host computation, or
  a demand transfer without a host). By value, experts are kept while their slot group has room
  and the link can still land every kept one before the verify pass reaches its layer (its
  deadline, from the measured draft-step and verify-layer times). ``+novalue`` prefetches every
  predicted expert instead (the policy before this).
* Need order: the kept experts move in the verify pass's layer order (then votes, then router
  weight); the not-kept are not moved and are evicted before the kept.
* Eviction: an expert the round does not predict goes first (least recently used first), then
  one whose layer the running verify pass has already passed, then a predicted one not kept;
  a kept one is given up only for a more urgent one. Pinned experts are never candidates, nor the
  running layer's between its routing being read and its experts running (``before_layer``).
* Demand misses go ahead of every prefetch (the link's priority queue). When a layer's true
  routing is known, queued prefetches for that layer's unneeded experts are cancelled, and the
  schedule is redone.
* Window: K is chosen per round from what the run measures (``specter/plan/window.py``), K = 0
  (a plain decode step with host compute) included; the engine's window is only its cap (32).
  ``specter+fixed`` drafts the full window every round; ``specter+last`` adds the draft forward
  that routes the K-th token's position.
* Pipelined drafting: while a verify pass waits for the link or the host, the draft drafts the next
  round as if this one were all accepted (``specter.proposer.IdleProposer``; through the actors the
  draft actor does it). On by default since commit ca79b58 (2026-12-04), when the K chooser and the bound account
  for it; ``specter+nopipe`` drafts each round after the one before is judged.
* Host compute: an expert the link would bring later than the host could compute it is computed
  on the host (its queued prefetch cancelled), and not cached: ``+fetch`` fetches it for later
  always, ``+idlefetch`` when the link is idle as the layer ends (in place of an expert needed
  later still), ``+cachearm`` makes that a plain-step arm the window chooser measures like any K
  (``window.PLAIN_CACHED``). ``docs/benchmark.md`` measures them: caching pays at large budgets and
  costs at small ones, and measured per run the two plain arms' costs move more with the text than
  with the arm (measured 2026-12-03), so none is the default yet.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator

import torch

from specter.experts.slots import Key
from specter.plan.base import Policy
from specter.plan.draft_plans import RoundPlan
from specter.plan.exchange import ExchangeTally
from specter.plan.schedule import cancel_queued, prefetch
from specter.protocol import PlanDelta

_PASSED = 1e6
_NOT_KEPT = 1e3
_UNPREDICTED = 1e9
_VOTES_CAP = 8  # agreement is measured per vote count up to this many
_DECAY = 0.98  # per predicted expert, on the agreement counts
_EMA = 0.25


class Specter(Policy):
    """Need-ordered streaming prefetch with furthest-next-use eviction."""

    name = "specter"
    default_window = 32  # the cap of the adaptive K
    route_last_draft = False  # ``specter+last``: one more draft forward routes the K-th token too
    host_compute = True
    fetch_when_idle = False  # ``+idlefetch``: see the module notes
    adaptive_window = True
    value_order = True  # prefetch only what is worth its link time (``select``)
    hindsight_cache = True  # a plain step caches its host experts when such swaps paid (``fetch_later``)
    pipelined = True  # the next round drafted in the verify pass's waits (``+nopipe``: not; docs/benchmark.md)

    def __init__(self) -> None:
        super().__init__()
        self.plan = RoundPlan()
        self.current = -1  # the MoE layer the verify pass is at; -1 while drafting
        self.position: dict[int, int] = {}
        self._rank: dict[Key, int] = {}
        self._issued: set[Key] = set()
        self._kept: set[Key] = set()  # the predicted experts ``select`` holds slots for
        self._now: set[Key] = set()  # the running verify layer's experts, not run yet: never a victim
        self._value: dict[Key, float] = {}  # each predicted expert's value (seconds saved, expected)
        self._agreement: dict[int, tuple[float, float]] = {}  # votes → (used, seen), decayed
        self._step_s = 1e-3  # a draft step, EMA
        self._layer_s = 1e-3  # one MoE layer of the verify pass, EMA
        self._round_k = 0  # the running round's K
        self._drafted = 0  # its draft steps done so far
        self._mark: float | None = None  # when the last draft step (or verify layer) started
        self.exchange = ExchangeTally()  # whether caching a host-computed expert paid, in hindsight

    def bind(self, offload) -> None:  # type: ignore[no-untyped-def]
        super().bind(offload)
        self.position = {layer: i for i, layer in enumerate(offload.store.layers)}

    def begin_round(self, round_id: int) -> None:
        assert self.offload is not None
        chooser = self.window_chooser()
        self._round_k = self.drafts_this_round(chooser.last if chooser is not None and chooser.last is not None
                                               else self.window)
        self._drafted = 0
        self._mark = self.offload.clock.now()
        stale = [k for k in self._issued if self.offload.pool.is_loading(k)]
        cancel_queued(self.offload, stale)
        self._issued.clear()
        self._kept.clear()
        self._now = set()
        self.plan.reset(round_id)
        self.current = -1

    def on_plan(self, delta: PlanDelta) -> None:
        if self.plan.add(delta):
            self.draft_step_done()
            self.schedule()

    def on_plans(self, deltas: list[PlanDelta]) -> None:
        """Steps drafted while the verify pass ran, folded in together and scheduled once (their
        gaps were not draft steps the round waited for, so they do not feed the step time)."""
        added = sum(self.plan.add(delta) for delta in deltas)
        if added:
            assert self.offload is not None
            self._drafted += added
            self._mark = self.offload.clock.now()
            self.schedule()

    def draft_step_done(self) -> None:
        """A draft step of the running round finished (its time feeds the deadlines)."""
        self._drafted += 1
        self._tick(draft=True)

    def begin_verify(self, round_id: int, positions: int) -> None:
        self.current = -1
        self._now = set()
        self._mark = None

    def before_layer(self, layer: int, hidden: torch.Tensor, needed: list[int]) -> None:
        assert self.offload is not None
        self.exchange.observe(layer, needed)
        self._tick(draft=False)
        self.current = self.position[layer]
        wanted = set(needed)
        wasted = [k for k in self._issued if k[0] == layer and k[1] not in wanted]
        cancel_queued(self.offload, wasted)
        # The layer's experts are about to run: a prefetch for a later layer must not take their slots
        # (the layer would fetch them back on demand first; they are pinned only once it runs them).
        self._now = {(layer, e) for e in needed}
        self.schedule()

    def end_round(self, round_id: int, accepted: int, true_routing: dict[int, set[int]]) -> None:
        self.current = -1
        self._now = set()
        for key, votes in self.plan.counts.items():  # how often n votes meant the expert was used
            n = min(votes, _VOTES_CAP)
            used, seen = self._agreement.get(n, (1.0, 2.0))
            hit = key[1] in true_routing.get(key[0], ())
            self._agreement[n] = (_DECAY * used + hit, _DECAY * seen + 1.0)

    def _tick(self, draft: bool) -> None:
        """Fold the time since the previous plan delta (or layer start) into its EMA."""
        assert self.offload is not None
        now = self.offload.clock.now()
        if self._mark is not None:
            gap = now - self._mark
            if draft:
                self._step_s = _EMA * gap + (1 - _EMA) * self._step_s
            else:
                self._layer_s = _EMA * gap + (1 - _EMA) * self._layer_s
        self._mark = now

    def schedule(self) -> None:
        """Issue prefetches for the predicted experts worth holding, most urgent first.

        Worth holding (``select``): the most value per slot and link-second that the slots can
        hold and the link can land before each one's layer runs; queued prefetches of the others
        are cancelled, and the others are evicted before the kept ones.
        """
        assert self.offload is not None
        self._rank = self.offload.pool.recency_rank()
        ahead = [k for k in self.plan.counts if self.position[k[0]] > self.current]
        if self.value_order:
            self._kept = set(self.select(ahead))
            dropped = [k for k in ahead if k not in self._kept and k in self._issued]
            cancel_queued(self.offload, dropped)
            ahead = [k for k in ahead if k in self._kept]
        next_use = functools.cache(self.next_use)  # fixed until the next schedule
        ahead.sort(key=next_use)
        self._issued.update(prefetch(self.offload, ahead, self._now, next_use))

    def select(self, ahead: list[Key]) -> list[Key]:
        """Of the predicted experts ``ahead``, the ones to hold in slots for the verify pass.

        Each has a value — the chance it is used (the draft's measured agreement at its vote
        count) times the time it saves when resident (its host computation, or a demand
        transfer where there is no host; whichever is less) — and a deadline, when the verify
        pass reaches its layer, plus its host computation's time (landing later than that saves
        nothing: the host would be done first; without a host there is no such limit, as a
        demand fetch lands later than a prefetch anyway). By value, an expert is
        kept while its slot group has room (the slots not pinned by the running layer), and, if it
        still has to move, only if every kept one still lands by its deadline with the link moving
        them in deadline order after what it is already doing (unit jobs with deadlines: greedy by value is the most valuable feasible
        set). What is not kept is not moved, and is evicted before what is.
        """
        assert self.offload is not None
        offload, pool = self.offload, self.offload.pool
        now = offload.clock.now()
        transfer = offload.link.estimate_s(offload.store.shape.nbytes)
        host = offload.host if self.host_compute else None
        room = pool.unpinned_per_group()
        for key in self._now:  # the running layer's: in their slots (or on their way), not pinned yet
            if pool.holds(key) and not pool.is_pinned(key):
                room[pool.group_of(key[0])] -= 1
        scored = []
        own_queued = 0
        by_votes: dict[int, tuple[float, float]] = {}  # votes → (value, host seconds); few distinct counts
        by_layer: dict[int, float] = {}  # layer → when the verify pass reaches it
        for key in ahead:
            loading = pool.transfer_of(key)
            votes = self.plan.counts[key]
            if votes not in by_votes:
                on_host = math.inf if host is None else host.expert_s(votes)
                by_votes[votes] = (self.chance(votes) * min(transfer, on_host), on_host)
            if key[0] not in by_layer:
                by_layer[key[0]] = self.deadline(key, now)
            value, on_host = by_votes[votes]
            moving = not pool.holds(key) or (loading is not None and not loading.started)
            own_queued += loading is not None and not loading.started
            # it still saves time if it lands before the host could have computed it there (a
            # demand fetch would land later than a prefetch in any case)
            scored.append((value, by_layer[key[0]] + on_host, key, moving))
        start = offload.link.free_at(now) + (offload.link.queued() - own_queued) * transfer
        lands = [start + n * transfer for n in range(len(scored) + 2)]  # the n-th on the link lands then
        kept: list[Key] = []
        on_link: list[float] = []  # deadlines of the kept ones that still have to move, sorted
        for _, deadline, key, moving in sorted(scored, key=lambda c: (-c[0], c[1])):
            group = pool.group_of(key[0])
            if room[group] <= 0:
                continue
            if moving:  # inserted at i, it lands (i + 1)-th; the ones after it land one later
                i = bisect.bisect_right(on_link, deadline)
                if lands[i + 1] > deadline or min(map(operator.sub, on_link[i:], lands[i + 2:]), default=0.0) < 0:
                    continue
                on_link.insert(i, deadline)
            room[group] -= 1
            kept.append(key)
        self._value = {key: value for value, _, key, _ in scored}
        return kept

    def chance(self, votes: int) -> float:
        """How often a predicted expert with ``votes`` draft votes was used by the verify pass."""
        n = min(votes, _VOTES_CAP)
        used, seen = self._agreement.get(n, (1.0, 2.0))  # prior: even odds
        return used / seen

    def deadline(self, key: Key, now: float) -> float:
        """When the verify pass is expected to reach ``key``'s layer."""
        layers_before = self.position[key[0]] - max(self.current, 0)
        if self.current >= 0:
            return now + layers_before * self._layer_s
        remaining = max(0, self._round_k - self._drafted) + (1 if self.route_last_draft else 0)
        return now + remaining * self._step_s + (self.position[key[0]]) * self._layer_s

    def fetch_later(self, keys: list[Key]) -> None:
        """Host-computed experts go into slots only in place of ones needed later still; in a
        plain step (``hindsight_cache``) only when such a swap has paid lately (``exchange``)."""
        assert self.offload is not None
        self._rank = self.offload.pool.recency_rank()
        for key in keys:  # just used: the most recent of all
            self._rank[key] = len(self._rank)
        if self.hindsight_cache and self._round_k == 0 and not (self.fetch_when_idle or self.fetch_after_host):
            keys = self._worth_caching(keys)
        self._issued.update(prefetch(self.offload, keys, set(), self.next_use))

    def _worth_caching(self, keys: list[Key]) -> list[Key]:
        """Of ``keys``, those to cache: each goes into an empty slot, or is offered as a swap for the
        expert it would evict (``ExchangeTally``: judged later, by which is used first) and cached
        if such swaps have paid."""
        assert self.offload is not None
        pool, worth = self.offload.pool, self.exchange.worth()
        empty: dict[int, int] = {}
        victims: dict[int, list[Key]] = {}
        chosen = []
        for key in keys:
            group = pool.group_of(key[0])
            if group not in empty:
                empty[group] = pool.empty_count(key[0])
                victims[group] = sorted(pool.evictable(key[0], keys), key=self.next_use)
            if empty[group] > 0:
                empty[group] -= 1
                chosen.append(key)
            elif victims[group]:
                self.exchange.propose(key, victims[group].pop())
                if worth:
                    chosen.append(key)
        return chosen

    def next_use(self, key: Key) -> float:
        """Smaller is sooner. Fractional parts order experts within a layer."""
        if key in self._now:  # the running layer's, about to run
            return -1.0
        count = self.plan.counts.get(key)
        if count is None:
            return _UNPREDICTED - self._rank.get(key, 0)
        if self.position[key[0]] <= self.current:
            return _PASSED - count
        if self.value_order and key not in self._kept:  # predicted, not worth its slot
            return _NOT_KEPT - self._value.get(key, 0.0)
        return self.position[key[0]] + 1.0 / (1 + count + self.plan.weight.get(key, 0.0))

    def choose_victim(self, candidates: list[Key]) -> Key:
        assert self.offload is not None
        self._rank = self.offload.pool.recency_rank()
        return max(candidates, key=self.next_use)
