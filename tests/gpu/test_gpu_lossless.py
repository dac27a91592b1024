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
    graphed = target.graphed
    assert graphed is not None and graphed.failure is None and graphed.captures > 0
    # the cut steps' experts in slots ran in captured slot graphs, one per split layer and token count
    assert all(len(p.slot_graphs) == len(graphed.splits) for p in graphed.pieces.values() if p.graphs)


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


@pytest.mark.parametrize("policy", ["specter", "specter-paper"])
def test_steps_captured_up_front_stay_token_identical(policy: str) -> None:
    """``Engine.prepare_steps`` captures every token count a round can use before the request (target
    1..K+1, draft 1..K+2; ``GraphedStep.prepare``): the request replays them (no step of it is cold)
    and still decodes transformers' tokens in fp32."""
    prompt, expected = _expected(DEFAULT_MODEL, torch.float32)
    target = OffloadedTarget.load(DEFAULT_MODEL, SlotConfig(fraction=0.25), LinkConfig(kind="cuda"), policy,
                                  device="cuda", dtype=torch.float32)
    try:
        draft = load_draft(f"{DEFAULT_MODEL}-awq", device="cuda", mode="dequant-cache")
        engine = Engine(target, draft, 8)
        assert engine.prepare_steps() == 9 + 10
        assert target.graphed is not None and target.graphed.captures == 9 and target.graphed.failure is None
        tokens, _ = engine.generate_fresh(prompt, NEW)
        assert target.graphed.captures == 9 and target.graphed.cold == 0  # replayed, none captured anew
        assert getattr(draft, "graphed", None) is None or draft.graphed.cold == 0  # type: ignore[attr-defined]
    finally:
        target.close()
    assert list(tokens[:NEW]) == expected, policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_resident_step_captured_whole_equals_transformers(dtype: torch.dtype) -> None:
    """Every expert resident: ``GraphedStep`` captures the whole step as one CUDA graph, the experts
    inside it (``_whole_pass``: each layer's experts from their slots, no read), so a step is one
    launch and the host's bookkeeping. Prepared up front, the request replays it (none cold) and
    decodes transformers' tokens (fp32; bf16 where margins are clear: the same kernels as the
    cut steps' resident layers)."""
    prompt, expected = _expected(DEFAULT_MODEL, dtype)
    target = OffloadedTarget.load(DEFAULT_MODEL, SlotConfig(fraction=1.0), LinkConfig(kind="cuda"), "demand-lru",
                                  device="cuda", dtype=dtype)
    try:
        engine = Engine(target, None, 0)
        assert engine.prepare_steps() == 1
        graphed = target.graphed
        assert graphed is not None and graphed.failure is None and graphed.captures == 1
        assert len(graphed.whole[1].graphs) == 1 and not graphed.pieces  # one graph, no cut pieces
        tokens, stats = engine.generate_fresh(prompt, NEW)
        assert graphed.captures == 1 and graphed.cold == 0 and not graphed.pieces
        assert stats.extra["host_reads"] <= NEW  # a read a step at most (the routing's bookkeeping, the token)
    finally:
        target.close()
    assert list(tokens[:NEW]) == expected, dtype
