"""The draft's three compute modes give the same numbers; the int4 kernel path is the real kernel."""

from __future__ import annotations

import pytest
import torch

from specter.draft.format.qweight import quantize_weight
from specter.draft.kernels import (
    CACHE_SHARE,
    ExpertKernels,
    choose_mode,
    device_mode,
    kernel_accepts,
    time_modes,
)
from specter.draft.runner import DraftModel

CPU = torch.device("cpu")


def _expert(gen: torch.Generator, hidden: int = 64, inter: int = 32, awq: bool = True):
    s = (torch.rand(hidden, generator=gen) + 0.5) if awq else None
    gate = quantize_weight(torch.randn(inter, hidden, generator=gen), 4, 64, torch.float32, s)
    up = quantize_weight(torch.randn(inter, hidden, generator=gen), 4, 64, torch.float32, s)
    s_down = (torch.rand(inter, generator=gen) + 0.5) if awq else None
    down = quantize_weight(torch.randn(hidden, inter, generator=gen), 4, 32, torch.float32, s_down)
    return gate, up, down


@pytest.mark.parametrize("awq", [True, False])
def test_modes_agree_on_one_expert(awq: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    expert = _expert(gen, awq=awq)
    x = torch.randn(5, 64, generator=gen)
    outs = {}
    for mode in ("int4-kernel", "dequant-cache", "dequant-on-the-fly"):
        kernels = ExpertKernels({(0, 0): expert}, mode, torch.float32, CPU)
        assert kernels.kernel_fallbacks == 0
        mid = kernels.gate_up((0, 0), x)
        outs[mode] = (mid, kernels.down((0, 0), mid[:, :32]))
    ref = outs["dequant-cache"]
    for mode in ("int4-kernel", "dequant-on-the-fly"):
        torch.testing.assert_close(outs[mode][0], ref[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[mode][1], ref[1], rtol=1e-4, atol=1e-3)


def test_kernel_shape_rules_and_fallback() -> None:
    gen = torch.Generator().manual_seed(1)
    assert kernel_accepts(quantize_weight(torch.randn(32, 64, generator=gen), 4, 64, torch.float32))
    assert not kernel_accepts(quantize_weight(torch.randn(24, 64, generator=gen), 4, 64, torch.float32))
    assert not kernel_accepts(quantize_weight(torch.randn(32, 64, generator=gen), 4, 16, torch.float32))
    assert not kernel_accepts(quantize_weight(torch.randn(32, 64, generator=gen), 8, 64, torch.float32))
    gate, up, _ = _expert(gen)
    odd_down = quantize_weight(torch.randn(64, 32, generator=gen), 4, 16, torch.float32)
    kernels = ExpertKernels({(0, 0): (gate, up, odd_down)}, "int4-kernel", torch.float32, CPU)
    assert kernels.kernel_fallbacks == 1


def test_int4_kernel_runs_on_a_cpu_or_cuda_and_modes_are_checked() -> None:
    expert = _expert(torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="cpu or cuda"):
        ExpertKernels({(0, 0): expert}, "int4-kernel", torch.float32, torch.device("meta"))
    with pytest.raises(ValueError, match="mode"):
        ExpertKernels({(0, 0): expert}, "auto", torch.float32, CPU)


def test_auto_measures_and_picks_a_mode() -> None:
    expert = _expert(torch.Generator().manual_seed(3))
    timings = time_modes(expert, torch.float32, CPU, tokens=1, repeat=3)
    assert set(timings) == {"int4-kernel", "dequant-cache", "dequant-on-the-fly"}
    assert all(t > 0 for t in timings.values())
    mode, _ = choose_mode(expert, torch.float32, CPU)
    assert mode in ("int4-kernel", "dequant-cache")


def test_auto_on_a_gpu_keeps_the_dequantized_cache_only_where_it_is_small_beside_the_free_memory() -> None:
    """Each expert's bf16 copies: (2 x 32 x 64 + 64 x 32) weights x 2 bytes = 12 KiB. A draft whose copies take
    more than a tenth of the free memory holds its experts in int4, where the kernel takes them (bf16
    compute, its shapes); otherwise, or where it does not, the copies."""
    gen = torch.Generator().manual_seed(4)
    expert = _expert(gen)
    copies = (2 * 32 * 64 + 64 * 32) * 2 * 100  # 100 experts
    assert CACHE_SHARE == 0.1
    assert device_mode(expert, torch.bfloat16, 100, free_bytes=10 * copies) == "dequant-cache"  # exactly a tenth
    assert device_mode(expert, torch.bfloat16, 100, free_bytes=10 * copies - 1) == "int4-kernel"
    assert device_mode(expert, torch.float32, 100, free_bytes=copies) == "dequant-cache"  # CUDA's kernel is bf16's
    odd = (*expert[:2], quantize_weight(torch.randn(64, 32, generator=gen), 4, 16, torch.float32))
    assert device_mode(odd, torch.bfloat16, 100, free_bytes=copies) == "dequant-cache"  # group 16: no kernel


def test_draft_model_int4_kernel_matches_dequant(draft_dir) -> None:
    folder = draft_dir("kernel", "awq")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    kernel = DraftModel.load(folder, device="cpu", mode="int4-kernel")
    assert kernel.kernels.kernel_fallbacks == 0
    dense = DraftModel.load(folder, device="cpu", mode="dequant-cache")
    fly = DraftModel.load(folder, device="cpu", mode="dequant-on-the-fly")
    ref = dense.forward(ids)
    torch.testing.assert_close(kernel.forward(ids), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fly.forward(ids), ref, rtol=1e-5, atol=1e-5)
    assert kernel.packed_bytes == dense.packed_bytes < dense.kernels.nbytes


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_an_int4_step_gathers_its_experts_without_a_read_and_matches_the_expert_loop(draft_dir, method) -> None:
    """In ``int4-kernel`` a step's routed experts are gathered by their device-side ids (``Int4Layer``):
    the same kernel per expert as the loop that reads the routing (only the sum's order differs), no
    read of device data beyond the step's one (routing and token together), the step graphable
    (``static``: the pieces a GPU captures, run eagerly), and the experts held once, in int4."""
    from specter.models.routing import router_modules
    from specter.timing.dispatch import DispatchCount

    folder = draft_dir("kernel", method)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    gathered = DraftModel.load(folder, device="cpu", mode="int4-kernel")
    looped = DraftModel.load(folder, device="cpu", mode="int4-kernel", grouped=False)
    static = DraftModel.load(folder, device="cpu", mode="int4-kernel", step="static")
    cache = DraftModel.load(folder, device="cpu", mode="dequant-cache")
    assert set(gathered.kernels.gathered) == set(router_modules(gathered.model))  # every MoE layer
    assert static.step_mode == "static"
    layer = next(iter(gathered.kernels.gathered.values()))
    first = gathered.kernels._gate_up[(min(gathered.kernels.gathered), 0)]
    assert first.packed.data_ptr() == layer.packed.stack[0].data_ptr()  # the experts' views of the stack
    assert gathered.kernels.nbytes * 3 < cache.kernels.nbytes  # int4 on the device, not the cache
    caches = [m.new_cache() for m in (gathered, looped, static, cache)]
    for model, kv in zip((gathered, looped, static, cache), caches, strict=True):
        model.forward(prompt, kv)
    # what the as-built clock charges: a prompt's pairs go through the loop, once per distinct expert
    assert set(gathered.last_compute.values()) == set(looped.last_compute.values()) == {"int4"}
    assert set(gathered.last_compute) == set(gathered.last_routing)
    assert set(cache.last_compute.values()) == {"bf16"}
    for step in ([[7]], [[31]], [[3, 90]]):  # one token, another, a round's catch-up of two
        ids = torch.tensor(step)
        with DispatchCount() as counted:
            got = gathered.forward(ids, caches[0])
        with DispatchCount() as counted_cache:
            want_cache = cache.forward(ids, caches[3])
        want = looped.forward(ids, caches[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static.forward(ids, caches[2]), got, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want_cache, rtol=1e-3, atol=1e-3)
        assert counted.reads == counted_cache.reads == 1  # the step's routing and token, in one read
        assert set(gathered.last_compute.values()) == set(static.last_compute.values()) == {"int4-gathered"}
        assert set(looped.last_compute.values()) == {"int4"} and set(cache.last_compute.values()) == {"bf16"}


def test_speculation_with_a_gathered_int4_draft_is_the_targets_greedy_output(plain_dir, draft_dir) -> None:
    from transformers import AutoModelForCausalLM

    from specter.config import LinkConfig, SlotConfig
    from specter.engine import Engine
    from specter.target import OffloadedTarget

    folder, prompt = plain_dir("kernel"), [5, 99, 17, 42, 8, 63, 21]
    reference = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    draft = DraftModel.load(draft_dir("kernel", "awq"), device="cpu", mode="int4-kernel", step="static")
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LinkConfig(bandwidth=2e9, latency=5e-6),
                                  "specter+fixed")
    try:
        tokens, stats = Engine(target, draft, 4).generate_fresh(prompt, 12)
    finally:
        target.close()
    assert tokens == want[0, len(prompt):].tolist()
    assert stats.extra["drafted"] > 0


@pytest.mark.parametrize("scaled", ["none", "some", "all"])
def test_a_gathered_layer_gathers_once_per_stack_and_matches_each_expert_alone(scaled: str) -> None:
    """``Int4Layer`` keeps each expert's gate_up and down side by side in one row per stack, so a step
    gathers once per stack (codes, scales, inverse AWQ scales where any expert has them); an expert
    without the AWQ scales the others have gets ones in its row (a published checkpoint may scale some
    experts only). Each pair's output is its expert's own, computed alone."""
    from specter.draft.kernels import Int4Layer
    from specter.timing.dispatch import DispatchCount

    gen = torch.Generator().manual_seed(3)
    experts = {(0, e): _expert(gen, awq=scaled == "all" or scaled == "some" and e != 1) for e in range(4)}
    kernels = ExpertKernels(experts, "int4-kernel", torch.float32, CPU)
    layer = kernels.gathered[0]
    assert isinstance(layer, Int4Layer) and (layer.inv is None) == (scaled == "none")
    hidden = torch.randn(2, 64, generator=gen)
    ids = torch.tensor([[1, 3], [0, 1]])
    weights = torch.rand(2, 2, generator=gen)
    with DispatchCount() as counted:
        got = layer(hidden, ids, weights, torch.nn.functional.silu)
    assert counted.kernels_by_name["index_select"] == (2 if scaled == "none" else 3)
    assert counted.kernels_by_name["_weight_int4pack_mm_for_cpu"] == 2 * ids.numel() and counted.reads == 0
    want = torch.zeros(2, 64)
    for t in range(2):
        for j in range(2):
            key = (0, int(ids[t, j]))
            gate, up = kernels.gate_up(key, hidden[t : t + 1]).chunk(2, dim=-1)
            want[t] += weights[t, j] * kernels.down(key, torch.nn.functional.silu(gate) * up)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
