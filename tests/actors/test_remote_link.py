"""RemoteLink + TransferServer in one process (no Ray): demand before prefetch, cancel, counters,
refused commands, and the untimed prefill behaving as in process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
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
def transfer_side(store: ExpertStore, num_slots: int, link: LinkConfig) -> Iterator[tuple[RemoteLink, TransferServer]]:
    """A TransferServer serving in a thread over real ipc + shared memory, and the RemoteLink to it."""
    prefix = new_prefix("spt-test")
    slots = SharedSlots.create(prefix, num_slots, store.shape.numel, store.shape.dtype)
    counters = SharedCounters(prefix, create=True)
    ipc = private_ipc_dir()
    pull = Channel("pull", ipc.endpoint("transfer"), bind=True, peer="verifier")
    server = TransferServer(store, slots, counters, link, pull)
    stop = threading.Event()

    def serve() -> None:
        pull.handshake("transfer", 10)
        server.serve(stop, poll_s=0.01)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    push = Channel("push", pull.address, bind=False, peer="transfer")
    push.handshake("verifier", 10)
    reader = SharedSlots.attach(slots.handle)
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
    event waits for that event before the command goes to the other process."""
    remote, slots, _ = link
    seen: list[object] = []
    monkeypatch.setattr(slots, "wait_copy", lambda slot: seen.append(("wait_copy", slot, slots.read(slot)[0])))
    sent = remote.channel.send
    monkeypatch.setattr(remote.channel, "send", lambda msg: (seen.append(type(msg).__name__), sent(msg)))

    class LastReader:
        def synchronize(self) -> None:
            seen.append("last reader done")

    transfer = remote.submit((1, 2), 3, torch.empty(0), slots.storage[3], DEMAND, wait_for=LastReader())
    transfer.wait(HANG_S)
    assert seen == ["last reader done", "FetchExpert", ("wait_copy", 3, (1, 2))]
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
