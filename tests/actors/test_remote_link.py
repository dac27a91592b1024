"""RemoteLink + TransferServer in one process (no Ray): demand before prefetch, cancel, counters,
refused commands, and the untimed prefill behaving as in process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from specter.config import LinkConfig, SlotConfig
from specter.engine import Engine
from specter.experts.link import DEMAND, PREFETCH, Transfer
from specter.experts.slots import SlotPool
from specter.experts.store import ExpertShape, ExpertStore
from specter.models.loader import build_dense, load_store
from specter.plan import make_policy
from specter.protocol import AheadStart, DropFetch, FetchExpert, LayerNeeds, PlanDelta, PromoteFetch
from specter.remote.channel import Channel
from specter.remote.counters import SharedCounters
from specter.remote.endpoints import private_ipc_dir
from specter.remote.experts import RemoteExperts
from specter.remote.link import RemoteLink
from specter.remote.roles.base import role_device
from specter.remote.segments import new_prefix, unlink_prefix
from specter.remote.shm import SharedSlots
from specter.remote.transfer_server import (
    FAILED,
    NO_POLICY,
    OUT_OF_RANGE,
    UNEXPECTED,
    UNKNOWN_ID,
    TransferServer,
)
from specter.target import OffloadedTarget, slot_groups

SHAPE = ExpertShape(hidden=8, intermediate=4, dtype=torch.float32)  # 384 bytes per expert
STEP_S = 0.1  # every transfer takes this long on the simulated link
HANG_S = 60.0  # waits end on their condition; only a hang reaches this


def _moves(server: TransferServer) -> list[tuple[int, int]]:
    """Record the keys the transfer side's copy thread moves, in order (one at a time, so the order
    they start in is the order they land in)."""
    order: list[tuple[int, int]] = []
    move = server.link._move

    def spy(transfer: Transfer) -> None:
        order.append(transfer.key)
        move(transfer)

    server.link._move = spy  # type: ignore[method-assign]
    return order


def _until_started(transfer: Transfer, timeout_s: float = HANG_S) -> None:
    """Wait until the copy thread has taken ``transfer`` (its slot's number moved)."""
    deadline = time.monotonic() + timeout_s
    while not transfer.done.started():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the copy thread never started the transfer"
        time.sleep(0.001)


@contextmanager
def transfer_side(
    store: ExpertStore, num_slots: int, link: LinkConfig, copies: object = None,
    spy: Callable[[SharedSlots, str], None] | None = None,
) -> Iterator[tuple[RemoteLink, TransferServer]]:
    """A TransferServer serving in a thread over real ipc + shared memory, and the RemoteLink to it
    (``copies``: a copy stream for a ``cuda`` link; ``spy`` is called with each side's slots, named
    ``writer`` and ``reader``, before they are used)."""
    prefix = new_prefix("spt-test")
    slots = SharedSlots.create(prefix, num_slots, store.shape.numel, store.shape.dtype)
    if spy is not None:
        spy(slots, "writer")
    counters = SharedCounters(prefix, create=True)
    ipc = private_ipc_dir()
    pull = Channel("pull", ipc.endpoint("transfer"), bind=True, peer="verifier")
    server = TransferServer(store, slots, counters, link, pull, copies=copies)  # type: ignore[arg-type]
    stop = threading.Event()

    def serve() -> None:
        pull.handshake("transfer", 10)
        server.serve(stop, poll_s=0.01)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    push = Channel("push", pull.address, bind=False, peer="transfer")
    push.handshake("verifier", 10)
    reader = SharedSlots.attach(slots.handle)
    if spy is not None:
        spy(reader, "reader")
    remote = RemoteLink(push, reader, SharedCounters(prefix, create=False), link)
    try:
        yield remote, server
    finally:
        stop.set()
        thread.join(5)
        server.close()
        push.close()
        pull.close()
        ipc.cleanup()
        reader.close()
        slots.close()
        slots.unlink()
        counters.close()
        assert unlink_prefix(prefix) == []


@pytest.fixture()
def link() -> Iterator[tuple[RemoteLink, SharedSlots, TransferServer]]:
    store = ExpertStore([0, 1], 4, SHAPE)
    for layer in (0, 1):
        for expert in range(4):
            store.blob(layer, expert).fill_(10 * layer + expert)
    with transfer_side(store, 6, LinkConfig(bandwidth=1e12, latency=STEP_S)) as (remote, server):
        yield remote, remote.slots, server


def test_demand_jumps_queued_prefetches_and_lands_in_the_shared_slot(link) -> None:
    remote, slots, server = link
    order = _moves(server)
    dst = slots.storage
    first = remote.submit((0, 0), 0, torch.empty(0), dst[0], PREFETCH)
    _until_started(first)
    queued = [remote.submit((0, e), e, torch.empty(0), dst[e], PREFETCH) for e in (1, 2, 3)]
    demand = remote.submit((1, 3), 4, torch.empty(0), dst[4], DEMAND)
    assert demand.wait(HANG_S) >= 0
    assert first.done.is_set()
    assert torch.equal(dst[4], torch.full((SHAPE.numel,), 13.0))
    for t in queued:
        t.wait(HANG_S)
    assert slots.read(3)[0] == (0, 3)
    # the demand transfer went right after the one already moving, ahead of every queued prefetch
    assert order == [(0, 0), (1, 3), (0, 1), (0, 2), (0, 3)], order


def test_a_reader_orders_its_compute_after_the_copy_and_a_writer_after_the_last_reader(link, monkeypatch) -> None:
    """The two CUDA-IPC races, shown on the protocol (on a GPU the hooks are stream-event waits):
    a wait for a transfer ends with ``wait_copy`` on its slot once the slot shows the key (the
    reader's stream waits for the copy's event), and a fetch into a slot whose last reader left an
    event hands that event to the slot's interprocess reader event (``mark_read``, which the writer's
    copy stream waits on) before the command goes to the other process, without a host sync."""
    remote, slots, _ = link
    seen: list[object] = []
    monkeypatch.setattr(slots, "wait_copy", lambda slot: seen.append(("wait_copy", slot, slots.read(slot)[0])))
    sent = remote.channel.send
    monkeypatch.setattr(remote.channel, "send", lambda msg: (seen.append(type(msg).__name__), sent(msg)))

    class LastReader:  # the local CUDA event of the kernels that last read the slot
        def synchronize(self) -> None:
            raise AssertionError("a fetch must not sync the host on the slot's last reader")

    last = LastReader()
    monkeypatch.setattr(slots, "mark_read", lambda slot, after=None: seen.append(("mark_read", slot, after)))
    transfer = remote.submit((1, 2), 3, torch.empty(0), slots.storage[3], DEMAND, wait_for=last)
    transfer.wait(HANG_S)
    assert seen == [("mark_read", 3, last), "FetchExpert", ("wait_copy", 3, (1, 2))]
    assert torch.equal(slots.storage[3], torch.full((SHAPE.numel,), 12.0))


def test_promote_and_cancel_and_counters(link) -> None:
    remote, slots, server = link
    order = _moves(server)
    dst = slots.storage
    head = remote.submit((0, 0), 0, torch.empty(0), dst[0], PREFETCH)
    _until_started(head)
    late = remote.submit((0, 1), 1, torch.empty(0), dst[1], PREFETCH)
    promoted = remote.submit((0, 2), 2, torch.empty(0), dst[2], PREFETCH)
    dropped = remote.submit((1, 1), 3, torch.empty(0), dst[3], PREFETCH)
    remote.promote(promoted)
    assert remote.cancel(dropped)
    assert not remote.cancel(head)  # started: too late
    promoted.wait(HANG_S)
    late.wait(HANG_S)
    # a prefetch queued after the dropped one: once it has landed, the dropped one had its turn
    remote.submit((1, 2), 4, torch.empty(0), dst[4], PREFETCH).wait(HANG_S)
    assert order == [(0, 0), (0, 2), (0, 1), (1, 2)], order  # promoted ahead of late; dropped never moved
    assert not dropped.done.is_set() and slots.read(3)[0] is None
    moved, busy, transfers = remote.bytes_moved, remote.busy_s, remote.transfers
    assert (moved, transfers) == (4 * SHAPE.nbytes, 4)
    assert busy >= 4 * STEP_S * 0.9
    assert server.rejected == 0


def test_the_remote_link_knows_when_the_moving_transfer_lands(link) -> None:
    """What the host-compute split asks of a link, answered from the transfer side's due time."""
    remote, slots, _ = link
    assert remote.estimate_s(SHAPE.nbytes) == pytest.approx(STEP_S + SHAPE.nbytes / 1e12)
    before = time.perf_counter()
    moving = remote.submit((0, 1), 0, torch.empty(0), slots.storage[0], DEMAND)
    queued = remote.submit((0, 2), 1, torch.empty(0), slots.storage[1], PREFETCH)
    _until_started(moving)
    due = remote.landing(moving, time.perf_counter())
    assert due is not None and due >= before + STEP_S  # it started after `before`, takes STEP_S
    assert remote.free_at(time.perf_counter()) == due
    assert remote.landing(queued, time.perf_counter()) is None  # not started
    _until(moving.done.published)  # the bytes are in before it is due: published, not landed
    assert moving.done.due == pytest.approx(due) and remote.landing(moving, time.perf_counter()) == pytest.approx(due)
    moving.wait(HANG_S)
    assert time.perf_counter() >= due  # it landed no earlier than due
    assert moving.done.is_set() and remote.landing(moving, time.perf_counter()) <= time.perf_counter()
    queued.wait(HANG_S)
    remote.timed = False
    assert remote.estimate_s(SHAPE.nbytes) == 0.0


def _until(condition, timeout_s: float = HANG_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def test_commands_that_name_nothing_are_refused_and_counted(link) -> None:
    remote, slots, server = link
    send = remote.channel.send
    send(FetchExpert(100, 7, 0, 0, 0))  # no layer 7
    send(FetchExpert(101, 0, 4, 0, 0))  # no expert 4
    send(FetchExpert(102, 0, 0, 6, 0))  # no slot 6
    send(PromoteFetch(555))
    send(DropFetch(556))
    send(PlanDelta(0, 0, [0], [[1]], [[1.0]]))  # no schedule here: the verifier's policy has its own copy
    send(LayerNeeds(0, 1, [1]))  # a schedule message before any UsePolicy
    send(AheadStart(1, 2))  # for the verifier, not the transfer actor
    _until(lambda: server.rejected == 7)
    assert server.rejections == {OUT_OF_RANGE: 3, UNKNOWN_ID: 2, "duplicate_id": 0, UNEXPECTED: 1,
                                 NO_POLICY: 1, FAILED: 0}
    assert server.plans_ignored == 1
    assert all(slots.read(s)[1] == 0 for s in range(slots.num_slots)), "a refused command touched a slot"
    ok = remote.submit((1, 2), 1, torch.empty(0), slots.storage[1], DEMAND)  # the server still serves
    ok.wait(HANG_S)
    assert slots.read(1)[0] == (1, 2)


def test_link_timing_switches_the_transfer_side_model() -> None:
    store = ExpertStore([0], 4, SHAPE)
    slow_s = 2.0  # the link model's time per transfer: far above any copy, even on a loaded machine
    with transfer_side(store, 3, LinkConfig(bandwidth=1e12, latency=slow_s)) as (remote, server):
        slots = remote.slots
        remote.timed = False
        _until(lambda: not server.link.timed)
        t0 = time.perf_counter()
        remote.submit((0, 1), 0, torch.empty(0), slots.storage[0], DEMAND).wait(HANG_S)
        assert time.perf_counter() - t0 < slow_s / 2  # copy speed, not the link model
        assert remote.transfers == 1 and remote.bytes_moved == SHAPE.nbytes  # counted, as in process
        remote.timed = True
        t0 = time.perf_counter()
        remote.submit((0, 2), 1, torch.empty(0), slots.storage[1], DEMAND).wait(HANG_S)
        assert time.perf_counter() - t0 >= slow_s * 0.9
        received = server.channel.received
        remote.timed = True  # no change: no message
        remote.submit((0, 3), 2, torch.empty(0), slots.storage[2], DEMAND).wait(HANG_S)
        assert server.channel.received == received + 1 and server.link.timed


# -- the CUDA link's order of calls, on the CPU (stand-ins for the stream and events) ---------

COPY_S = 0.003  # what the stand-in copy stream says each copy took on the copy engine


class StandInCopyStream:
    """``CopyStream``'s calls on the CPU: each copy runs at once and is logged; ``seconds`` answers
    ``COPY_S`` (on a GPU: a pair of CUDA timing events around the copy)."""

    stream = "copy-stream"

    def __init__(self, log: list[tuple]):
        self.log = log

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        self.log.append(("copy", float(src[0])))
        dst.copy_(src)
        return len(self.log)

    def seconds(self, handle: int) -> float:
        time.sleep(COPY_S)  # a GPU's copy engine takes this long for it
        self.log.append(("copy done", handle))
        return COPY_S


def _spy_events(log: list[tuple]) -> Callable[[SharedSlots, str], None]:
    """Log what each side does to a slot that a GPU turns into event calls: the writer's claim, its
    copy stream's wait on the slot's reader event, the copy event it records and the publish after;
    the reader's record of the reader event (``mark_read``, also inside ``release``)."""

    def spy(slots: SharedSlots, side: str) -> None:
        if side == "reader":
            slots.mark_read = lambda slot, after=None: log.append(("mark_read", slot))  # type: ignore[method-assign]
            return
        begin, publish = slots.begin_write, slots.publish

        def claim(slot: int) -> bool:
            claimed = begin(slot)
            if claimed:
                log.append(("claim", slot))
            return claimed

        def published(slot: int, key, stream=None, due: float = 0.0) -> int:  # type: ignore[no-untyped-def]
            seq = publish(slot, key, stream, due)
            log.append(("published", slot, key, seq % 2))
            return seq

        slots.begin_write = claim  # type: ignore[method-assign]
        slots.publish = published  # type: ignore[method-assign]
        slots.wait_reader = lambda slot, stream: log.append(("wait_reader", slot, stream))  # type: ignore[method-assign]
        slots._record = lambda slot, stream: log.append(("record", slot, stream))  # type: ignore[method-assign]

    return spy


@pytest.fixture()
def cuda_link() -> Iterator[tuple[RemoteLink, TransferServer, list[tuple]]]:
    store = ExpertStore([0, 1], 4, SHAPE)
    for layer in (0, 1):
        for expert in range(4):
            store.blob(layer, expert).fill_(10 * layer + expert)
    log: list[tuple] = []
    with transfer_side(store, 6, LinkConfig(kind="cuda"), StandInCopyStream(log), _spy_events(log)) as (remote, server):
        yield remote, server, log


def test_the_cuda_link_waits_for_the_last_reader_then_copies_records_and_publishes(cuda_link) -> None:
    """Per copy, in this order: claim the slot (seq odd), make the copy stream wait on the slot's
    reader event, copy, record the slot's copy event on the copy stream, publish (seq even); the bytes
    are counted by the time the key is seen, the copy engine's seconds once the copy is done."""
    remote, server, log = cuda_link
    assert server.link.describe().startswith("cuda-slots")
    slots = remote.slots
    transfer = remote.submit((1, 2), 3, torch.empty(0), slots.storage[3], DEMAND)
    transfer.wait(HANG_S)
    assert remote.bytes_moved == SHAPE.nbytes and remote.transfers == 1
    assert torch.equal(slots.storage[3], torch.full((SHAPE.numel,), 12.0))
    _until(lambda: remote.busy_s > 0)
    assert remote.busy_s == pytest.approx(COPY_S)
    assert log[:5] == [("claim", 3), ("wait_reader", 3, "copy-stream"), ("copy", 12.0), ("record", 3, "copy-stream"),
                       ("published", 3, (1, 2), 0)], log
    assert log[5][0] == "copy done"
    # the demand was outstanding from its submit until its copy was done: at least the copy's time
    assert server.link.demand_outstanding_s >= COPY_S * 0.9
    assert server.link.demands_issued == 1 and 0 <= server.link.demand_issue_s < server.link.demand_outstanding_s


def test_the_cuda_link_claims_a_pinned_slot_only_after_its_reader_recorded_the_reader_event(cuda_link) -> None:
    remote, server, log = cuda_link
    slots = remote.slots
    _, seq = slots.read(4)
    assert slots.try_pin(4, seq)  # the verifier computes with slot 4
    transfer = remote.submit((0, 3), 4, torch.empty(0), slots.storage[4], DEMAND)
    _until(lambda: len(server.link._demands) == 1)  # the server holds the demand: its clock has started
    held = time.perf_counter()
    time.sleep(0.2)
    assert not transfer.done.is_set() and ("claim", 4) not in log  # the writer leaves a pinned slot alone
    released = time.perf_counter()
    slots.release(4)  # records the reader event, then unpins
    transfer.wait(HANG_S)
    assert log.index(("mark_read", 4)) < log.index(("claim", 4)) < log.index(("wait_reader", 4, "copy-stream"))
    # it waited for the pinned slot: issued after the release, asked for before ``held``
    assert server.link.demands_issued == 1 and server.link.demand_issue_s >= released - held
    assert torch.equal(slots.storage[4], torch.full((SHAPE.numel,), 3.0))


def test_the_cuda_link_times_a_promoted_prefetch_as_a_demand_from_its_promotion(cuda_link) -> None:
    """``demand_issue_s`` runs from when a demand is asked for: a prefetch promoted while queued counts from its
    promotion, not its submit; one the copy thread had already taken stays a prefetch."""
    remote, server, _ = cuda_link
    slots = remote.slots
    _, seq = slots.read(4)
    assert slots.try_pin(4, seq)  # the verifier computes with slot 4
    link = server.link
    taken = remote.submit((0, 3), 4, torch.empty(0), slots.storage[4], PREFETCH)
    # the copy thread has taken it and waits for the pinned slot: nothing behind it is issued
    _until(lambda: link._current is not None and link._current.key == (0, 3))
    queued = remote.submit((1, 3), 5, torch.empty(0), slots.storage[5], PREFETCH)
    _until(lambda: link.queued() == 1)
    asked = time.perf_counter()  # the queued prefetch was submitted before this
    time.sleep(0.5)
    remote.promote(taken)
    remote.promote(queued)
    _until(lambda: any(transfer.priority == DEMAND for _, _, transfer in link._heap))
    promoted = time.perf_counter()  # the server has promoted the queued one
    time.sleep(0.05)
    released = time.perf_counter()
    slots.release(4)
    for transfer in (taken, queued):
        transfer.wait(HANG_S)
    done = time.perf_counter()
    assert link.demands_issued == 1  # the promoted one; the one already taken was not made a demand
    # from its promotion (no earlier than 0.5 s after ``asked``) to its issue (after the release); from its
    # submit it would be at least ``released - asked``
    assert released - promoted <= link.demand_issue_s <= done - asked - 0.5 < released - asked


def test_the_cuda_link_counts_no_initial_fill_and_two_copies_are_in_flight(cuda_link) -> None:
    remote, server, log = cuda_link
    slots = remote.slots
    remote.place([((0, 1), 0), ((1, 1), 1)], HANG_S)  # the initial residency: not the link's work
    assert torch.equal(slots.storage[1], torch.full((SHAPE.numel,), 11.0))
    _until(lambda: sum(1 for entry in log if entry[0] == "copy done") == 2)
    assert (remote.bytes_moved, remote.transfers, remote.busy_s) == (0, 0, 0.0)
    assert server.link.demand_outstanding_s == 0.0  # no demand the link counts was ever waiting
    remote.submit((0, 2), 2, torch.empty(0), slots.storage[2], PREFETCH).wait(HANG_S)
    _until(lambda: remote.busy_s > 0)
    assert server.link.demand_outstanding_s == 0.0  # a prefetch is not a demand
    assert (server.link.demands_issued, server.link.demand_issue_s) == (0, 0.0)
    assert server.link.in_flight == 2
    remote.timed = False  # accepted (nothing to switch on a real link)
    _until(lambda: not server.link.timed)


def test_a_cuda_link_needs_its_slots_on_a_cuda_device() -> None:
    prefix = new_prefix("spt-test")
    with SharedSlots.create(prefix, 2, SHAPE.numel, SHAPE.dtype) as slots:
        counters = SharedCounters(prefix, create=True)
        try:
            with pytest.raises(ValueError, match="cuda needs the shared slots on a CUDA device"):
                TransferServer(ExpertStore([0], 2, SHAPE), slots, counters, LinkConfig(kind="cuda"), None)  # type: ignore[arg-type]
        finally:
            counters.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="link: cuda needs a CUDA device"):
            role_device(LinkConfig(kind="cuda"))
    assert role_device(LinkConfig()) == torch.device("cpu")


# -- untimed prefill: in process vs RemoteLink + TransferServer -------------------------------

PROMPT = [5, 99, 17, 42, 8, 63, 21]
# ~74 ms per tiny expert (18 432 bytes): the timed/untimed gaps below stay far above any load's jitter
SLOW = LinkConfig(kind="sim", bandwidth=2.5e5, latency=0.0)
BUDGET = SlotConfig(fraction=0.25)


@contextmanager
def _remote_target(folder: Path) -> Iterator[OffloadedTarget]:
    """The verifier actor's target (``actors/verifier.py``), with its transfer side in a thread."""
    host = build_dense(folder, torch.float32)
    store = load_store(host)
    groups = slot_groups(BUDGET, host)
    with transfer_side(store, sum(groups.values()), SLOW) as (remote, _):
        loaded = build_dense(folder, torch.float32)
        pool = SlotPool(loaded.shape, groups, torch.device("cpu"), storage=remote.slots.storage)
        offload = RemoteExperts(store, pool, remote, make_policy("demand-lru"), timeout=30)
        offload.prefill_slots()
        yield OffloadedTarget(loaded, offload, torch.device("cpu"))


def _run(target: OffloadedTarget, untimed: bool) -> tuple[list[int], dict]:
    tokens, stats = Engine(target, untimed_prefill=untimed).generate_fresh(PROMPT, 3)
    return tokens, stats.to_dict()


def test_untimed_prefill_through_the_transfer_server_matches_in_process(tiny_dir) -> None:
    folder = tiny_dir("mixtral")
    local = OffloadedTarget.load(folder, BUDGET, SLOW, policy="demand-lru")
    local.offload.host = None  # the verifier holds no host blobs, so no host compute: compare like with like
    try:
        runs = {("local", u): _run(local, u) for u in (False, True)}
    finally:
        local.close()
    with _remote_target(folder) as remote:
        runs.update({("remote", u): _run(remote, u) for u in (False, True)})
    tokens = {key: run[0] for key, run in runs.items()}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens
    step = 3 * 32 * 48 * 4 / SLOW.bandwidth  # one expert on the slow link
    for where in ("local", "remote"):
        timed, untimed = runs[(where, False)][1], runs[(where, True)][1]
        prefill_transfers = timed["misses"] - timed["decode_misses"]
        assert prefill_transfers >= 3
        # same transfers and bytes either way: untimed copies are counted, only faster
        assert (untimed["transfers"], untimed["bytes_moved"]) == (timed["transfers"], timed["bytes_moved"])
        assert timed["prefill_s"] >= 0.9 * prefill_transfers * step
        assert untimed["prefill_s"] < timed["prefill_s"] - 0.5 * prefill_transfers * step, where
        assert untimed["link_busy_s"] < timed["link_busy_s"] - 0.5 * prefill_transfers * step, where
    for mode in (False, True):  # the remote link counts exactly what the local one does
        here, there = runs[("local", mode)][1], runs[("remote", mode)][1]
        for key in ("transfers", "bytes_moved", "misses", "decode_misses"):
            assert here[key] == there[key], (key, mode)
        assert abs(here["link_busy_s"] - there["link_busy_s"]) < 0.25 * here["link_busy_s"] + 2 * step
