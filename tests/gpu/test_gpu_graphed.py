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
