"""On a GPU (skipped without CUDA, collected everywhere so it cannot rot): shared slots on the device
between two processes (``specter/remote/cuda_slots.py``): the storage shared by CUDA IPC, a reader's compute
ordered after the writer's copy by the slot's copy event, and the writer's next copy ordered after the
reader's kernels by the slot's reader event, with no host sync for either."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from specter.remote.segments import new_prefix
from specter.remote.shm import SharedSlots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUMEL = 4096

# The other process. "peer": write slot 0, then read slot 1 once the parent has written it.
# "late-reader": read slot 0 on a stream held back by a long kernel, and unpin it at once.
CHILD = textwrap.dedent(
    """
    import sys, msgspec, torch
    from specter.remote.shm import SharedSlots, SlotsHandle
    mode, arg = sys.argv[1], sys.argv[2]
    slots = SharedSlots.attach(msgspec.json.decode(arg, type=SlotsHandle))
    n = slots.numel
    if mode == "peer":
        slots.write(0, (1, 2), (torch.arange(n) % 100).to(slots.dtype).to("cuda"))
        slots.acquire(1, (5, 6), timeout_s=60)
        ok = torch.equal(slots.storage[1].cpu(), torch.full((n,), 7, dtype=slots.dtype))
        slots.release(1)
        print("read-ok" if ok else "read-wrong", flush=True)
    if mode == "late-reader":
        slots.acquire(0, (1, 1), timeout_s=60)
        torch.cuda._sleep(int(5e8))  # the stream reaches the read well after the unpin below
        seen = slots.storage[0].clone()
        slots.release(0)  # records the reader event: the writer's copy waits for the clone
        print("released", flush=True)
        torch.cuda.synchronize()
        print("old-ok" if bool((seen == 1).all()) else "overwritten", flush=True)
    slots.close()
    """
)


def _child(mode: str, slots: SharedSlots) -> subprocess.Popen[str]:
    handle = msgspec.json.encode(slots.handle).decode()
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, handle], stdout=subprocess.PIPE, text=True)


def test_cuda_slots_shared_with_another_process() -> None:
    slots = SharedSlots.create(new_prefix("spt-cuda"), 3, NUMEL, torch.bfloat16, device="cuda")
    child = _child("peer", slots)
    try:
        slots.acquire(0, (1, 2), timeout_s=60)
        assert torch.equal(slots.storage[0].cpu(), (torch.arange(NUMEL) % 100).to(torch.bfloat16))
        slots.release(0)
        slots.write(1, (5, 6), torch.full((NUMEL,), 7, dtype=torch.bfloat16, device="cuda"))
        assert child.stdout is not None and child.stdout.readline().strip() == "read-ok"
        assert child.wait(60) == 0
    finally:
        child.kill()
    slots.close()
    slots.unlink()


def test_a_copy_into_a_slot_waits_for_the_kernels_of_its_last_reader_in_another_process() -> None:
    """The reader unpins a slot while its stream has not yet read it (a long kernel ahead of the read);
    the writer claims the slot at once and copies over it on a copy stream that waits on the slot's
    reader event: the reader still sees the old bytes, and neither side synced the host for it."""
    slots = SharedSlots.create(new_prefix("spt-cuda"), 2, NUMEL, torch.bfloat16, device="cuda")
    child = _child("late-reader", slots)
    try:
        slots.write(0, (1, 1), torch.ones(NUMEL, dtype=torch.bfloat16, device="cuda"))
        assert child.stdout is not None and child.stdout.readline().strip() == "released"
        new = torch.full((NUMEL,), 2, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        copies = torch.cuda.Stream()
        assert slots.begin_write(0)  # unpinned: the writer may claim it now
        slots.wait_reader(0, copies)
        with torch.cuda.stream(copies):
            slots.storage[0].copy_(new, non_blocking=True)
        slots.publish(0, (2, 2), stream=copies)
        assert child.stdout.readline().strip() == "old-ok"
        assert child.wait(60) == 0
        copies.synchronize()
        assert bool((slots.storage[0] == 2).all())
    finally:
        child.kill()
    slots.close()
    slots.unlink()


def test_a_closing_cuda_slot_writer_gives_up_a_copy_into_a_slot_a_reader_pins_for_good() -> None:
    """As on the CPU (``tests/test_shm.py``): the verifier died pinning a slot; closing the transfer
    process's CUDA link ends the copy waiting for it at once, failed and naming the slot, and the
    demand stops counting as outstanding."""
    from specter.experts.link import DEMAND, LinkError
    from specter.remote.counters import SharedCounters
    from specter.remote.cuda_link import CudaSlotWriterLink

    slots = SharedSlots.create(new_prefix("spt-cuda"), 2, NUMEL, torch.bfloat16, device="cuda")
    counters = SharedCounters(slots.handle.prefix, create=True)
    try:
        seq = slots.write(1, (0, 1), torch.ones(NUMEL, dtype=torch.bfloat16, device="cuda"))
        assert slots.try_pin(1, seq)
        link = CudaSlotWriterLink(slots, counters)
        blob = torch.zeros(NUMEL, dtype=torch.bfloat16).pin_memory()
        transfer = link.submit((0, 2), 1, blob, slots.storage[1], DEMAND)
        assert not transfer.done.wait(0.2)
        link.close()
        assert transfer.done.is_set()
        with pytest.raises(LinkError, match=r"slot 1 of .* still pinned by a reader as its writer closes"):
            transfer.wait(1.0)
        assert slots.read(1) == ((0, 1), seq) and bool((slots.storage[1] == 1).all())
        assert link.demand_outstanding_s > 0 and not link._demands  # counted once, and no longer
    finally:
        counters.close()
        counters.unlink()
        slots.close()
        slots.unlink()
