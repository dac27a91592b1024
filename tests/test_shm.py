"""Shared slots: one storage seen by two processes without copies, seqlock readiness, no leaks."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory

import msgspec
import pytest
import torch

from specter.remote.residency import SharedIndex
from specter.remote.segments import SharedSlotsError, new_prefix, unlink_prefix
from specter.remote.shm import SharedSlots, SlotsHandle, SlotTimeout

NUMEL = 4096

# The other process. "peer": write slot 0, read slot 1 written by the parent, then rewrite slot 2
# as fast as it can for half a second. "own": create two pools, print their handles, wait to be killed.
# "pong": answer each publication of slot 0 by one of slot 1 (latency script below).
CHILD = textwrap.dedent(
    """
    import sys, time, msgspec, torch
    from specter.remote.shm import SharedSlots, SlotsHandle
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "own":
        pools = [SharedSlots.create(prefix, 2, 64, torch.float32) for prefix in arg.split(",")]
        for slots in pools:  # (kept referenced: an owner that is garbage-collected unlinks)
            slots.write(1, (4, 2), torch.full((64,), 42.0))
            print(msgspec.json.encode(slots.handle).decode(), flush=True)
        time.sleep(60)
    slots = SharedSlots.attach(msgspec.json.decode(arg, type=SlotsHandle))
    if mode == "pong":
        blob = torch.zeros(slots.numel, dtype=slots.dtype)
        for i in range(1, 1 << 62):
            slots.wait_ready(0, (0, i), timeout_s=10)
            slots.write(1, (0, i), blob)
    n, dev = slots.numel, slots.storage.device
    slots.write(0, (1, 2), (torch.arange(n) % 100).to(slots.dtype).to(dev))
    slots.acquire(1, (5, 6), timeout_s=30)
    assert torch.equal(slots.storage[1].cpu(), torch.full((n,), 7, dtype=slots.dtype))
    slots.release(1)
    print("read-ok", flush=True)
    i, end = 0, time.monotonic() + 0.5
    while time.monotonic() < end:
        i += 1
        slots.write(2, (0, i), torch.full((n,), float(i % 128), dtype=slots.dtype, device=dev))
    print("stress", i, flush=True)
    slots.close()
    """
)


def _child(mode: str, arg: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, arg], stdout=subprocess.PIPE, text=True)


def _segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def _buffer_address(slots: SharedSlots) -> int:
    assert slots._data_shm is not None
    cell = ctypes.c_char.from_buffer(slots._data_shm.buf)
    address = ctypes.addressof(cell)
    del cell
    return address


def _torn_reads(slots: SharedSlots, child: subprocess.Popen[str]) -> tuple[int, int]:
    """Read slot 2 while the child rewrites it: (consistent reads, reads whose data disagreed)."""
    good = torn = 0
    while child.poll() is None:
        key, seq = slots.read(2)
        data = slots.storage[2].clone()
        if key is None or not slots.is_current(2, seq):
            continue  # being written: a seqlock reader retries
        good += 1
        torn += int(not torch.all(data == float(key[1] % 128)))
    return good, torn


def test_two_processes_share_slots_without_copies() -> None:
    prefix = new_prefix("spt-test")
    slots = SharedSlots.create(prefix, 3, NUMEL, torch.bfloat16)
    ptr = slots.storage.data_ptr()
    assert ptr == _buffer_address(slots)  # the tensor IS the shared mapping, no copy
    child = _child("peer", msgspec.json.encode(slots.handle).decode())
    try:
        seq = slots.wait_ready(0, (1, 2), timeout_s=60)
        assert seq == 2 and slots.storage.data_ptr() == ptr
        assert torch.equal(slots.storage[0], (torch.arange(NUMEL) % 100).to(torch.bfloat16))
        slots.write(1, (5, 6), torch.full((NUMEL,), 7, dtype=torch.bfloat16))
        assert child.stdout is not None and child.stdout.readline().strip() == "read-ok"
        good, torn = _torn_reads(slots, child)
        assert child.wait(30) == 0
        assert torn == 0 and good > 0, (good, torn)
        print(f"seqlock stress: {good} consistent reads, {torn} torn")
        assert int(child.stdout.readline().split()[1]) > 10  # the writer got many rounds in
    finally:
        child.kill()
        slots.close()
        slots.unlink()
    assert _segments(prefix) == []


def test_no_leak_after_the_creator_is_killed() -> None:
    first, second = new_prefix("spt-kill"), new_prefix("spt-kill")
    child = _child("own", f"{first},{second}")
    try:
        assert child.stdout is not None
        handles = [msgspec.json.decode(child.stdout.readline(), type=SlotsHandle) for _ in range(2)]
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        _check_killed_creator_cleanup(first, second, handles)
    finally:
        child.kill()
        for prefix in (first, second):
            unlink_prefix(prefix)


def _check_killed_creator_cleanup(first: str, second: str, handles: list[SlotsHandle]) -> None:
    assert len(_segments(first)) == 2 and len(_segments(second)) == 2  # a SIGKILL leaks them
    survivor = SharedSlots.attach(handles[0])  # the attach side can still read, and clean up
    assert survivor.read(1)[0] == (4, 2) and torch.all(survivor.storage[1] == 42)
    survivor.close()
    survivor.unlink()
    assert _segments(first) == []
    assert sorted(unlink_prefix(second)) == _expected_names(second)
    assert _segments(second) == []


def _expected_names(prefix: str) -> list[str]:
    return [f"{prefix}-data", f"{prefix}-table"]


@pytest.fixture
def pool() -> Iterator[SharedSlots]:
    slots = SharedSlots.create(new_prefix("spt-test"), 4, 16, torch.float32)
    yield slots
    slots.close()
    slots.unlink()
    assert _segments(slots.handle.prefix) == []


def test_attach_in_process_sees_writes_both_ways(pool: SharedSlots) -> None:
    handle = msgspec.msgpack.decode(msgspec.msgpack.encode(pool.handle), type=SlotsHandle)
    other = SharedSlots.attach(handle)
    assert other.storage.data_ptr() != pool.storage.data_ptr()  # a second mapping of one memory
    pool.write(3, (2, 9), torch.arange(16.0))
    assert other.read(3) == ((2, 9), 2) and torch.equal(other.storage[3], torch.arange(16.0))
    other.storage[0].fill_(5.0)
    assert torch.all(pool.storage[0] == 5.0)
    other.close()


def test_wait_ready_waits_for_a_newer_sequence_and_times_out_clearly(pool: SharedSlots) -> None:
    seq = pool.write(1, (0, 3), torch.ones(16))
    assert pool.wait_ready(1, (0, 3), seq) == seq
    t0 = time.monotonic()
    with pytest.raises(
        SlotTimeout, match=r"expert \(0, 3\) \(seq >= 4\) not ready in slot 1 .* holding \(0, 3\)"
    ):
        pool.wait_ready(1, (0, 3), seq + 2, timeout_s=0.05)
    assert time.monotonic() - t0 < 10.0  # it gave up (a hang would not)
    assert pool.begin_write(1)
    with pytest.raises(SlotTimeout, match="being written"):
        pool.wait_ready(1, (0, 3), timeout_s=0.01)
    assert pool.publish(1, None) == seq + 2 and pool.read(1) == (None, seq + 2)


def test_a_blob_published_before_it_is_due_is_waited_for_until_then(pool: SharedSlots) -> None:
    """The writer publishes as soon as the bytes are in, with when they land: readers see the
    due time (also through another mapping) and ``wait_ready`` returns no earlier than it."""
    assert pool.begin_write(0)
    due = time.perf_counter() + 0.05
    seq = pool.publish(0, (1, 2), due=due)
    other = SharedSlots.attach(pool.handle)
    try:
        assert other.read(0) == ((1, 2), seq) and other.due(0) == due
        assert other.wait_ready(0, (1, 2), seq) == seq
        assert time.perf_counter() >= due
    finally:
        other.close()
    assert pool.write(0, (1, 3), torch.zeros(16)) == seq + 2 and pool.due(0) == 0.0  # due at once


def test_a_pinned_slot_is_not_overwritten(pool: SharedSlots) -> None:
    pool.write(2, (1, 1), torch.ones(16))
    seq = pool.acquire(2, (1, 1))
    with pytest.raises(SharedSlotsError, match="pinned"):
        pool.write(2, (1, 4), torch.zeros(16))
    assert pool.is_current(2, seq) and torch.all(pool.storage[2] == 1)
    pool.release(2)
    pool.write(2, (1, 4), torch.zeros(16))
    assert pool.read(2)[0] == (1, 4)


def test_try_pin_pins_only_an_unchanged_slot(pool: SharedSlots) -> None:
    seq = pool.write(3, (0, 1), torch.ones(16))
    assert pool.try_pin(3, seq) and pool.pinned(3)
    assert not pool.begin_write(3)  # the writer leaves a pinned slot alone
    pool.release(3)
    assert not pool.pinned(3)
    pool.write(3, (0, 2), torch.zeros(16))
    assert not pool.try_pin(3, seq) and not pool.pinned(3)  # rewritten since seq: nothing pinned


def test_a_closing_slot_writer_gives_up_a_copy_into_a_slot_a_reader_pins_for_good(pool: SharedSlots) -> None:
    """The transfer process's copy waits while the verifier pins its slot; a verifier that died
    pinning it never unpins. Closing the link must then end the copy at once, failed and naming the
    slot, the slot left as it was (it held the link's close for its 5 s join, and its copy thread
    spun on after that)."""
    from specter.experts.link import DEMAND, LinkError
    from specter.remote.counters import SharedCounters
    from specter.remote.transfer_server import SlotWriterLink

    counters = SharedCounters(pool.handle.prefix, create=True)
    try:
        seq = pool.write(1, (0, 1), torch.ones(16))
        assert pool.try_pin(1, seq)  # the reader pins it and never releases it
        link = SlotWriterLink(pool, counters, bandwidth=1e9)
        transfer = link.submit((0, 2), 1, torch.zeros(16), pool.storage[1], DEMAND)
        assert not transfer.done.wait(0.2)  # waiting for the pin
        link.close()
        assert transfer.done.is_set()  # close returned with the copy ended, not after its join's timeout
        with pytest.raises(LinkError, match=r"slot 1 of .* still pinned by a reader as its writer closes"):
            transfer.wait(1.0)
        assert pool.read(1) == ((0, 1), seq) and torch.all(pool.storage[1] == 1)
    finally:
        counters.close()
        counters.unlink()


def test_the_shared_index_says_where_an_expert_is_and_when_it_was_used(pool: SharedSlots) -> None:
    writer = SharedIndex(pool.handle.prefix, 3, 4, create=True)
    reader = SharedIndex(pool.handle.prefix, 3, 4, create=False)
    try:
        assert reader.slot((2, 3)) is None
        writer.set((2, 3), 5)
        assert reader.slot((2, 3)) == 5 and reader.slot((2, 2)) is None
        assert not writer.done((2, 3), 7)
        reader.mark_done((2, 3), 7)  # the verifier's table
        assert writer.done((2, 3), 7) and not writer.done((2, 3), 8)
        writer.clear((2, 3))
        assert reader.slot((2, 3)) is None
        writer.set((0, 0), 1)
        writer.clear_all()
        assert reader.slot((0, 0)) is None
        with pytest.raises(ValueError, match="expected at least one layer"):
            SharedIndex(pool.handle.prefix + "x", 0, 4, create=True)
    finally:
        reader.close()
        writer.close()


def test_bad_names_and_handles_are_clear_errors(pool: SharedSlots) -> None:
    with pytest.raises(SharedSlotsError, match="exists already"):
        SharedSlots.create(pool.handle.prefix, 1, 1, torch.float32)
    taken = new_prefix("spt-taken")
    squatter = SharedMemory(f"{taken}-data", create=True, size=8)
    try:
        with pytest.raises(SharedSlotsError, match="exists already"):
            SharedSlots.create(taken, 1, 1, torch.float32)
        assert _segments(taken) == [f"{taken}-data"]  # the failed create removed the table it made
    finally:
        squatter.close()
        squatter.unlink()
    with pytest.raises(SharedSlotsError, match="does not exist"):
        SharedSlots.attach(msgspec.structs.replace(pool.handle, table_name=new_prefix("spt-none")))
    with pytest.raises(SharedSlotsError, match="does not match"):
        SharedSlots.attach(msgspec.structs.replace(pool.handle, numel=17))
    with pytest.raises(ValueError, match="prefix"):
        SharedSlots.create("../x", 1, 1, torch.float32)
    with pytest.raises(ValueError, match="prefix"):
        unlink_prefix("")


def measure_publish_to_ready(n: int) -> list[float]:
    """Sorted seconds from publishing slot 0 here to seeing the peer's answer in slot 1."""
    slots = SharedSlots.create(new_prefix("spt-pong"), 2, NUMEL, torch.bfloat16)
    child = _child("pong", msgspec.json.encode(slots.handle).decode())
    blob, times = torch.zeros(NUMEL, dtype=torch.bfloat16), []
    try:
        for i in range(1, n + 1):
            t0 = time.perf_counter()
            slots.write(0, (0, i), blob)
            slots.wait_ready(1, (0, i), timeout_s=60)
            times.append(time.perf_counter() - t0)
    finally:
        child.kill()
        slots.close()
        slots.unlink()
    return sorted(times[100:])


if __name__ == "__main__":
    t = measure_publish_to_ready(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)
    pct = {p: t[min(int(p / 100 * len(t)), len(t) - 1)] * 1e6 for p in (50, 90, 99)}
    print(
        f"shm ping-pong (write 8 KiB + publish, peer waits and answers): p50 {pct[50]:.0f} µs, p90 {pct[90]:.0f} µs, p99 {pct[99]:.0f} µs"
    )


# -- the link counters: bytes, busy seconds and transfers read together ---------------------------


def test_the_link_counters_are_never_read_half_added() -> None:
    """A reader in another process sees the three counters of one moment: never a transfer's bytes without its
    count (a request's stats once showed one transfer more than its bytes), while the writer adds from two
    threads as a CUDA link's issuing and finishing threads do."""
    import threading

    from specter.remote.counters import SharedCounters

    prefix = new_prefix("spt-count")
    counters = SharedCounters(prefix, create=True)
    stop = threading.Event()

    def add(nbytes: int) -> None:
        while not stop.is_set():
            counters.add(nbytes, 1e-6)

    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from specter.remote.counters import SharedCounters
        counters, torn, reads = SharedCounters({prefix!r}, create=False), 0, 0
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            moved, _, transfers = counters.read()
            torn += moved != 1000 * transfers
            reads += 1
        print(torn, reads, flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    writers = [threading.Thread(target=add, args=(1000,)) for _ in range(2)]
    try:
        for writer in writers:
            writer.start()
        out, _ = reader.communicate(timeout=60)
    finally:
        stop.set()
        for writer in writers:
            writer.join()
    torn, reads = map(int, out.split())
    moved, _, transfers = counters.read()
    counters.close()
    assert reads > 100 and transfers > 100
    assert torn == 0 and moved == 1000 * transfers  # and no add lost between the two threads


def test_a_writer_killed_while_adding_does_not_hang_a_reader() -> None:
    from specter.remote.counters import SEQ, TORN_WAIT_S, SharedCounters

    counters = SharedCounters(new_prefix("spt-count"), create=True)
    try:
        counters.add(18432, 0.5)
        counters._words[SEQ] += 1  # a writer between its two sequence numbers, for good
        t0 = time.perf_counter()
        assert counters.read() == (18432, 0.5, 1)
        assert TORN_WAIT_S <= time.perf_counter() - t0 < 10
    finally:
        counters.close()


def test_a_roles_process_exits_quietly_from_a_finalizer_and_reports_any_other_error():
    """Ray's SIGTERM handler raises SystemExit wherever the main thread is; in a role's process, one
    raised inside a finalizer (a segment's ``__del__`` while the actor is killed) is the exit asked for
    and prints nothing, where Python printed a traceback. Another error in a finalizer is still shown."""
    code = """
import gc
from specter.remote.roles.base import setup_process

class Dies:
    def __init__(self, error):
        self.error = error
    def __del__(self):
        raise self.error

setup_process()
Dies(SystemExit(1))
Dies(ValueError("a real one"))
gc.collect()
print("still running")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "still running", out.stderr
    assert "SystemExit" not in out.stderr
    assert "Exception ignored in" in out.stderr and "ValueError: a real one" in out.stderr
