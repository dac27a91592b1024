"""The verifier's side of offloaded experts when the host blobs live in the transfer actor.

``RemoteExperts`` is ``OffloadedExperts`` whose initial residency is filled by the transfer actor
(untimed copies through the ``RemoteLink``) instead of local copies. Its store is the transfer
actor's, mapped read-only (``specter/remote/shared_store.py``) and read only by host compute.
Everything else (policies, residency map, the MoE forward) is the in-process code, unchanged.

``ScheduledExperts`` is the other way: the residency map and the policy live in the transfer actor
(``specter/remote/scheduler.py``) and this side reads where each expert is.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import torch

from specter.experts.executor import OffloadedExperts, initial_slots
from specter.experts.grouped import FromSlots, LayerRoutes, PairOutputs
from specter.experts.link import LinkError
from specter.experts.slots import Key, SlotPool
from specter.experts.store import ExpertStore
from specter.plan.base import Policy
from specter.protocol import LayerNeeds, ResetSlots, UsePolicy
from specter.remote.link import WALL, RemoteLink, SeqEvent, nap
from specter.remote.residency import SharedIndex


class RemoteExperts(OffloadedExperts):
    """``OffloadedExperts`` over a ``RemoteLink``."""

    def prefill_slots(self) -> None:
        """Same order as the in-process fill (expert 0 of every layer, then 1, …), done remotely."""
        link = self.link
        assert isinstance(link, RemoteLink)
        placements = self.claim_initial_slots()
        link.place(placements, self.timeout)


class ScheduledExperts(OffloadedExperts):
    """``OffloadedExperts`` whose schedule runs in the transfer actor (``specter/remote/scheduler.py``).

    Its residency is read, not kept: where an expert is from the shared index, whether it is there
    from the seq table; a slot is pinned in the seq table while its expert is computed. At each MoE
    layer the pass says in one ``LayerNeeds`` what it computes from slots, what on the host (decided
    here as in process, from when the link and the host would finish), and what it waits for; the
    transfer actor moves those at demand priority. The host computation, the sums in expert order
    and the counters are the in-process executor's.

    Args:
        store, pool, link, policy, timeout: as ``OffloadedExperts`` (``pool`` is only the slots'
            memory and groups here; ``policy`` a ``RemotePolicy``).
        index: the transfer actor's shared index, attached.
        spec: the policy as the transfer actor builds it (``make_policy``'s name, options included).
        host_profile: the profile whose host computes late experts (None: the default).
    """

    def __init__(self, store: ExpertStore, pool: SlotPool, link: RemoteLink, policy: Policy, index: SharedIndex,
                 spec: str, host_profile: str | None = None, timeout: float = 60.0):
        super().__init__(store, pool, link, policy, timeout)
        self.remote, self.index = link, index
        self.slots = link.slots
        self.spec, self.host_profile = spec, host_profile
        # MoE layers run so far (``LayerNeeds.visit``), counted on from the last visit of the schedule
        # before this one (a new policy on the same index: the done table still holds its visits)
        self.visit = max(0, index.last_visit())
        # (slot, seq) of each expert's copy this side has computed with (or the initial fill's): the
        # first use of a fresh copy counts as in flight, later ones as hits, as in process
        self._used: dict[Key, tuple[int, int]] = {}

    # -- residency: the transfer actor's ------------------------------------------------------
    def prefill_slots(self) -> None:
        """Start the transfer actor's schedule (``UsePolicy``: it fills the initial slots itself)."""
        before = self.mark()
        self.remote.channel.send(UsePolicy(self.spec, self.host_profile or ""))
        self.wait_filled(before)

    def reset_residency(self) -> None:
        before = self.mark()
        self.remote.channel.send(ResetSlots())
        self.wait_filled(before)

    def mark(self) -> list[int]:
        """Every slot's sequence number now (``wait_filled`` waits for the fill after it)."""
        return [self.slots.read(slot)[1] for slot in range(self.slots.num_slots)]

    def wait_filled(self, before: list[int]) -> None:
        """Wait until the initial residency is published, each expert after ``before``."""
        fresh = SlotPool(self.store.shape, {g: len(s) for g, s in self.pool.group_slots.items()}, storage=self.pool.storage)
        self._used.clear()
        for key, slot in initial_slots(fresh, self.store.layers, self.store.num_experts):
            if not SeqEvent(self.slots, slot, key, before[slot], self.remote.counters).wait(self.timeout):
                _late(key, self.timeout)
            self._used[key] = (slot, self.slots.read(slot)[1])

    def resident_map(self, layer: int) -> None:
        """Never: a slot's expert is known only from the seq table, read per layer (a whole captured
        step, ``models/graphed.py``, would compute from slots the transfer actor may be rewriting)."""
        return None

    # -- one MoE layer (``OffloadedExperts.forward`` and ``finish_layer`` call it; never all resident here) --
    def _layer(
        self, module: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        out: torch.Tensor | None = None, from_slots: FromSlots | None = None,
    ) -> PairOutputs:
        """One layer's pair outputs (``OffloadedExperts._layer``'s, and ``finish_layer``'s for a graphed
        step): each expert from its slot once pinned there (by ``from_slots`` when given), or on the host."""
        routes = LayerRoutes(top_k_index)  # the layer's one read of device data
        needed = routes.needed
        self.last_needed[layer] = needed
        self.counters.layers += 1
        self.clock.charge_dense(hidden.shape[0], self.context)
        ready: dict[int, int] = {}  # expert → its slot, pinned
        late: list[int] = []
        for e in needed:
            landed = self._pin_if_landed((layer, e))
            if landed is not None:
                slot = landed[0]
                if self._used.get((layer, e)) == landed:
                    self.counters.hits += 1
                else:  # prefetched, first use
                    self.counters.inflight += 1
                    self._used[(layer, e)] = landed
                ready[e] = slot
            else:
                late.append(e)
                if self.index.slot((layer, e)) is None:
                    self.counters.misses += 1
                else:
                    self.counters.inflight += 1
        on_host = self._host_share(layer, late, routes)
        wait = [e for e in late if e not in on_host]
        self.visit += 1
        self.remote.channel.send(LayerNeeds(layer, self.visit, wait, list(ready), on_host))
        outputs = PairOutputs(hidden, routes, top_k_weights, module.act_fn, out)
        try:
            for e in on_host:
                self._run_host(outputs, (layer, e), routes)
        except BaseException:  # a failure must not leave a slot pinned: the copy thread would wait on it forever
            for slot in ready.values():
                self.slots.release(slot)
            raise
        self._run_slots(outputs, layer, ready, routes, from_slots)  # releases them whatever happens
        left = [(layer, e) for e in wait]
        while left:  # each runs the moment it lands (the transfer actor may need a done slot for the next)
            key, slot = self._await(left)
            left.remove(key)
            self._run_slots(outputs, layer, {key[1]: slot}, routes, from_slots)
        if on_host:
            self._finish_host([(layer, e) for e in on_host])
        return outputs

    def _pin_if_landed(self, key: Key) -> tuple[int, int] | None:
        """(slot, seq) of the copy of ``key``, its slot pinned, if it has landed; else None."""
        slot = self.index.slot(key)
        if slot is None:
            return None
        got, seq = self.slots.read(slot)
        if got != key or self.slots.due(slot) > time.perf_counter() or not self.slots.try_pin(slot, seq):
            return None
        self.slots.wait_copy(slot)
        return slot, seq

    def _landing(self, key: Key) -> float | None:
        """When ``key`` lands if it is published or being copied now; None while only queued."""
        slot = self.index.slot(key)
        if slot is None:
            return None
        got, seq = self.slots.read(slot)
        if got == key:
            return self.slots.due(slot)
        return self.remote.counters.due() if seq % 2 else None

    def _host_share(self, layer: int, late: list[int], routes: LayerRoutes) -> list[int]:
        """The late experts the host would finish before they land (``OffloadedExperts._split_host``'s
        walk: the link's clock behind the transfer moving now, the host's behind what it was given)."""
        host = self.host
        if host is None or not self.policy.host_compute or not late:
            return []
        now = self.clock.now()
        link_t, host_t = self.link.free_at(now), max(now, host.free_at)
        transfer_s = self.link.estimate_s(self.store.shape.nbytes)
        chosen: list[int] = []
        for e in late:
            landed = self._landing((layer, e))
            eta = max(now, landed) if landed is not None else link_t + transfer_s
            done = host_t + host.expert_s(routes.count(e))
            if done < eta:
                chosen.append(e)
                host_t = done
            elif landed is None:
                link_t = eta
        return chosen

    def _await(self, keys: list[Key]) -> tuple[Key, int]:
        """Wait until one of ``keys`` has landed in the slot the transfer actor gave it; returns it
        and its slot, pinned. The time counts as waiting."""
        t0 = time.perf_counter()
        end = t0 + self.timeout
        idle = 0.0  # how long nothing has been due
        while True:
            now = time.perf_counter()
            soonest = end  # the earliest due time of a published one that has not landed yet
            for key in keys:
                slot = self.index.slot(key)
                if slot is None:
                    continue
                got, seq = self.slots.read(slot)
                if got != key:
                    continue
                due = self.slots.due(slot)
                if due > now:
                    soonest = min(soonest, due)
                elif self.slots.try_pin(slot, seq):  # else claimed for another expert meanwhile
                    self.slots.wait_copy(slot)
                    self.counters.wait_s += time.perf_counter() - t0
                    self._used[key] = (slot, seq)
                    return key, slot
            if soonest < end:
                WALL.wait_until(soonest)  # one copy thread: nothing lands before it
                continue
            if now >= end:
                _late(keys[0], self.timeout, self._where(keys[0]))
            idle = nap(self.remote.counters, end, idle)

    def _where(self, key: Key) -> str:
        """Where the shared index and the seq table say ``key`` is (for the error of a wait that timed out)."""
        slot = self.index.slot(key)
        if slot is None:
            return "the transfer actor has placed it in no slot"
        got, seq = self.slots.read(slot)
        return f"the index puts it in slot {slot}, which holds {got} (seq {seq}, due {self.slots.due(slot):.3f})"

    def _run_slots(self, outputs: PairOutputs, layer: int, slot_of: dict[int, int], routes: LayerRoutes,
                   from_slots: FromSlots | None = None) -> None:
        """The experts in ``slot_of`` (pinned) from their slots in one grouped call (``from_slots``'s when
        given); then they are marked done in this visit and their slots unpinned (the transfer actor
        may reuse them: on CUDA after the slots' reader events, recorded behind that call)."""
        if not slot_of:
            return
        try:
            outputs.from_slots(self.slots.storage, self.store.shape, slot_of, from_slots)
            for e in slot_of:
                self.index.mark_done((layer, e), self.visit)
        finally:
            for slot in slot_of.values():
                self.slots.release(slot)
        for e in slot_of:
            self.clock.charge_expert(routes.count(e))


def _late(key: Key, timeout: float, where: str = "") -> NoReturn:
    raise LinkError(f"expert {key} did not land in a slot within {timeout:.1f}s (is the transfer actor alive?)"
                    + (f"; {where}" if where else ""))
