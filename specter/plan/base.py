"""The policy interface: who decides what moves when, over one slot pool and one link."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specter.experts.host import HostCompute
from specter.experts.link import PREFETCH, Link, Transfer
from specter.experts.slots import ChooseVictim, Key, SlotPool
from specter.experts.store import ExpertStore
from specter.plan.window import WindowChooser
from specter.protocol import PlanDelta
from specter.timing.clock import WallClock


class Offload(Protocol):
    """What a policy sees of a target's offloaded experts (``OffloadedExperts`` in
    ``specter/experts/executor.py``, which imports this module, not the other way round): the
    host store, the slot pool, the link, the clock and host, and two actions."""

    store: ExpertStore
    pool: SlotPool
    link: Link
    clock: WallClock
    host: HostCompute | None

    def fetch(
        self, key: Key, priority: int, protect: set[Key], choose: ChooseVictim | None = None
    ) -> Transfer | None:
        """Start moving ``key`` into a slot; None when no slot can be freed right now."""

    def cancel(self, key: Key) -> bool:
        """Drop a queued (not started) transfer of ``key`` and free its slot."""


class Policy:
    """Base policy: no prediction, least-recently-used eviction.

    Subclasses override the hooks they need; every hook runs on the compute thread.
    """

    name = "base"
    default_window = 0  # draft tokens per round when the user gives none (0: plain decoding)
    route_last_draft = False  # ask the engine for one more draft forward to route the K-th token
    host_compute = False  # a late expert is computed on the host when that finishes before it lands
    fetch_after_host = False  # an expert computed on the host is still moved into a slot, for later
    fetch_when_idle = False  # ... but only when the link is idle as the layer ends
    cache_arm = False  # ``+cachearm``: the window chooser's plain step may cache its host experts (window.PLAIN_CACHED)
    hindsight_cache = False  # a plain step offers its host experts to ``fetch_later``, which caches them if that paid
    value_order = False  # prefetch only the predicted experts worth their slot and link time (specter)
    adaptive_window = False  # K is chosen per round (``specter/plan/window.py``); the window is its cap
    pipelined = False  # ``+pipe``: the next round is drafted while this one is verified (``Engine``)
    needs_model = False  # reads the target's routers and hidden states: it schedules next to them

    def __init__(self) -> None:
        self.offload: Offload | None = None
        self.window = 0
        self.round_drafts: int | None = None  # a batched round's draft steps, all its requests' (``Batcher``)
        self._chooser: WindowChooser | None = None

    def drafts_this_round(self, k: int) -> int:
        """Plan deltas the running round sends before its verify pass: ``k`` (its K) for one
        request; in a batched round every drafting request's K, since the requests draft together
        but each request's draft step is a delta of its own (``round_drafts``)."""
        return k if self.round_drafts is None else self.round_drafts

    def window_chooser(self) -> WindowChooser | None:
        """The per-round K chooser when the policy adapts its window (kept across requests:
        what was measured stays learnt), else None: every round drafts the full window."""
        if not self.adaptive_window:
            return None
        if self._chooser is None:
            self._chooser = self.new_window_chooser()
        return self._chooser

    def new_window_chooser(self) -> WindowChooser:
        """A blank chooser for this policy (with ``+cachearm`` and host compute, two plain arms)."""
        return WindowChooser(route_last=self.route_last_draft, cache_arm=self.cache_arm and self.host_compute)

    def window_chooser_from(self, state: dict[str, Any]) -> WindowChooser:
        """A chooser for this policy that goes on from ``state`` (``WindowChooser.state``'s).

        Raises:
            ValueError: ``state`` is no chooser's, or one of a policy that drafts differently (its
                last draft token routed or not, plain steps with or without the caching arm)."""
        chooser, blank = WindowChooser.from_state(state), self.new_window_chooser()
        if (chooser.route_last, chooser.cache_arm) != (blank.route_last, blank.cache_arm):
            raise ValueError(f"K chooser state: kept for a policy with route_last={chooser.route_last}, "
                             f"cache_arm={chooser.cache_arm}; this one has {blank.route_last}, {blank.cache_arm}")
        return chooser

    def fetches_when_idle(self) -> bool:
        """Whether an expert the host just computed moves into a slot when the link is idle as its
        layer ends: always with ``+idlefetch``, when the window chooser's plain step caches, and in a
        plain step of a policy that decides in ``fetch_later`` (``hindsight_cache``)."""
        chooser = self.window_chooser()
        if self.fetch_when_idle or (chooser is not None and chooser.caching):
            return True
        return self.hindsight_cache and chooser is not None and chooser.last == 0

    def use_window_chooser(self, chooser: WindowChooser) -> None:
        """Choose K with ``chooser`` from now on (what it measured before, on another instance of
        this policy, stays learnt); ignored by a policy that does not adapt its window."""
        if self.adaptive_window:
            self._chooser = chooser

    def bind(self, offload: Offload) -> None:
        """Called once when the policy is attached to a target's experts."""
        self.offload = offload

    def attach_model(self, model: torch.nn.Module) -> None:
        """Called once the target's transformers model is loaded (policies that need its routers)."""

    def begin_request(self) -> None:
        """A new request starts (its rounds count from 0)."""

    def begin_round(self, round_id: int) -> None:
        """A speculative round starts; plans of older rounds are stale from now on."""

    def on_plan(self, delta: PlanDelta) -> None:
        """A draft step's routing, sent the moment the step finishes."""

    def on_plans(self, deltas: list[PlanDelta]) -> None:
        """Several draft steps' routing at once (a round drafted ahead, while the verify pass ran)."""
        for delta in deltas:
            self.on_plan(delta)

    def begin_verify(self, round_id: int, positions: int) -> None:
        """The target is about to verify ``positions`` positions in one pass."""

    def end_round(self, round_id: int, accepted: int, true_routing: dict[int, set[int]]) -> None:
        """The round is decided; ``true_routing`` is the verify pass's experts per layer."""

    def before_layer(self, layer: int, hidden: torch.Tensor, needed: list[int]) -> None:
        """Called at each MoE layer once its true routing is known, before any expert runs."""

    def fetch_later(self, keys: list[Key]) -> None:
        """Move experts the host just computed into slots, for later uses (behind every demand)."""
        assert self.offload is not None
        for key in keys:
            self.offload.fetch(key, PREFETCH, set())

    def choose_victim(self, candidates: list[Key]) -> Key:
        """Which of ``candidates`` (evictable experts) gives up its slot."""
        assert self.offload is not None
        return self.offload.pool.lru(candidates)
