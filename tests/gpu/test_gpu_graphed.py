"""On a GPU (skipped without CUDA): the draft's one-token step replayed as a CUDA graph
(``models/graphed.py``) computes what the eager lean step computes — the same routing and the same
logits to rounding, step after step, through catch-ups, crops and a capacity that doubles (a new
capture) — and a speculative engine with it stays token-identical to transformers."""

from __future__ import annotations

import pytest
import torch

from specter.assets import DEFAULT_MODEL
from specter.draft.runner import DraftModel
from specter.models.graphed import StaticKV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = (1, 1, 2, 1, 3, "crop", 1, 2, "crop") + (1,) * 12


def test_the_graphed_draft_step_computes_the_eager_step() -> None:
    folder = f"{DEFAULT_MODEL}-awq"
    graphed = DraftModel.load(folder, device="cuda", mode="dequant-cache", dtype=torch.float32, step="graph")
    eager = DraftModel.load(folder, device="cuda", mode="dequant-cache", dtype=torch.float32, step="eager")
    assert graphed.graphed is not None and graphed.step_mode == "graph"
    graphed.graphed.cache = StaticKV.for_model(graphed.model, capacity=16)  # outgrown below: a second capture
    gen = torch.Generator().manual_seed(5)
    caches = {id(m): m.new_cache() for m in (graphed, eager)}
    prompt = torch.randint(0, 4096, (1, 9), generator=gen)
    for model in (graphed, eager):
        model.forward(prompt, caches[id(model)])
    for step in STEPS:
        if step == "crop":
            for model in (graphed, eager):
                cache = caches[id(model)]
                model.crop(cache, cache.get_seq_length() - 2)
            continue
        ids = torch.randint(0, 4096, (1, int(step)), generator=gen)
        want, want_routing = eager.forward(ids, caches[id(eager)]), dict(eager.last_routing)
        got, got_routing = graphed.forward(ids, caches[id(graphed)]), dict(graphed.last_routing)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        assert got_routing.keys() == want_routing.keys()
        for layer, (ids_want, _) in want_routing.items():
            assert torch.equal(got_routing[layer][0], ids_want), layer
        assert graphed.last_token == eager.last_token
    # captured on a token count's second step: T 1 at capacity 16, T 1 again at 32, then T 2
    assert graphed.graphed.failure is None
    assert graphed.graphed.captures == 3 and graphed.graphed.cache.capacity == 32


def test_the_int4_draft_on_the_device_gathers_its_experts_inside_the_graph() -> None:
    """``int4-kernel`` on CUDA: every expert in the kernel's int4 layout on the device (a quarter of the
    dequantized cache), a step's routed experts gathered by their device-side ids inside the captured
    graph (no read), its logits those of the eager int4 step and, to bf16 rounding, of the cache."""
    folder = f"{DEFAULT_MODEL}-awq"
    graphed = DraftModel.load(folder, device="cuda", mode="int4-kernel", dtype=torch.bfloat16, step="graph")
    eager = DraftModel.load(folder, device="cuda", mode="int4-kernel", dtype=torch.bfloat16, step="eager")
    cache = DraftModel.load(folder, device="cuda", mode="dequant-cache", dtype=torch.bfloat16, step="eager")
    assert graphed.kernels.gathered and graphed.kernels.kernel_fallbacks == 0
    assert graphed.kernels.nbytes * 3 < cache.kernels.nbytes
    gen = torch.Generator().manual_seed(6)
    caches = {id(m): m.new_cache() for m in (graphed, eager, cache)}
    prompt = torch.randint(0, 4096, (1, 9), generator=gen)
    for model in (graphed, eager, cache):
        model.forward(prompt, caches[id(model)])
    for step in (1, 1, 2, 1, 1, 2, 1, 1):
        ids = torch.randint(0, 4096, (1, step), generator=gen)
        want = eager.forward(ids, caches[id(eager)])
        got = graphed.forward(ids, caches[id(graphed)])
        dense = cache.forward(ids, caches[id(cache)])
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, dense, rtol=5e-2, atol=5e-2)
    assert graphed.graphed is not None and graphed.graphed.failure is None and graphed.graphed.captures >= 2


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_norms_and_routing_weights_on_the_device_are_transformers_bit_for_bit(family, tiny_dir) -> None:  # type: ignore[no-untyped-def]
    """``tests/test_dispatch.py``'s check on the device's kernels: ``F.rms_norm`` on a bf16 input (one fused
    kernel that rounds its own output) is transformers' RMSNorm, and a renormalizing router's weights,
    divided straight into bf16, are its weights cast, bit for bit."""
    from transformers import AutoModelForCausalLM

    from specter.models.decode import LeanStep, _rms

    model = AutoModelForCausalLM.from_pretrained(tiny_dir(family), experts_implementation="eager",
                                                 dtype=torch.bfloat16).cuda().eval()
    lean = LeanStep.for_model(model, family, fused=True)
    assert lean is not None and lean.fused is not None
    layer = model.model.layers[0]
    x = (torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 4).to(
        device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        normed = _rms(layer.post_attention_layernorm, x)
        _, ids, weights, _ = lean.fused[0].route(normed)
        want = layer.post_attention_layernorm(x)
        _, want_weights, want_ids = layer.mlp.gate(want.view(5, -1))
    assert torch.equal(normed, want)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights.to(torch.bfloat16))
