"""MoE layers run against the slot pool: resident experts at once, missing ones as they land.

transformers calls ``OffloadedExperts.forward`` (through ``ExpertsInterface``) at every MoE layer
with the layer's true routing. Needed experts that are resident are pinned and run first while
the link brings the missing ones; each late expert runs the moment it lands, and its slot may
then be reused by the next one, so a pass that needs more experts than there are slots (prefill,
a long verify window) streams them through. Outputs are summed in ascending expert order, as
transformers' eager loop does, so results do not depend on arrival order.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from specter.experts.link import DEMAND, Link, Transfer
from specter.experts.slots import ChooseVictim, Key, SlotPool
from specter.experts.store import ExpertStore
from specter.plan.base import Policy
from specter.stats import OffloadCounters


class OffloadedExperts:
    """The target's routed experts: host store + device slots + link + policy."""

    def __init__(self, store: ExpertStore, pool: SlotPool, link: Link, policy: Policy, timeout: float = 60.0):
        self.store = store
        self.pool = pool
        self.link = link
        self.policy = policy
        self.timeout = timeout
        self.counters = OffloadCounters()
        self.last_routing: dict[int, torch.Tensor] = {}  # layer → top-k ids of the latest pass
        self.on_cuda = pool.storage.is_cuda
        policy.bind(self)

    # -- moving experts -------------------------------------------------------------------
    def fetch(
        self, key: Key, priority: int, protect: set[Key], choose: ChooseVictim | None = None
    ) -> Transfer | None:
        """Start moving ``key`` into a slot; None when no slot can be freed right now."""
        slot = self.pool.reserve(key, protect, choose or self.policy.choose_victim)
        if slot is None:
            return None
        src = self.store.blob(*key)
        wait_for = self.pool.last_use[slot] if self.on_cuda else None
        transfer = self.link.submit(key, slot, src, self.pool.storage[slot], priority, wait_for)
        self.pool.start_loading(key, slot, transfer)
        return transfer

    def cancel(self, key: Key) -> bool:
        """Drop a queued (not started) transfer of ``key`` and free its slot."""
        transfer = self.pool.loading.get(key)
        if transfer is None or self.pool.pins[self.pool.where[key]] or not self.link.cancel(transfer):
            return False
        self.pool.finish_loading(key)
        self.pool.evict(key)
        return True

    def wait(self, key: Key) -> None:
        """Block until ``key``'s transfer has landed; the time counts as waiting."""
        transfer = self.pool.loading.get(key)
        if transfer is None:
            return
        self.link.promote(transfer)
        self.counters.wait_s += transfer.wait(self.timeout)
        self.pool.finish_loading(key)

    def reset_residency(self) -> None:
        """Empty every slot and refill the initial residency (same start for every run)."""
        for key in list(self.pool.loading):
            self.wait(key)
        for key in list(self.pool.where):
            self.pool.evict(key)
        self.prefill_slots()

    def prefill_slots(self) -> None:
        """Fill empty slots round-robin over layers (expert 0 of every layer, then 1, …), untimed."""
        for key, slot in self.claim_initial_slots():
            self.pool.storage[slot].copy_(self.store.blob(*key))

    def claim_initial_slots(self) -> list[tuple[Key, int]]:
        """Record the initial residency in the map; returns the (expert, slot) pairs to fill."""
        order = [(lay, e) for e in range(self.store.num_experts) for lay in self.store.layers]
        claimed: list[tuple[Key, int]] = []
        for key in order:
            if key in self.pool.where:
                continue
            slots = self.pool.group_slots[self.pool.group_of(key[0])]
            free = next((s for s in slots if self.pool.owner[s] is None), None)
            if free is not None:
                self.pool.claim(key, free)
                claimed.append((key, free))
        return claimed

    # -- one MoE layer --------------------------------------------------------------------
    def forward(
        self, module: torch.nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Same result as transformers' eager experts loop, with experts taken from slots."""
        needed = sorted(set(top_k_index.flatten().tolist()))
        self.last_routing[layer] = top_k_index
        self.counters.layers += 1
        self.policy.before_layer(layer, hidden, needed)
        keys = [(layer, e) for e in needed]
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        ready, pending, missing = self._classify(keys)
        protect = set(keys)
        queue = deque(missing)
        self._issue(queue, pending, protect)
        for key in ready:
            outputs[key[1]] = self._run(module, key, hidden, top_k_index, top_k_weights)
            protect.discard(key)
            self._issue(queue, pending, protect)
        while queue or pending:
            if not pending:
                # Every free-able slot is taken by prefetches still in flight: let one land.
                self._land_one(layer, queue[0])
                self._issue(queue, pending, protect)
                continue
            key = pending.popleft()
            self.wait(key)
            outputs[key[1]] = self._run(module, key, hidden, top_k_index, top_k_weights)
            protect.discard(key)
            self._issue(queue, pending, protect)
        final = torch.zeros_like(hidden)
        for e in needed:
            final.index_add_(0, *outputs[e])
        return final

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
                self.link.promote(self.pool.loading[key])
                pending.append(key)
            else:
                self.counters.misses += 1
                missing.append(key)
                continue
            self.pool.pin(key)
            self.pool.touch(key)
        return ready, pending, missing

    def _land_one(self, layer: int, waiting: Key) -> None:
        """Wait for the oldest transfer into ``layer``'s slot group, so its slot becomes evictable."""
        group = self.pool.group_of(layer)
        flying = [k for k in self.pool.loading if self.pool.group_of(k[0]) == group]
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

    def _run(
        self, module: Any, key: Key, hidden: torch.Tensor, top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert on its tokens, exactly as the eager loop computes it; then unpin its slot."""
        expert = key[1]
        top_k_pos, token_idx = torch.where((top_k_index == expert).T)
        gate_up, down = self.pool.view(key)
        gate, up = F.linear(hidden[token_idx], gate_up).chunk(2, dim=-1)
        out = F.linear(module.act_fn(gate) * up, down)
        out = (out * top_k_weights[token_idx, top_k_pos, None]).to(hidden.dtype)
        event = None
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
        self.pool.unpin(key, event)
        return token_idx, out
