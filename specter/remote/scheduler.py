"""The schedule where the copies are: the transfer actor's residency map, policy and link.

``TransferExperts`` is what a policy sees of the offloaded experts (``specter.plan.base.Offload``)
inside the transfer actor: the host store, a slot pool over the shared slots, the copy thread's
link, the wall clock and a model of the host. The same ``Policy`` classes run on it as in
process; what the in-process executor tells a policy itself reaches it here as messages:

* from the draft, its ``PlanDelta``s as each draft step ends (by its wire round id: a round's plans
  that come before its ``RoundStart`` — drafted ahead, while the verify pass ran — are held and
  handed over together when it starts; plans of a round that has passed are dropped, counted in
  ``plans_dropped``);
* from the verifier, the round (``RequestStart``, ``RoundStart``, ``VerifyStart``, ``RoundEnd``) and
  the pass's progress: ``LayerNeeds`` as each MoE layer's routing is known — which experts it
  computes from slots, which on the host, which it waits for. Those it waits for are fetched at
  demand priority, ahead of every prefetch (or promoted, when already queued), before the policy
  sees the layer (in process the policy goes first; here that would put its schedule between the
  verifier's miss and the copy); a demand that finds no free-able slot waits until a transfer into
  its group lands (``retry``). An expert the pass read or waited for is resident once it has landed
  (``_reap``: in process the executor's wait on an expert in flight does that), so its slot is the
  policy's to give up again once the pass is past its layer.

Which slot each expert got goes to the shared index (``specter/remote/residency.py``); whether its
bytes are in is the seq table's word, as before. A slot the verifier pins in the seq table is never
chosen to give up its expert, and neither is any expert of the layer the pass is at.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from specter.experts.executor import drop_queued, initial_slots
from specter.experts.host import HostCompute
from specter.experts.link import DEMAND, Link, Transfer
from specter.experts.slots import ChooseVictim, Key, SlotPool
from specter.experts.store import ExpertStore
from specter.plan.base import Policy
from specter.protocol import FetchLater, LayerNeeds, PlanDelta, RoundEnd, RoundStart, VerifyStart
from specter.remote.residency import SharedIndex
from specter.remote.shm import SharedSlots
from specter.timing.clock import WallClock

if TYPE_CHECKING:
    from specter.remote.cuda_link import CudaSlotWriterLink
    from specter.remote.transfer_server import SlotWriterLink

_EARLY_ROUNDS = 4  # rounds ahead whose plans are held (a pipelined draft is one round ahead; a
# request's first round is two wire ids past the last one of the request before)
_HELD = 1 << 12  # plan deltas held per round (one per draft step)


class SharedPool(SlotPool):
    """A slot pool over the shared slots that publishes each expert's slot in the shared index and
    never evicts an expert the verifier still reads: pinned in the seq table, or of the layer the
    pass is at (``running``, visit ``visit``) and not yet marked done there."""

    def __init__(self, store: ExpertStore, groups: dict[int, int], slots: SharedSlots, index: SharedIndex):
        super().__init__(store.shape, groups, storage=slots.storage)
        self.slots, self.index = slots, index
        self.running: frozenset[Key] = frozenset()  # the experts of the layer the pass is at
        self.visit = -1

    def in_use(self, key: Key) -> bool:
        """The verifier reads, or will read, ``key``'s slot in the running layer."""
        if self.slots.pinned(self.where[key]):
            return True
        return key in self.running and not self.index.done(key, self.visit)

    def is_pinned(self, key: Key) -> bool:
        return key in self.where and self.in_use(key)

    def unpinned_per_group(self) -> dict[int, int]:
        return {g: sum(1 for s in slots if (k := self.owner[s]) is None or not self.in_use(k))
                for g, slots in self.group_slots.items()}

    def evictable(self, layer: int, protect: Iterable[Key] = ()) -> list[Key]:
        return [k for k in super().evictable(layer, protect) if not self.in_use(k)]

    def evict(self, key: Key) -> int:
        self.index.clear(key)
        return super().evict(key)

    def start_loading(self, key: Key, slot: int, transfer: Transfer) -> None:
        super().start_loading(key, slot, transfer)
        self.index.set(key, slot)

    def claim(self, key: Key, slot: int) -> None:
        super().claim(key, slot)
        self.index.set(key, slot)

    def clear(self) -> None:
        """Forget every expert (the slots' bytes stay until overwritten)."""
        for key in list(self.where):
            self.evict(key)
        self.loading.clear()
        self.index.clear_all()


class TransferExperts:
    """The policy's view of the experts in the transfer actor, and the messages that drive it.

    Args:
        store: the host blobs.
        slots: the shared slots (created by this process).
        index: the shared index (created by this process).
        link: the copy thread's link.
        groups: slots per group, as the verifier sizes them.
        policy: the policy (bound here).
        host: the host's rate as the verifier computes late experts (a policy weighs it), or None.
    """

    def __init__(
        self, store: ExpertStore, slots: SharedSlots, index: SharedIndex, link: SlotWriterLink | CudaSlotWriterLink,
        groups: dict[int, int], policy: Policy, host: HostCompute | None,
    ):
        self.store, self.policy = store, policy
        self.writer = link
        self.link: Link = link
        self.clock = WallClock()
        self.host = host
        self.shared = SharedPool(store, groups, slots, index)
        self.pool: SlotPool = self.shared
        self.blocked: deque[Key] = deque()  # demands that found no free-able slot yet
        self.awaited: list[Key] = []  # experts the verifier waits for (their slots free up once landed)
        self.wire = -1  # the running round's wire id
        self.offset = 0  # its wire id minus its engine id
        self.early: dict[int, list[PlanDelta]] = {}  # plans of rounds not started yet, by wire id
        self.plans_dropped = 0  # plan deltas of rounds that had passed (thrown away, or stale)
        policy.bind(self)

    # -- Offload: what the policy calls --------------------------------------------------------
    def fetch(self, key: Key, priority: int, protect: set[Key], choose: ChooseVictim | None = None) -> Transfer | None:
        """Start moving ``key`` into a slot; None when no slot can be freed right now."""
        slot = self.pool.reserve(key, protect, choose or self.policy.choose_victim)
        if slot is None:
            return None
        transfer = self.link.submit(key, slot, self.store.blob(*key), self.pool.slot_tensor(slot), priority)
        self.pool.start_loading(key, slot, transfer)
        return transfer

    def cancel(self, key: Key) -> bool:
        """Drop a queued (not started) transfer of ``key`` and free its slot."""
        return drop_queued(self.pool, self.link, key)

    # -- residency ------------------------------------------------------------------------------
    def fill(self) -> list[tuple[Key, int]]:
        """The initial residency (as in process: expert 0 of every layer, then 1, …), copied untimed;
        returns the placements."""
        placements = initial_slots(self.pool, self.store.layers, self.store.num_experts)
        for key, slot in placements:
            self.writer.submit_untimed(key, slot, self.store.blob(*key), self.pool.slot_tensor(slot), DEMAND)
        return placements

    def reset(self, timeout: float, refill: bool = True) -> list[tuple[Key, int]]:
        """Let every transfer land, forget the residency, fill the initial one again (``refill``)."""
        for transfer in list(self.pool.loading.values()):
            if not transfer.cancelled:
                transfer.wait(timeout)
        self.shared.clear()
        self.blocked.clear()
        self.awaited.clear()
        self.early.clear()
        self.shared.running = frozenset()
        return self.fill() if refill else []

    def retry(self) -> None:
        """Place blocked demands: the oldest transfer of their group, once landed, frees its slot."""
        while self.blocked:
            key = self.blocked[0]
            if self.pool.holds(key):
                self.blocked.popleft()
                continue
            if self.fetch(key, DEMAND, set()) is None:
                # as the in-process executor: the oldest transfer into the group lands, and its slot
                # can be given up (once the verifier is done with it)
                flying = self.pool.loading_keys(self.pool.group_of(key[0]))
                if not flying or not self.pool.loading[flying[0]].done.is_set():
                    return
                self.pool.finish_loading(flying[0])
                continue
            self.blocked.popleft()

    # -- messages -------------------------------------------------------------------------------
    def on_plan(self, delta: PlanDelta) -> None:
        if delta.round == self.wire:
            self.policy.on_plan(self._local(delta))
        elif self.wire < delta.round <= self.wire + _EARLY_ROUNDS and len(self.early.get(delta.round, ())) < _HELD:
            self.early.setdefault(delta.round, []).append(delta)
        else:
            self.plans_dropped += 1

    def begin_round(self, msg: RoundStart) -> None:
        self._reap(every=True)
        self.wire, self.offset = msg.wire, msg.wire - msg.round
        self.policy.window = msg.k
        self.policy.round_drafts = msg.drafts or None  # a batched round: every drafting request's deltas
        self.policy.begin_round(msg.round)
        for wire in [w for w in self.early if w < msg.wire]:
            self.plans_dropped += len(self.early.pop(wire))
        held = self.early.pop(msg.wire, None)
        if held:
            self.policy.on_plans([self._local(d) for d in held])

    def begin_verify(self, msg: VerifyStart) -> None:
        self.policy.begin_verify(msg.round, msg.positions)

    def layer(self, msg: LayerNeeds) -> None:
        """The pass is at ``msg.layer``: its demands go out first (the copy thread starts on them at
        once), then the policy sees the layer's routing and schedules again around them."""
        pool = self.pool
        self._reap()
        layer = msg.layer
        self.shared.visit = msg.visit
        self.shared.running = frozenset((layer, e) for e in (*msg.wait, *msg.ready))
        for e in msg.ready:  # read from its slot: a prefetch that landed is resident now (in process
            key = (layer, e)  # the executor's wait on an expert in flight makes it so)
            if pool.holds(key):
                pool.touch(key)
            if pool.is_loading(key):
                self.awaited.append(key)
        if not self.policy.fetch_after_host:
            for e in msg.host:
                self.cancel((layer, e))
        for e in msg.wait:
            key = (layer, e)
            if pool.holds(key):
                pool.touch(key)
            transfer = pool.transfer_of(key)
            if transfer is not None:
                self.link.promote(transfer)
            elif not pool.holds(key) and key not in self.blocked:
                self.blocked.append(key)
            self.awaited.append(key)
        self._reap()  # those landed already (the rest once landed, at a later layer or the round's end)
        self.retry()
        needed = sorted({*msg.wait, *msg.ready, *msg.host})
        self.policy.before_layer(layer, None, needed)  # type: ignore[arg-type]  # no policy here reads it
        self.retry()  # the policy may have dropped prefetches a blocked demand can use

    def _reap(self, every: bool = False) -> None:
        """Experts the verifier read or waited for, once landed, are resident (evictable again unless
        the verifier reads them: ``SharedPool.in_use``); ``every``: as a round starts, every landed one
        — a prefetch the verify pass did not use kept its slot for good otherwise (in process:
        ``OffloadedExperts.settle_landed``)."""
        pool = self.pool
        for key in pool.loading_keys() if every else self.awaited:
            transfer = pool.transfer_of(key)
            if transfer is not None and transfer.done.is_set():
                pool.finish_loading(key)
        self.awaited = [k for k in self.awaited if pool.is_loading(k)]

    def end_round(self, msg: RoundEnd) -> None:
        self._reap()  # the last layers' experts, before the next round's plans are scheduled
        true = {layer: set(experts) for layer, experts in zip(msg.layers, msg.experts, strict=True)}
        self.policy.end_round(msg.round, msg.accepted, true)

    def fetch_later(self, msg: FetchLater) -> None:
        self.policy.fetch_later([(msg.layer, e) for e in msg.experts if not self.pool.holds((msg.layer, e))])

    def _local(self, delta: PlanDelta) -> PlanDelta:
        return msgspec.structs.replace(delta, round=delta.round - self.offset)
