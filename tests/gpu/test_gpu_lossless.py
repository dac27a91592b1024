"""On a GPU (skipped without CUDA, collected everywhere so it cannot rot): the in-process engine on
the device, experts in pinned host memory moving over the CUDA copy stream, is token-identical to
transformers' greedy ``generate`` on the same device, for both trained models and every policy, at
a budget small enough that the link really runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.assets import COARSE_MODEL, DEFAULT_MODEL
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.eval.prompts import load_prompts
from specter.models.greedy import greedy_continuation
from specter.plan import POLICIES, drafts
from specter.target import OffloadedTarget

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = 24


def _expected(model, dtype: torch.dtype) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    prompt = load_prompts(model, None, 1)[0]
    reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        return prompt, greedy_continuation(reference, prompt, NEW)


@pytest.mark.parametrize("model", [DEFAULT_MODEL, COARSE_MODEL], ids=lambda m: m.name)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_on_the_gpu_equals_transformers(model, policy: str) -> None:  # type: ignore[no-untyped-def]
    """fp32 on the device: the one-pass verify of K+1 positions and one-token decoding agree there,
    as on the CPU (bf16 is checked for plain decoding below)."""
    prompt, expected = _expected(model, torch.float32)
    target = OffloadedTarget.load(model, SlotConfig(fraction=0.25), LinkConfig(kind="cuda"), policy,
                                  device="cuda", dtype=torch.float32)
    try:
        window = 8 if drafts(policy) else 0
        draft = load_draft(f"{model}-awq", device="cuda", mode="dequant-cache") if window else None
        tokens, stats = Engine(target, draft, window).generate_fresh(prompt, NEW)
    finally:
        target.close()
    assert list(tokens[:NEW]) == expected, policy
    assert stats.bytes_moved > 0  # the link ran
    assert target.graphed is not None and target.graphed.failure is None and target.graphed.captures > 0


@pytest.mark.parametrize("model", [DEFAULT_MODEL, COARSE_MODEL], ids=lambda m: m.name)
def test_plain_decoding_in_bf16_equals_transformers_in_bf16(model) -> None:  # type: ignore[no-untyped-def]
    prompt, expected = _expected(model, torch.bfloat16)
    target = OffloadedTarget.load(model, SlotConfig(fraction=0.25), LinkConfig(kind="cuda"), "demand-lru",
                                  device="cuda", dtype=torch.bfloat16)
    try:
        tokens, _ = Engine(target, None, 0).generate_fresh(prompt, NEW)
    finally:
        target.close()
    assert list(tokens[:NEW]) == expected
