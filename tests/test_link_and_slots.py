"""The simulated link keeps its time model, runs beside compute, and serves demand first;
the slot pool never evicts what a pass still needs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from specter.config import SlotConfig
from specter.experts.link import DEMAND, PREFETCH, LinkError, SimulatedLink
from specter.experts.slots import SlotPool
from specter.experts.store import ExpertShape


def test_transfer_takes_at_least_bytes_over_bandwidth_and_is_asynchronous():
    link = SimulatedLink(bandwidth=4e6, latency=0.01)  # 4 MB at 4 MB/s + 10 ms = 1.01 s
    src, dst = torch.arange(1_000_000, dtype=torch.float32), torch.empty(1_000_000)
    t0 = time.perf_counter()
    transfer = link.submit((0, 0), 0, src, dst, DEMAND)
    assert not transfer.done.is_set()  # submit returned long before the 1 s transfer could land
    transfer.wait(timeout=60)
    assert time.perf_counter() - t0 >= 1.01
    assert torch.equal(src, dst)
    # Busy time is the link model's (from submission: the thread's wake-up is not the link's).
    assert link.bytes_moved == 4_000_000 and link.busy_s == pytest.approx(1.01) and link.transfers == 1
    link.close()


def test_demand_jumps_queued_prefetches():
    link = SimulatedLink(bandwidth=1e8, latency=0.0)
    order: list[tuple[int, int]] = []  # keys in the order the copy thread moves them (one at a time)
    move = link._move
    link._move = lambda transfer: (order.append(transfer.key), move(transfer))[1]  # type: ignore[method-assign]
    buf = [torch.zeros(250_000) for _ in range(4)]  # 10 ms each
    first = link.submit((0, 0), 0, buf[0], torch.empty(250_000), PREFETCH)
    prefetch = link.submit((0, 1), 1, buf[1], torch.empty(250_000), PREFETCH)
    demand = link.submit((0, 2), 2, buf[2], torch.empty(250_000), DEMAND)
    for transfer in (demand, prefetch, first):
        transfer.wait(60)
    # the demand transfer went before the queued prefetch (the first may already have been moving)
    assert order.index((0, 2)) < order.index((0, 1)), order
    link.close()


def test_stalled_transfer_times_out_with_a_clear_error():
    link = SimulatedLink(bandwidth=1e3, latency=0.0)  # 40 kB at 1 kB/s = 40 s
    transfer = link.submit((3, 7), 0, torch.zeros(10_000), torch.empty(10_000), DEMAND)
    with pytest.raises(LinkError, match=r"expert \(3, 7\).*did not finish"):
        transfer.wait(timeout=0.05)
    link.cancel(transfer)


def test_link_rejects_nonsense():
    with pytest.raises(ValueError, match="bandwidth"):
        SimulatedLink(bandwidth=0)
    with pytest.raises(ValueError, match="latency"):
        SimulatedLink(bandwidth=1e9, latency=-1)


def test_pool_evicts_lru_but_never_pinned_or_protected():
    pool = SlotPool(ExpertShape(4, 2, torch.float32), {-1: 3})
    for slot, key in enumerate([(0, 0), (0, 1), (1, 0)]):
        pool.place(key, slot, torch.full((24,), float(slot)))
    pool.touch((0, 0))  # (0, 1) is now least recently used
    assert pool.reserve((1, 5)) == 1 and (0, 1) not in pool.where
    pool.place((1, 5), 1, torch.zeros(24))
    pool.pin((1, 0))
    assert pool.evictable(1, protect={(0, 0)}) == [(1, 5)]
    pool.pin((1, 5))
    assert pool.reserve((1, 6), protect={(0, 0)}) is None


def test_per_layer_groups_evict_within_the_layer():
    pool = SlotPool(ExpertShape(4, 2, torch.float32), {0: 2, 1: 2})
    for key, slot in [((0, 0), 0), ((0, 1), 1), ((1, 0), 2), ((1, 1), 3)]:
        pool.place(key, slot, torch.zeros(24))
    slot = pool.reserve((1, 4))
    assert slot in (2, 3) and (0, 0) in pool.where and (0, 1) in pool.where


@pytest.mark.parametrize(
    ("text", "per_layer", "want"),
    [("0.5", False, 48), ("1.0", False, 96), ("12", False, 12), ("0.25", True, 6), ("1MiB", False, 96)],
)
def test_budget_forms(text, per_layer, want):
    # 4 layers x 24 experts of 8 KiB, top-2
    assert SlotConfig.parse(text, per_layer).slots(4, 24, 8192, 2) == want


def test_budget_below_one_layers_top_k_is_refused_before_work():
    with pytest.raises(ValueError, match="top-4 experts.*minimum is 4"):
        SlotConfig(fraction=0.01).slots(4, 64, 1000, 4)
    with pytest.raises(ValueError, match="per layer"):
        SlotConfig(experts=3, per_layer=True).slots(4, 64, 1000, 4)
    for bad in ("0", "1.5", "-3", "lots", "nan"):
        with pytest.raises(ValueError, match="budget"):
            SlotConfig.parse(bad)


def test_slot_pool_on_given_storage_uses_it_and_refuses_a_wrong_shape() -> None:
    shape = ExpertShape(hidden=4, intermediate=2, dtype=torch.float32)
    memory = torch.zeros(3, shape.numel)
    pool = SlotPool(shape, {-1: 3}, storage=memory)
    pool.place((0, 1), 2, torch.ones(shape.numel))
    assert torch.all(memory[2] == 1)  # the pool wrote into the given memory
    with pytest.raises(ValueError, match=r"storage: expected \(3, "):
        SlotPool(shape, {-1: 3}, storage=torch.zeros(2, shape.numel))


def test_slot_pool_answers_for_its_state() -> None:
    shape = ExpertShape(hidden=4, intermediate=2, dtype=torch.float32)
    pool = SlotPool(shape, {0: 2, 1: 1})
    assert pool.empty_slot(0) == 0 and pool.empty_slot(1) == 2 and pool.empty_count(0) == 2
    pool.place((0, 5), 0, torch.ones(shape.numel))
    assert pool.holds((0, 5)) and not pool.holds((0, 6)) and pool.empty_slot(0) == 1 and pool.empty_count(0) == 1
    link = SimulatedLink(bandwidth=1e12)
    try:
        transfer = link.submit((1, 3), 2, torch.ones(shape.numel), pool.slot_tensor(2), PREFETCH)
        pool.start_loading((1, 3), 2, transfer)
        assert pool.transfer_of((1, 3)) is transfer and pool.transfer_of((0, 5)) is None
        assert pool.loading_keys() == [(1, 3)] and pool.loading_keys(0) == [] and pool.empty_slot(1) is None
        transfer.wait(5.0)
        pool.finish_loading((1, 3))
    finally:
        link.close()
    assert torch.all(pool.slot_tensor(2) == 1) and pool.loading_keys() == []
    assert pool.recency_rank() == {(0, 5): 0, (1, 3): 1}  # (1, 3) was used last
    pool.touch((0, 5))
    assert pool.recency_rank() == {(1, 3): 0, (0, 5): 1}
    pool.pin((0, 5))
    assert pool.is_pinned((0, 5)) and not pool.is_pinned((1, 3)) and not pool.is_pinned((0, 9))
    assert pool.unpinned_per_group() == {0: 1, 1: 1}
    pool.unpin((0, 5))
    assert not pool.is_pinned((0, 5)) and pool.device.type == "cpu"


def test_a_store_in_chunks_holds_whole_blobs_and_reads_like_one_arena(tiny_dir) -> None:
    """Pinned stores are split in chunks of at most 1 GiB (torch's pinned allocator rounds each
    allocation up to a power of two); any chunk size gives the same blobs as one arena, streamed
    from the same checkpoint, with no blob across two chunks and no byte more than the blobs."""
    from specter.experts.store import PINNED_CHUNK_BYTES, ExpertStore
    from specter.models.loader import build_dense, load_store

    loaded = build_dense(tiny_dir("qwen2_moe"), torch.float32)
    whole = load_store(loaded)
    assert whole.chunks == 1
    shape, count = loaded.shape, len(loaded.moe_layers) * loaded.num_experts
    for per in (1, 3, count - 1):
        split = ExpertStore(loaded.moe_layers, loaded.num_experts, shape, chunk_bytes=per * shape.nbytes + 7)
        split.load(loaded.checkpoint, loaded.family)
        assert split.chunks == -(-count // per) and split.nbytes == whole.nbytes == count * shape.nbytes
        for layer in loaded.moe_layers:
            for expert in range(loaded.num_experts):
                assert torch.equal(split.blob(layer, expert), whole.blob(layer, expert))
    # 90 GB of Mixtral experts (352 MB each) pinned: 3 per 1 GiB chunk, never a 128 GB allocation
    mixtral = ExpertShape(hidden=4096, intermediate=14336, dtype=torch.bfloat16)
    assert ExpertStore.blobs_per_chunk(mixtral, 256, PINNED_CHUNK_BYTES) == 3
    assert ExpertStore.blobs_per_chunk(mixtral, 256, None) == 256


class _Engine:
    """A copy engine for ``PipelinedLink``'s logic on a CPU: copies run in order on a thread of
    their own, each 20 ms, and the test sees what was issued while earlier copies still ran."""

    def __init__(self, gate: Any = None) -> None:
        import queue
        import threading

        self.gate = gate  # a threading.Event each copy waits for before it runs (None: none)
        self.jobs: queue.Queue = queue.Queue()
        self.issued: list[tuple[tuple[int, int], int]] = []  # (key, copies not done when it was issued)
        self.done = 0
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            transfer, finished = self.jobs.get()
            if self.gate is not None:
                self.gate.wait()
            time.sleep(0.02)
            transfer.dst.copy_(transfer.src)
            self.done += 1
            finished.set()


def _engine_link(engine: _Engine, in_flight: int):  # type: ignore[no-untyped-def]
    """A ``PipelinedLink`` whose copies run on ``engine`` (one that refuses expert (9, 9))."""
    import threading

    from specter.experts.link import PipelinedLink

    class EngineLink(PipelinedLink):
        name = "testlink"

        def _issue(self, transfer):  # type: ignore[no-untyped-def]
            if transfer.key == (9, 9):
                raise RuntimeError("the engine refused it")
            finished = threading.Event()
            engine.issued.append((transfer.key, len(engine.issued) - engine.done))
            engine.jobs.put((transfer, finished))
            return finished

        def _complete(self, transfer, handle):  # type: ignore[no-untyped-def]
            handle.wait()
            return 0.02

    return EngineLink(in_flight=in_flight)


def test_a_pipelined_link_keeps_two_copies_in_flight_and_demand_still_goes_first() -> None:
    engine = _Engine()
    link = _engine_link(engine, 2)
    srcs = [torch.full((4,), float(e)) for e in range(6)]
    dsts = [torch.empty(4) for _ in range(6)]
    prefetches = [link.submit((0, e), e, srcs[e], dsts[e], PREFETCH) for e in range(4)]
    time.sleep(0.005)  # two are issued at once, the third only when the first is done
    demand = link.submit((1, 5), 5, srcs[5], dsts[5], DEMAND)
    for transfer in (demand, *prefetches):
        transfer.wait(60)
    keys = [key for key, _ in engine.issued]
    assert keys[:2] == [(0, 0), (0, 1)] and engine.issued[1][1] == 1  # issued while the first still ran
    assert keys.index((1, 5)) == 2  # the demand went ahead of the prefetches not issued yet
    assert max(ahead for _, ahead in engine.issued) <= 1  # never more than two in flight
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True) if d is not dsts[4])
    assert link.transfers == 5 and link.busy_s == pytest.approx(0.1) and link.bytes_moved == 5 * 16
    with pytest.raises(LinkError, match=r"expert \(9, 9\) failed: the engine refused it"):
        link.submit((9, 9), 0, srcs[0], dsts[0], DEMAND).wait(60)
    with pytest.raises(ValueError, match="in_flight"):
        _engine_link(engine, 0)
    link.close()


def test_a_transfer_submitted_while_a_lone_copy_moves_is_issued_behind_it_at_once() -> None:
    """The copy engine has no gap between two copies when the second is asked for while the first
    moves (issue 35: busy while a demand is outstanding): it is issued then, not once the first is done."""
    import threading

    gate = threading.Event()  # no copy finishes until the test opens it
    engine = _Engine(gate)
    link = _engine_link(engine, 2)
    src, dst = torch.ones(4), [torch.empty(4) for _ in range(3)]

    def issued(n: int) -> list[tuple[int, int]]:
        deadline = time.perf_counter() + 10
        while len(engine.issued) < n and time.perf_counter() < deadline:
            time.sleep(0.001)
        return [key for key, _ in engine.issued]

    first = link.submit((0, 0), 0, src, dst[0], PREFETCH)
    assert issued(1) == [(0, 0)]  # it moves, nothing queued behind it
    demand = link.submit((0, 1), 1, src, dst[1], DEMAND)
    assert issued(2) == [(0, 0), (0, 1)]  # issued while the first still moves, not once it is done
    third = link.submit((0, 2), 2, src, dst[2], DEMAND)  # two in flight: it waits for room
    time.sleep(0.01)
    assert len(engine.issued) == 2
    gate.set()
    for transfer in (first, demand, third):
        transfer.wait(60)
    assert [key for key, _ in engine.issued] == [(0, 0), (0, 1), (0, 2)] and link.transfers == 3
    assert max(ahead for _, ahead in engine.issued) <= 1  # never more than two in flight
    link.close()
    assert not link._thread.is_alive() and not link._finisher.is_alive()


@pytest.mark.parametrize(("groups", "whole"), [({-1: 12}, [0, 1, 2]), ({-1: 7}, []), ({0: 3, 1: 2, 2: 4}, [2])])
def test_initial_slots_claim_round_robin_and_lay_each_layer_out_in_consecutive_slots(groups, whole) -> None:
    """The initial residency is chosen round-robin over layers (expert 0 of every layer, then 1, …: the
    recency order too), and each slot group's chosen experts take its slots in (layer, expert) order, so
    a layer whose every expert fits runs over consecutive slots with no map (``slot_map`` gives the
    first slot) and the resident step gathers no slot per pair."""
    from specter.experts.executor import initial_slots, slot_map

    layers, experts = [0, 1, 2], 4
    shape = ExpertShape(4, 3, torch.float32)
    pool = SlotPool(shape, dict(groups))
    claimed = initial_slots(pool, layers, experts)
    # the experts chosen, in the order they were claimed: what round-robin over free room chooses
    room = dict(groups)
    want = []
    for key in [(layer, e) for e in range(experts) for layer in layers]:
        group = -1 if -1 in groups else key[0]
        if room[group]:
            room[group] -= 1
            want.append(key)
    assert [key for key, _ in claimed] == want == list(pool.recency)
    for slots in pool.group_slots.values():  # each group's slots in (layer, expert) order
        held = [pool.owner[s] for s in slots if pool.owner[s] is not None]
        assert held == sorted(held)
    assert [layer for layer in layers if pool.layer_slots(layer, experts) is not None] == whole
    for layer in whole:
        slots = pool.layer_slots(layer, experts)
        assert slots is not None and slots == list(range(slots[0], slots[0] + experts))
        assert slot_map(slots, pool.device, shape.nbytes) == slots[0]
    scattered = slot_map([3, 1, 2], pool.device, shape.nbytes)  # not consecutive: a map on the device
    assert isinstance(scattered, torch.Tensor) and scattered.tolist() == [3, 1, 2]
    unaligned = slot_map([1, 2, 3], pool.device, 36)  # a run starting 36 bytes in: a map, as a GPU's kernel needs
    assert isinstance(unaligned, torch.Tensor) and unaligned.tolist() == [1, 2, 3]
    assert slot_map([4, 5, 6], pool.device, 36) == 4
