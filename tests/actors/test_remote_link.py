"""RemoteLink + TransferServer in one process (no Ray): demand before prefetch, cancel, counters."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from specter.actor_channel import ActorChannel
from specter.channel import private_ipc_dir
from specter.config import LinkConfig
from specter.experts.link import DEMAND, PREFETCH, Transfer
from specter.experts.remote_link import RemoteLink
from specter.experts.shared_counters import SharedCounters
from specter.experts.shm import SharedSlots, new_prefix, unlink_prefix
from specter.experts.store import ExpertShape, ExpertStore
from specter.experts.transfer_server import TransferServer

SHAPE = ExpertShape(hidden=8, intermediate=4, dtype=torch.float32)  # 384 bytes per expert
STEP_S = 0.1  # every transfer takes this long on the simulated link


def _until_started(transfer: Transfer, timeout_s: float = 5.0) -> None:
    """Wait until the copy thread has taken ``transfer`` (its slot's number moved)."""
    deadline = time.monotonic() + timeout_s
    while not transfer.done.started():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the copy thread never started the transfer"
        time.sleep(0.001)


@pytest.fixture()
def link() -> Iterator[tuple[RemoteLink, SharedSlots, TransferServer]]:
    store = ExpertStore([0, 1], 4, SHAPE)
    for layer in (0, 1):
        for expert in range(4):
            store.blob(layer, expert).fill_(10 * layer + expert)
    prefix = new_prefix("spt-test")
    slots = SharedSlots.create(prefix, 6, SHAPE.numel, SHAPE.dtype)
    counters = SharedCounters(prefix, create=True)
    ipc = private_ipc_dir()
    pull = ActorChannel("pull", ipc.endpoint("transfer"), bind=True, peer="verifier")
    server = TransferServer(store, slots, counters, LinkConfig(bandwidth=1e12, latency=STEP_S), pull)
    stop = threading.Event()

    def serve() -> None:
        pull.handshake("transfer", 10)
        server.serve(stop, poll_s=0.01)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    push = ActorChannel("push", pull.address, bind=False, peer="transfer")
    push.handshake("verifier", 10)
    reader = SharedSlots.attach(slots.handle)
    remote = RemoteLink(push, reader, SharedCounters(prefix, create=False))
    try:
        yield remote, reader, server
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


def test_demand_jumps_queued_prefetches_and_lands_in_the_shared_slot(link) -> None:
    remote, slots, _ = link
    dst = slots.storage
    first = remote.submit((0, 0), 0, torch.empty(0), dst[0], PREFETCH)
    _until_started(first)
    queued = [remote.submit((0, e), e, torch.empty(0), dst[e], PREFETCH) for e in (1, 2, 3)]
    demand = remote.submit((1, 3), 4, torch.empty(0), dst[4], DEMAND)
    assert demand.wait(5) >= 0
    assert first.done.is_set()
    assert not any(t.done.is_set() for t in queued), "a prefetch landed before the demand transfer"
    assert torch.equal(dst[4], torch.full((SHAPE.numel,), 13.0))
    for t in queued:
        t.wait(5)
    assert slots.read(3)[0] == (0, 3)


def test_promote_and_cancel_and_counters(link) -> None:
    remote, slots, server = link
    dst = slots.storage
    head = remote.submit((0, 0), 0, torch.empty(0), dst[0], PREFETCH)
    _until_started(head)
    late = remote.submit((0, 1), 1, torch.empty(0), dst[1], PREFETCH)
    promoted = remote.submit((0, 2), 2, torch.empty(0), dst[2], PREFETCH)
    dropped = remote.submit((1, 1), 3, torch.empty(0), dst[3], PREFETCH)
    remote.promote(promoted)
    assert remote.cancel(dropped)
    assert not remote.cancel(head)  # started: too late
    promoted.wait(5)
    assert not late.done.is_set()
    late.wait(5)
    time.sleep(2 * STEP_S)
    assert not dropped.done.is_set() and slots.read(3)[0] is None
    moved, busy, transfers = remote.bytes_moved, remote.busy_s, remote.transfers
    assert (moved, transfers) == (3 * SHAPE.nbytes, 3)
    assert busy >= 3 * STEP_S * 0.9
    assert server.rejected == 0
