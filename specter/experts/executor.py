"""MoE layers run against the slot pool: resident experts at once, missing ones as they land.

transformers calls ``OffloadedExperts.forward`` (through ``ExpertsInterface``) at every MoE layer
with the layer's true routing, which is read to the host once (the schedule needs the experts).
Needed experts that are resident are pinned and computed at once, together, in one grouped call
over the slot pool (``specter/experts/grouped.py``) while the link brings the missing ones; each
late expert runs the moment it lands, and its slot may then be reused by the next one, so a pass
that needs more experts than there are slots (prefill, a long verify window) streams them through.
Each (token, top-k position) pair's output has its own row, summed once at the end, so results
do not depend on arrival order. In a graphed step (``models/graphed.py``) the grouped calls over
the slots are the layer's captured slot graph, replayed over each call's plan, and the sum is the
next piece's (``finish_layer``).

When the policy allows it (``Policy.host_compute``) and a host is set, a late expert whose
transfer would land after the host could finish computing it is computed on the host from its
store blob instead, while the device runs the rest; the layer ends when both are done
(``specter/experts/host.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specter.bound import LayerUse, Trace
from specter.config import HostConfig
from specter.experts.grouped import FromSlots, LayerRoutes, PairOutputs, planned_pairs, resident_experts
from specter.experts.host import HostCompute
from specter.experts.link import DEMAND, Link, SimulatedLink, Transfer
from specter.experts.slots import ChooseVictim, Key, SlotPool
from specter.experts.store import ExpertShape, ExpertStore
from specter.experts.virtual_link import VirtualLink
from specter.plan.base import Policy
from specter.stats import OffloadCounters
from specter.timing.clock import WallClock
from specter.timing.dispatch import defer_read

SlotMap = torch.Tensor | int  # a layer's experts' slots: a device tensor, or the first of a consecutive run


class OffloadedExperts:
    """The target's routed experts: host store + device slots + link + policy, on one clock."""

    takes_rows = True  # ``forward`` takes one token's pair rows made by the caller (``_Fused.moe_input``)

    def __init__(
        self, store: ExpertStore, pool: SlotPool, link: Link, policy: Policy, timeout: float = 60.0,
        clock: WallClock | None = None,
    ):
        self.clock = link.clock if isinstance(link, VirtualLink) else (clock or WallClock())
        self.store = store
        self.pool = pool
        self.link = link
        self.policy = policy
        self.timeout = timeout
        self.counters = OffloadCounters()
        self.last_needed: dict[int, list[int]] = {}  # layer → the experts the latest pass routed to
        self._maps: dict[int, tuple[int, tuple[SlotMap, list[int]] | None]] = {}  # layer → (pool version, slots)
        self.context = 0  # positions the running pass's KV cache holds before it (for its cost)
        self.trace: Trace | None = None  # when set, each layer's routing is recorded (the bound)
        # Called with the seconds a wait ahead will last, before the pass waits for a transfer or the
        # host (the in-process pipelined draft drafts in that time: ``specter.proposer.IdleProposer``).
        self.on_idle: Callable[[float], None] | None = None
        self.on_cuda = pool.device.type == "cuda"
        self.host: HostCompute | None = default_host(link, store.shape, self.on_cuda, self.clock)
        policy.bind(self)

    def set_host(self, config: HostConfig | None) -> None:
        """The host's compute rate (None: no host compute); a profile sets it (``docs/profiles.md``)."""
        self.host = None if config is None or self.on_cuda else HostCompute(config, self.store.shape, self.clock)

    # -- moving experts -------------------------------------------------------------------
    def fetch(
        self, key: Key, priority: int, protect: set[Key], choose: ChooseVictim | None = None
    ) -> Transfer | None:
        """Start moving ``key`` into a slot; None when no slot can be freed right now."""
        slot = self.pool.reserve(key, protect, choose or self.policy.choose_victim)
        if slot is None:
            return None
        src = self.store.blob(*key)
        wait_for = self.pool.last_reader(slot) if self.on_cuda else None
        transfer = self.link.submit(key, slot, src, self.pool.slot_tensor(slot), priority, wait_for)
        self.pool.start_loading(key, slot, transfer)
        return transfer

    def cancel(self, key: Key) -> bool:
        """Drop a queued (not started) transfer of ``key`` and free its slot."""
        return drop_queued(self.pool, self.link, key)

    def wait(self, key: Key) -> None:
        """Block until ``key``'s transfer has landed; the time counts as waiting."""
        transfer = self.pool.transfer_of(key)
        if transfer is None:
            return
        self.link.promote(transfer)
        if self.on_idle is not None:
            now = self.clock.now()
            landing = self.link.landing(transfer, now)
            if landing is not None and landing > now:
                self.on_idle(landing - now)
        self.counters.wait_s += self.link.wait(transfer, self.timeout)
        self.pool.finish_loading(key)

    def reset_residency(self) -> None:
        """Empty every slot and refill the initial residency (same start for every run)."""
        for key in self.pool.loading_keys():
            self.wait(key)
        for key in self.pool.resident():
            self.pool.evict(key)
        self.prefill_slots()

    def prefill_slots(self) -> None:
        """Fill empty slots round-robin over layers (expert 0 of every layer, then 1, …), untimed."""
        for key, slot in self.claim_initial_slots():
            self.pool.slot_tensor(slot).copy_(self.store.blob(*key))

    def claim_initial_slots(self) -> list[tuple[Key, int]]:
        """Record the initial residency in the map; returns the (expert, slot) pairs to fill."""
        return initial_slots(self.pool, self.store.layers, self.store.num_experts)

    # -- one MoE layer --------------------------------------------------------------------
    def forward(
        self, module: torch.nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor, residual: torch.Tensor | None = None, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """transformers' eager experts loop's result, with experts taken from slots in grouped calls
        (``specter/experts/grouped.py``) or, for late ones when the policy allows it, computed on
        the host from their blobs; plus ``residual`` when given (the lean step's). ``rows``: one token's
        pair rows, made already (``grouped.resident_experts``; used where the layer is all resident)."""
        resident = self.resident_map(layer)
        if resident is not None:  # nothing to fetch: the host need not know the routing yet
            return self._all_resident(module, layer, hidden, top_k_index, top_k_weights, residual, resident, rows)
        return self._layer(module, layer, hidden, top_k_index, top_k_weights).total(residual)

    def finish_layer(
        self, module: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        pairs: torch.Tensor, from_slots: FromSlots,
    ) -> None:
        """``forward``'s work for a graphed step cut at this layer (``models/graphed.py``): every pair's
        output into ``pairs`` (``(T·k, H)``, the buffer the next piece sums), the experts in slots
        computed by ``from_slots(plan)`` (a padded ``PairOutputs.plan``; a graph that the step captured
        once, replayed for each group of them: the ready ones, then each group that lands) rather
        than by ops issued here."""
        self._layer(module, layer, hidden, top_k_index, top_k_weights, pairs, from_slots)

    def _layer(
        self, module: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        out: torch.Tensor | None = None, from_slots: FromSlots | None = None,
    ) -> PairOutputs:
        """One layer's pair outputs (into ``out`` when given): the routing read, the hits computed at
        once, the misses fetched and computed as they land (``from_slots`` computes those in slots)."""
        routes = LayerRoutes(top_k_index)  # the layer's one read of device data
        needed = routes.needed
        self.last_needed[layer] = needed
        self.counters.layers += 1
        dense_s = self.clock.charge_dense(hidden.shape[0], self.context)
        if self.trace is not None:
            self._record(layer, dense_s, routes)
        self.policy.before_layer(layer, hidden, needed)
        keys = [(layer, e) for e in needed]
        outputs = PairOutputs(hidden, routes, top_k_weights, module.act_fn, out)
        ready, pending, missing = self._classify(keys)
        on_host = self._split_host(pending, missing, routes)
        for transfer in filter(None, map(self.pool.transfer_of, pending)):
            self.link.promote(transfer)
        for key in on_host:  # the host works alongside the device: its deadline runs from now
            self._run_host(outputs, key, routes)
        protect = set(keys)
        queue = deque(missing)
        self._issue(queue, pending, protect)
        if queue and ready:  # no slot for some misses: free as many by computing that many hits first
            first, ready = ready[: len(queue)], ready[len(queue) :]
            self._run(outputs, first, routes, from_slots)
            protect.difference_update(first)
            self._issue(queue, pending, protect)
        self._run(outputs, ready, routes, from_slots)  # the (other) resident hits in one grouped call
        protect.difference_update(ready)
        self._issue(queue, pending, protect)
        while queue or pending:
            if not pending:
                # Every free-able slot is taken by prefetches still in flight: let one land.
                self._land_one(layer, queue[0])
                self._issue(queue, pending, protect)
                continue
            key = pending.popleft()
            self.wait(key)
            landed = [key, *self._take_landed(pending)]  # computed together: one call, not one each
            self._run(outputs, landed, routes, from_slots)
            protect.difference_update(landed)
            self._issue(queue, pending, protect)
        if on_host:
            self._finish_host(on_host)
        return outputs

    def resident_map(self, layer: int) -> tuple[SlotMap, list[int]] | None:
        """Each of ``layer``'s experts' slot when every one is ready in a slot (``SlotMap``: the first slot
        of a consecutive run, else a device tensor; and as a list); None otherwise. Rebuilt only when the
        residency changed."""
        cached = self._maps.get(layer)
        if cached is not None and cached[0] == self.pool.version:
            return cached[1]
        slots = self.pool.layer_slots(layer, self.store.num_experts)
        found = None if slots is None else (slot_map(slots, self.pool.device, self.pool.shape.nbytes), slots)
        self._maps[layer] = (self.pool.version, found)
        return found

    def _all_resident(
        self, module: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        residual: torch.Tensor | None, resident: tuple[SlotMap, list[int]], rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A layer whose every expert is ready in a slot: grouped calls sorted on the device, no read;
        the routing's bookkeeping (counters, trace, policy, the clock's expert time) follows when the
        next read brings it (``timing/dispatch.py: defer_read``)."""
        self.counters.layers += 1
        dense_s = self.clock.charge_dense(hidden.shape[0], self.context)
        out = self.resident_experts(module, hidden, top_k_index, top_k_weights, residual, resident[0], rows)
        self.resident_done(layer, hidden, top_k_index, resident[1], dense_s=dense_s)
        return out

    def resident_experts(
        self, module: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        residual: torch.Tensor | None, slots: SlotMap, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A fully resident layer's experts from their slots (``slots``: ``resident_map``'s ``SlotMap``, or a
        copy of it a CUDA graph holds): a fixed sequence of ops, no read, nothing the host keeps. Experts
        in consecutive slots (all resident, ``initial_slots``' layout) are computed over that run of the
        pool, which needs no map: the expert's id is its slot there. ``rows``: as ``forward``'s."""
        gate_up, down = self.pool.shape.split_rows(self.pool.storage)
        if isinstance(slots, int):
            run = slice(slots, slots + self.store.num_experts)
            return resident_experts(hidden, top_k_index, top_k_weights, gate_up[run], down[run], module.act_fn,
                                    residual, rows=rows)
        return resident_experts(hidden, top_k_index, top_k_weights, gate_up, down, module.act_fn, residual, slots,
                                rows)

    def planned_pairs(self, module: Any, hidden: torch.Tensor, plan: torch.Tensor, out: torch.Tensor) -> None:
        """The pairs a padded ``PairOutputs.plan`` names, from their slots into ``out`` (``(T·k + 1, H)``,
        the last a scratch row): what ``finish_layer``'s ``from_slots`` replays as a graph."""
        gate_up, down = self.pool.shape.split_rows(self.pool.storage)
        planned_pairs(hidden, plan, gate_up, down, module.act_fn, out)

    def resident_done(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, slots: Sequence[int],
        event: Any = None, dense_s: float | None = None,
    ) -> None:
        """What a fully resident layer's experts leave to the host once their kernels are issued: the
        clock's dense time (unless charged already: ``dense_s``), the slots marked read (on CUDA, by
        ``event`` or one recorded now: a later copy into them waits for these kernels), and the
        routing's bookkeeping when the next read brings it (``timing/dispatch.py: defer_read``)."""
        if dense_s is None:
            self.counters.layers += 1
            dense_s = self.clock.charge_dense(hidden.shape[0], self.context)
        if self.on_cuda:
            if event is None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.pool.device))
            self.pool.mark_read(slots, event)
        defer_read(top_k_index, lambda ids: self._settle(layer, ids, dense_s, hidden))

    def _settle(self, layer: int, ids: Any, dense_s: float, hidden: torch.Tensor) -> None:
        """A fully resident layer's bookkeeping, once its routing is on the host."""
        routes = LayerRoutes(ids)
        self.last_needed[layer] = routes.needed
        if self.trace is not None:
            self._record(layer, dense_s, routes)
        self.policy.before_layer(layer, hidden, routes.needed)
        for expert in routes.needed:
            self.counters.hits += 1
            self.pool.touch((layer, expert))
            self.clock.charge_expert(routes.count(expert))

    def start_trace(self) -> Trace:
        """Record from now on what the bound needs (``specter/bound.py``): the residency now, the
        slot groups, each layer's routing."""
        pool = self.pool
        self.trace = Trace(capacity={g: len(s) for g, s in pool.group_slots.items()},
                           group_of={layer: pool.group_of(layer) for layer in self.store.layers},
                           initial=set(pool.resident()))
        return self.trace

    def _record(self, layer: int, dense_s: float, routes: LayerRoutes) -> None:
        assert self.trace is not None
        self.trace.layers.append(LayerUse(layer, dense_s, {e: routes.count(e) for e in routes.needed}))

    def _classify(self, keys: list[Key]) -> tuple[list[Key], deque[Key], list[Key]]:
        """Split needed experts into ready (pinned now), in flight (pinned), and missing."""
        ready: list[Key] = []
        pending: deque[Key] = deque()
        missing: list[Key] = []
        for key in keys:
            if self.pool.is_ready(key):
                self.counters.hits += 1
                ready.append(key)
            elif self.pool.is_loading(key):
                self.counters.inflight += 1
                pending.append(key)
            else:
                self.counters.misses += 1
                missing.append(key)
                continue
            self.pool.pin(key)
            self.pool.touch(key)
        return ready, pending, missing

    # -- host compute of late experts -------------------------------------------------------
    def _split_host(self, pending: deque[Key], missing: list[Key], routes: LayerRoutes) -> list[Key]:
        """Take out of ``pending``/``missing`` the experts the host would finish before they land.

        Walks the late experts in order, keeping two clocks: when the link would land each one
        (behind the transfer moving now and the late ones kept on the link before it) and when the
        host would finish it (behind the ones given to the host before it). An expert goes to the
        host when the host's clock is earlier.
        """
        host = self.host
        if host is None or not self.policy.host_compute or not (pending or missing):
            return []
        now = self.clock.now()
        link_t, host_t = self.link.free_at(now), max(now, host.free_at)
        nbytes = self.store.shape.nbytes
        chosen: list[Key] = []
        for key in [*pending, *missing]:
            transfer = self.pool.transfer_of(key)
            landed = self.link.landing(transfer, now) if transfer is not None else None
            eta = landed if landed is not None else link_t + self.link.estimate_s(nbytes)
            done = host_t + host.expert_s(routes.count(key[1]))
            if done < eta:
                chosen.append(key)
                host_t = done
            elif landed is None:
                link_t = eta
        for key in chosen:
            self._to_host(key, pending, missing)
        return chosen

    def _to_host(self, key: Key, pending: deque[Key], missing: list[Key]) -> None:
        """Drop ``key`` from the link's work for this layer; a queued prefetch of it is cancelled
        unless the policy keeps host-computed experts coming for later."""
        if key in missing:
            missing.remove(key)
            return
        pending.remove(key)
        self.pool.unpin(key)
        if not self.policy.fetch_after_host:
            self.cancel(key)

    def _run_host(self, outputs: PairOutputs, key: Key, routes: LayerRoutes) -> None:
        """One expert computed on the host from its blob: the slot path's math on the same bytes."""
        assert self.host is not None
        gate_up, down = self.store.shape.split(self.store.blob(*key))
        self.host.start(routes.count(key[1]), self.clock.now())
        outputs.from_blob(key[1], gate_up, down)

    def _finish_host(self, on_host: list[Key]) -> None:
        """The layer ends when the host is done too; then, if the policy wants them (always, or
        when the link has nothing else to do), the host-computed experts are fetched for later
        (behind every demand transfer)."""
        assert self.host is not None
        if getattr(self.link, "timed", True):
            if self.on_idle is not None and self.host.free_at > (now := self.clock.now()):
                self.on_idle(self.host.free_at - now)
            self.host.finish()
        if not (self.policy.fetch_after_host or (self.policy.fetches_when_idle() and self._link_idle())):
            return
        self.policy.fetch_later([key for key in on_host if not self.pool.holds(key)])

    def _link_idle(self) -> bool:
        now = self.clock.now()
        return self.link.free_at(now) <= now

    def _landed(self, key: Key, now: float) -> bool:
        """Whether ``key``'s transfer has landed by ``now`` (a virtual link is played to it)."""
        transfer = self.pool.transfer_of(key)
        return transfer is not None and self.link.landing(transfer, now) is not None and transfer.done.is_set()

    def _take_landed(self, pending: deque[Key]) -> list[Key]:
        """Take out of ``pending`` the experts whose transfers have landed by now."""
        now = self.clock.now()
        landed = [key for key in pending if self._landed(key, now)]
        for key in landed:
            pending.remove(key)
            self.wait(key)
        return landed

    def settle_landed(self) -> None:
        """A round starts: prefetches that landed and that no pass waited for are resident now, their
        slots evictable again in the policy's order. (A transfer counts as loading until a pass waits
        for it, and a loading slot is never a victim: within a round that keeps a landed prefetch for
        the layer ahead; across rounds it kept every prefetch the verify pass did not use for good —
        the budget lost a slot for each, and plain steps after drafting missed every expert at
        Mixtral's shapes.)"""
        now = self.clock.now()
        for key in self.pool.loading_keys():
            if not self.pool.is_pinned(key) and self._landed(key, now):
                self.wait(key)

    def _land_one(self, layer: int, waiting: Key) -> None:
        """Wait for the oldest transfer into ``layer``'s slot group, so its slot becomes evictable."""
        group = self.pool.group_of(layer)
        flying = self.pool.loading_keys(group)
        if not flying:
            raise RuntimeError(f"layer {layer}: no expert slot can be freed for expert {waiting}")
        self.wait(flying[0])

    def _issue(self, queue: deque[Key], pending: deque[Key], protect: set[Key]) -> None:
        """Start demand fetches for missing experts while slots can be found."""
        while queue:
            transfer = self.fetch(queue[0], DEMAND, protect)
            if transfer is None:
                return
            key = queue.popleft()
            self.pool.pin(key)
            pending.append(key)

    def _run(self, outputs: PairOutputs, keys: list[Key], routes: LayerRoutes, from_slots: FromSlots | None = None,
             ) -> None:
        """``keys``' pairs from their slots in one grouped call (``from_slots``'s when given); then their
        slots are unpinned."""
        if not keys:
            return
        slot_of = {e: self.pool.where[(layer, e)] for layer, e in keys}
        outputs.from_slots(self.pool.storage, self.pool.shape, slot_of, from_slots)
        for key in keys:
            self.clock.charge_expert(routes.count(key[1]))
        event = None
        if self.on_cuda:  # on the pool's device's stream: the current device may be another one
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.pool.device))
        for key in keys:
            self.pool.unpin(key, event)


def drop_queued(pool: SlotPool, link: Link, key: Key) -> bool:
    """Cancel ``key``'s transfer if it has not started (and its slot is not pinned), freeing the
    slot; False when there is none to cancel or it is too late (the policies' ``Offload.cancel``)."""
    transfer = pool.transfer_of(key)
    if transfer is None or pool.is_pinned(key) or not link.cancel(transfer):
        return False
    pool.finish_loading(key)
    pool.evict(key)
    return True


def initial_slots(pool: SlotPool, layers: list[int], num_experts: int) -> list[tuple[Key, int]]:
    """Claim the initial residency in ``pool``'s empty slots, round-robin over layers (expert 0 of
    every layer, then 1, …: the order they are claimed in, which is their first recency); returns the
    (expert, slot) pairs whose bytes the caller puts there. Each slot group's chosen experts take its
    empty slots in (layer, expert) order, so a layer whose experts all fit sits in consecutive slots
    (``SlotMap``)."""
    room = {group: sum(pool.owner[s] is None for s in slots) for group, slots in pool.group_slots.items()}
    chosen: list[Key] = []
    for key in [(layer, e) for e in range(num_experts) for layer in layers]:
        group = pool.group_of(key[0])
        if not pool.holds(key) and room.get(group, 0) > 0:
            room[group] -= 1
            chosen.append(key)
    slot_of: dict[Key, int] = {}
    for group, slots in pool.group_slots.items():
        free = [s for s in slots if pool.owner[s] is None]
        mine = sorted(k for k in chosen if pool.group_of(k[0]) == group)
        slot_of.update(zip(mine, free[: len(mine)], strict=True))
    for key in chosen:
        pool.claim(key, slot_of[key])
    return [(key, slot_of[key]) for key in chosen]


def slot_map(slots: list[int], device: torch.device, blob_bytes: int) -> SlotMap:
    """``slots`` (each expert's slot) as the resident path takes them: the first slot where they run
    consecutively and the run starts on a 16-byte boundary of the pool (``blob_bytes`` a slot: what a
    GPU's grouped kernel takes), no map needed; else a tensor on ``device``."""
    first = slots[0] if slots else 0
    if slots and slots == list(range(first, first + len(slots))) and first * blob_bytes % 16 == 0:
        return first
    return torch.tensor(slots, device=device)


def default_host(link: Link, shape: ExpertShape, on_cuda: bool, clock: WallClock) -> HostCompute | None:
    """Host compute for a simulated link with no profile: the default profile's host-to-link ratio.

    None on a GPU (the host path would run synchronously on the compute stream; not done yet) and
    over other links (the verifier actor, over a ``RemoteLink``, sets its host itself).
    """
    if on_cuda or not isinstance(link, SimulatedLink):
        return None
    from specter.timing.profiles import simulated_host

    return HostCompute(simulated_host(link.bandwidth, link.latency, shape.nbytes, 2 * shape.numel), shape, clock)
