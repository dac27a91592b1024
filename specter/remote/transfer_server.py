"""The transfer side of the remote link: copy commands in, blobs into shared slots, seq table out.

``SlotWriterLink`` is a ``SimulatedLink`` (same time model: ``latency + bytes / bandwidth`` per
transfer, one at a time, demand before prefetch, queued ones cancellable) whose copies land in
:class:`~specter.remote.shm.SharedSlots`: each transfer claims its slot in the seq table, copies,
counts itself in :class:`SharedCounters`, publishes the key with the time it lands (the link
model's), and sleeps to that time before the next copy; the reader waits to it itself.
``CudaSlotWriterLink`` (``cuda_link.py``) is the same on a GPU: pinned host blobs into the device slots
on a copy stream, ordered against the verifier's kernels by the slots' interprocess events.
``TransferServer`` reads ``FetchExpert``/``PromoteFetch``/``DropFetch``/``LinkTiming`` from a
channel and drives it; with ``UsePolicy`` it runs the schedule itself (``specter/remote/scheduler.py``):
the draft's plans and the verifier's round and layer messages reach the policy there. A command that names no real expert, slot or transfer, or a message meant
for another actor, is refused before it indexes anything, counted in ``rejections`` by reason and
logged at most once per second per reason; nothing a peer sends stops the loop but ``Shutdown``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from specter.config import LinkConfig
from specter.experts.host import HostCompute
from specter.experts.link import SimulatedLink, Transfer
from specter.experts.store import ExpertStore
from specter.plan import make_policy
from specter.protocol import (
    DropFetch,
    FetchExpert,
    FetchLater,
    Hello,
    LayerNeeds,
    LinkTiming,
    PlanDelta,
    PromoteFetch,
    ProtocolError,
    Replay,
    RequestStart,
    ResetSlots,
    RoundEnd,
    RoundStart,
    Shutdown,
    UsePolicy,
    VerifyStart,
    check_version,
)
from specter.remote.channel import Channel, DropLog
from specter.remote.counters import SharedCounters
from specter.remote.cuda_link import CopyStream, CudaSlotWriterLink
from specter.remote.residency import SharedIndex
from specter.remote.scheduler import TransferExperts
from specter.remote.shm import SharedSlots
from specter.timing.profiles import simulated_host

log = logging.getLogger(__name__)

OUT_OF_RANGE, UNKNOWN_ID, DUPLICATE_ID, UNEXPECTED = "out_of_range", "unknown_id", "duplicate_id", "unexpected"
NO_POLICY, FAILED = "no_policy", "failed"
BLOCKED_POLL_S = 1e-4  # a demand waits for a slot: look again this soon
_PRUNE_AT = 4096


class SlotWriterLink(SimulatedLink):
    """A simulated link that writes shared slots and publishes them in their seq table.

    Args:
        slots: the shared slots (created by this process).
        counters: where to count finished timed transfers (before each publish).
        bandwidth: bytes per second.
        latency: seconds added to every transfer.
    """

    name = "slotlink"

    def __init__(self, slots: SharedSlots, counters: SharedCounters, bandwidth: float, latency: float = 0.0):
        self.slots, self.counters = slots, counters
        self.untimed: weakref.WeakSet[Transfer] = weakref.WeakSet()
        super().__init__(bandwidth, latency)

    def submit_untimed(self, key: tuple[int, int], slot: int, src, dst, priority: int) -> Transfer:  # type: ignore[no-untyped-def]
        """``submit`` a copy that skips the link model (the initial residency fill)."""
        with self._cond:  # an RLock: the copy thread cannot pick it up before it is marked
            transfer = self.submit(key, slot, src, dst, priority)
            self.untimed.add(transfer)
        return transfer

    def _move(self, transfer: Transfer) -> None:
        t0 = time.perf_counter()
        untimed = transfer in self.untimed or not self.timed
        begin, due = (t0, t0) if untimed else self._schedule(transfer)
        transfer.due = due
        # due before the slot turns odd: a reader that sees the copy started also sees when it lands
        self.counters.moving(due)
        self.slots.claim(transfer.slot, transfer.key, self.closing)  # waits while the verifier pins it
        published = None
        try:
            transfer.dst.copy_(transfer.src)
            if untimed:
                self._due = max(self._due, time.perf_counter())  # the next timed copy starts after it
                due = transfer.due = time.perf_counter()
            if transfer not in self.untimed:  # the initial fill is not the link's work
                self.counters.add(transfer.nbytes, max(due, time.perf_counter()) - begin)
            published = transfer.key
        finally:
            # Published as soon as the bytes are in, with when they land: the reader waits to
            # that time itself, and this thread sleeps to it (``_land``) before the next copy.
            self.slots.publish(transfer.slot, published, due=due if published is not None else 0.0)


class TransferServer:
    """Serves copy commands from the verifier, or runs the schedule itself (``UsePolicy``).

    Args:
        store: the host blobs.
        slots: the shared slots this process created.
        counters: the shared counters this process created.
        link: ``sim:…`` (``SlotWriterLink``: the link model) or ``cuda`` (``CudaSlotWriterLink``: the
            slots are on the device, the store's memory pinned).
        channel: a pull channel from the verifier (and from the draft, for its plans).
        index: the shared index this process created (where the schedule says each expert is).
        groups: slots per group, as the verifier sizes them (the schedule's slot pool).
        timeout_s: how long a reset waits for a transfer in flight.

    Attributes:
        rejections: refused commands per reason: ``out_of_range`` (no such layer, expert or slot),
            ``unknown_id`` (promote/drop of a transfer never fetched), ``duplicate_id`` (a fetch
            reusing the id of a pending transfer), ``unexpected`` (a message for another actor),
            ``no_policy`` (a schedule message before any ``UsePolicy``, or a ``UsePolicy`` this side
            cannot run), ``failed`` (the schedule raised on a message: logged with its traceback,
            the loop goes on).
        schedule: the running schedule (None until a ``UsePolicy``).
        plans_ignored: plan deltas that came while no schedule ran here (the verifier schedules).
        peers: the roles whose ``Hello`` arrived after the first (the draft's, for its plans).
    """

    def __init__(
        self, store: ExpertStore, slots: SharedSlots, counters: SharedCounters, link: LinkConfig,
        channel: Channel, index: SharedIndex | None = None, groups: dict[int, int] | None = None,
        timeout_s: float = 60.0, copies: CopyStream | None = None,
    ):
        if link.kind == "cuda" and not (slots.storage.is_cuda or copies is not None):
            raise ValueError(f"link: cuda needs the shared slots on a CUDA device, they are on {slots.storage.device}")
        self.store, self.slots, self.channel, self.index = store, slots, channel, index
        self.link_config, self.groups, self.timeout_s = link, groups, timeout_s
        self.link: SlotWriterLink | CudaSlotWriterLink
        if link.kind == "cuda":
            self.link = CudaSlotWriterLink(slots, counters, copies)
        else:
            self.link = SlotWriterLink(slots, counters, link.bandwidth, link.latency)
        self.transfers: dict[int, Transfer] = {}
        self.schedule: TransferExperts | None = None
        self.plans_ignored = 0  # plan deltas from the draft while the verifier schedules
        self.peers: list[str] = []
        self._layers = frozenset(store.layers)
        self._refuse = DropLog("transfer", (OUT_OF_RANGE, UNKNOWN_ID, DUPLICATE_ID, UNEXPECTED, NO_POLICY, FAILED))
        self.rejections: dict[str, int] = self._refuse.counts

    @property
    def rejected(self) -> int:
        """Commands refused so far, all reasons."""
        return self._refuse.total

    def handle(self, msg: object) -> bool:
        """Act on one message; False when it says to stop."""
        if isinstance(msg, FetchExpert):
            self._fetch(msg)
        elif isinstance(msg, PromoteFetch | DropFetch):
            self._promote_or_drop(msg)
        elif isinstance(msg, LinkTiming):
            self.link.timed = msg.timed
        elif isinstance(msg, Shutdown):
            return False
        elif isinstance(msg, UsePolicy):
            self._use_policy(msg)
        elif isinstance(msg, Hello):
            self._hello(msg)
        elif isinstance(msg, ResetSlots | RequestStart | RoundStart | VerifyStart | LayerNeeds | RoundEnd
                        | FetchLater | Replay | PlanDelta):
            self._schedule(msg)
        else:
            self._refuse(UNEXPECTED, f"a {type(msg).__name__} message is not for the transfer actor")
        return True

    def serve(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Handle messages until ``stop`` is set or a ``Shutdown`` arrives; a blocked demand is
        looked at again every ``BLOCKED_POLL_S`` meanwhile."""
        while not stop.is_set():
            blocked = self.schedule is not None and self.schedule.blocked
            msg = self.channel.recv(BLOCKED_POLL_S if blocked else poll_s)
            if msg is not None and not self.handle(msg):
                return
            if blocked and self.schedule is not None:
                self.schedule.retry()

    def _hello(self, msg: Hello) -> None:
        """A second peer on the pull socket (the draft, whose plans come here): check its version."""
        try:
            check_version(msg)
        except ProtocolError as exc:
            self._refuse(UNEXPECTED, str(exc))
            return
        self.peers.append(msg.role)

    def _use_policy(self, msg: UsePolicy) -> None:
        """A fresh schedule for ``msg.name``: its residency map, the initial slots filled untimed
        (no name: no schedule here any more, once the copies in flight have landed)."""
        if not msg.name:  # the verifier schedules again: it sends copy commands
            if self.schedule is not None:
                self.schedule.reset(self.timeout_s, refill=False)
            self.schedule = None
            return
        if self.index is None or self.groups is None:
            self._refuse(NO_POLICY, f"{msg}: this transfer side was started without a shared index")
            return
        try:
            policy = make_policy(msg.name)
        except ValueError as exc:
            self._refuse(NO_POLICY, f"{msg}: {exc}")
            return
        if policy.needs_model:
            self._refuse(NO_POLICY, f"{msg}: policy {msg.name} reads the target's hidden states; it schedules in the verifier")
            return
        shape, cfg = self.store.shape, self.link_config
        host = None  # on a GPU the verifier computes no expert on the host (lossless: ``executor.default_host``)
        if cfg.kind == "sim":
            host = HostCompute(simulated_host(cfg.bandwidth, cfg.latency, shape.nbytes, 2 * shape.numel,
                                              msg.host_profile or None), shape)
        if self.schedule is not None:
            self.schedule.reset(self.timeout_s, refill=False)  # in-flight copies land before the new map is made
        self.index.clear_all()
        self.schedule = TransferExperts(self.store, self.slots, self.index, self.link, self.groups, policy, host)
        self.schedule.fill()

    def _schedule(self, msg: object) -> None:
        schedule = self.schedule
        if schedule is None and isinstance(msg, PlanDelta):  # the verifier schedules: its copy of the plan is the one used
            self.plans_ignored += 1
            return
        if schedule is None:
            self._refuse(NO_POLICY, f"a {type(msg).__name__} message before any UsePolicy")
            return
        if isinstance(msg, LayerNeeds | FetchLater | PlanDelta) and not self._in_range(msg):
            self._refuse(OUT_OF_RANGE, f"{msg}: no such layer or expert")
            return
        try:
            self._dispatch(schedule, msg)
        except Exception as exc:  # a bug in a policy must not stop the copies: counted, logged
            self._refuse(FAILED, f"{type(msg).__name__} failed: {exc!r}", exc_info=True)

    def _dispatch(self, schedule: TransferExperts, msg: object) -> None:
        if isinstance(msg, PlanDelta):
            schedule.on_plan(msg)
        elif isinstance(msg, LayerNeeds):
            schedule.layer(msg)
        elif isinstance(msg, RoundStart):
            schedule.begin_round(msg)
        elif isinstance(msg, VerifyStart):
            schedule.begin_verify(msg)
        elif isinstance(msg, RoundEnd):
            schedule.end_round(msg)
        elif isinstance(msg, FetchLater):
            schedule.fetch_later(msg)
        elif isinstance(msg, RequestStart):
            schedule.policy.begin_request()
        elif isinstance(msg, ResetSlots):
            schedule.reset(self.timeout_s)
        elif isinstance(msg, Replay):
            replay = getattr(schedule.policy, "replay", None)
            if replay is not None:
                replay()

    def _in_range(self, msg: LayerNeeds | FetchLater | PlanDelta) -> bool:
        if isinstance(msg, PlanDelta):
            layers, experts = msg.layers, [e for ids in msg.experts for e in ids]
        else:
            layers = [msg.layer]
            experts = [*msg.wait, *msg.ready, *msg.host] if isinstance(msg, LayerNeeds) else msg.experts
        return all(layer in self._layers for layer in layers) and all(e < self.store.num_experts for e in experts)

    def close(self) -> None:
        """Stop the copy thread (queued copies are dropped)."""
        self.link.close()

    def _promote_or_drop(self, msg: PromoteFetch | DropFetch) -> None:
        transfer = self.transfers.get(msg.id)
        if transfer is None:
            self._refuse(UNKNOWN_ID, f"{msg}: no transfer has this id")
        elif isinstance(msg, PromoteFetch):
            self.link.promote(transfer)
        else:
            self.link.cancel(transfer)

    def _fetch(self, msg: FetchExpert) -> None:
        if msg.layer not in self._layers or msg.expert >= self.store.num_experts or msg.slot >= self.slots.num_slots:
            self._refuse(OUT_OF_RANGE, f"{msg}: no such expert or slot")
            return
        pending = self.transfers.get(msg.id)
        if pending is not None and not (pending.done.is_set() or pending.cancelled):
            self._refuse(DUPLICATE_ID, f"{msg}: transfer {msg.id} is still pending")
            return
        src = self.store.blob(msg.layer, msg.expert)
        dst = self.slots.storage[msg.slot]
        key = (msg.layer, msg.expert)
        if msg.timed:
            transfer = self.link.submit(key, msg.slot, src, dst, msg.priority)
        else:
            transfer = self.link.submit_untimed(key, msg.slot, src, dst, msg.priority)
        self.transfers[msg.id] = transfer
        if len(self.transfers) > _PRUNE_AT:
            self.transfers = {i: t for i, t in self.transfers.items() if not (t.done.is_set() or t.cancelled)}
