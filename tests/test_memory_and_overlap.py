"""The memory plan sizes the slot pool from what is left; copies overlap compute for real."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import FAMILIES
from transformers import AutoModelForCausalLM, DynamicCache

from specter.config import LinkConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.experts.link import DEMAND, SimulatedLink
from specter.memory import kv_bytes_per_token, plan_memory
from specter.models.loader import build_dense
from specter.target import MemoryRequest, OffloadedTarget


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_estimate_equals_what_transformers_caches(family, tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir(family), experts_implementation="eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == 6 * kv_bytes_per_token(model.config, 4)


def test_plan_gives_slots_what_is_left_and_says_how_much_is_missing(tiny_dir):
    loaded = build_dense(tiny_dir("mixtral"))
    expert = loaded.shape.nbytes
    plan = plan_memory(8 * 2**20, loaded, draft_bytes=100_000, max_context=256, window=4)
    fixed = plan.dense + plan.draft + plan.kv + plan.buffers + plan.margin
    assert plan.slots == min(24, (plan.device - fixed) // expert) and plan.slots >= 2
    assert plan.dense == loaded.dense_bytes and "expert slots" in plan.describe()
    with pytest.raises(ValueError, match=r"short by"):
        plan_memory(plan.dense + plan.draft, loaded, draft_bytes=100_000, max_context=256, window=4)


def test_target_sized_by_device_memory(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    loaded = build_dense(folder)
    size = loaded.dense_bytes + 600_000
    target = OffloadedTarget.load(folder, None, LinkConfig(), memory=MemoryRequest(size, max_context=64))
    try:
        assert target.memory_plan is not None
        assert target.offload.pool.num_slots == target.memory_plan.slots
    finally:
        target.close()


def test_link_moves_while_the_caller_computes():
    link = SimulatedLink(bandwidth=1e8, latency=0.0)  # 2 MB: 20 ms
    transfer = link.submit((0, 0), 0, torch.zeros(500_000), torch.empty(500_000), DEMAND)
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    while not transfer.done.is_set() and time.perf_counter() - t0 < 60:  # only a hang reaches 60 s
        a = torch.tanh(a @ a)  # the compute thread never waits on the link
    assert transfer.done.is_set()
    link.close()


def test_prefetches_move_while_the_draft_drafts(tiny_dir):
    """With a draft policy, transfers are issued and land before the verify pass begins."""
    folder = tiny_dir("mixtral")
    target = OffloadedTarget.load(folder, SlotConfig(experts=4), LinkConfig(kind="sim", bandwidth=2e9), "specter")
    seen: list[int] = []
    begin_verify = target.offload.policy.begin_verify

    def spy(round_id: int, positions: int) -> None:
        seen.append(target.link.transfers + target.link.queued())
        begin_verify(round_id, positions)

    target.offload.policy.begin_verify = spy  # type: ignore[method-assign]
    try:
        Engine(target, ResidentDraft(folder), 4).generate_fresh([5, 9, 3], 12)
    finally:
        target.close()
    assert any(b > a for a, b in zip(seen, seen[1:], strict=False))
