"""On a GPU (skipped without CUDA, collected everywhere so it cannot rot): continuous batching on the
device — the target's batched step over several KV caches, and for a drafting policy the draft's
batched forward (``propose_together``: per-request ``DynamicCache``s, never the graphed draft's one
static cache) — gives each request transformers' greedy tokens in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.assets import DEFAULT_MODEL
from specter.batching import Batcher
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.eval.prompts import load_prompts
from specter.models.greedy import greedy_continuation
from specter.request import BatchRequest
from specter.target import OffloadedTarget

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = [20, 12, 16]


@pytest.mark.parametrize("policy", ["demand-lru", "specter"])
def test_batched_requests_on_the_gpu_equal_transformers(policy: str) -> None:
    prompts = load_prompts(DEFAULT_MODEL, None, len(NEW))
    reference = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():
        expected = [greedy_continuation(reference, p, n) for p, n in zip(prompts, NEW, strict=True)]
    del reference
    target = OffloadedTarget.load(DEFAULT_MODEL, SlotConfig(fraction=0.25), LinkConfig(kind="cuda"), policy,
                                  device="cuda", dtype=torch.float32)
    draft = load_draft(f"{DEFAULT_MODEL}-awq", device="cuda", mode="dequant-cache") if policy == "specter" else None
    try:
        results = Batcher(target, max_batch=3, draft=draft).run(
            [BatchRequest(p, n) for p, n in zip(prompts, NEW, strict=True)])
    finally:
        target.close()
    assert [list(tokens) for tokens, _ in results] == [list(e[:n]) for e, n in zip(expected, NEW, strict=True)]
    assert max(stats.extra["mean_batch"] for _, stats in results) > 2
    assert sum(stats.bytes_moved for _, stats in results) > 0  # the link ran
