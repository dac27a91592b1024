"""A layer's experts in grouped calls over the slot pool equal transformers' eager experts loop."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from specter.experts.grouped import (
    LayerRoutes,
    PairOutputs,
    grouped_linear,
    planned_pairs,
    resident_experts,
    weighted_sum,
)
from specter.experts.store import ExpertShape
from specter.timing.dispatch import DispatchCount


def _experts(num: int, hidden: int, inter: int, seed: int) -> Qwen2MoeExperts:
    config = Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    module = Qwen2MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.2)
        module.down_proj.normal_(0, 0.2)
    module.config = config
    return module.eval()


def _pool(module: Qwen2MoeExperts, slot_of: dict[int, int], slots: int) -> tuple[torch.Tensor, ExpertShape]:
    """A slot pool holding ``module``'s experts where ``slot_of`` says (the other slots garbage)."""
    shape = ExpertShape(module.hidden_dim, module.intermediate_dim, torch.float32)
    storage = torch.randn(slots, shape.numel)
    with torch.no_grad():
        for expert, slot in slot_of.items():
            gate_up, down = shape.split(storage[slot])
            gate_up.copy_(module.gate_up_proj[expert])
            down.copy_(module.down_proj[expert])
    return storage, shape


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (9, 64, 4), (40, 6, 3)])
def test_grouped_calls_equal_the_eager_loop(tokens, experts, top_k):
    """Resident experts in one call, late ones one call each, one from its own weights (the host's):
    the layer's output is transformers' eager loop's, whatever the slots and the order."""
    module = _experts(experts, 16, 12, seed=tokens)
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 16, generator=generator)
    scores = torch.rand(tokens, experts, generator=generator).softmax(-1)
    weights, index = scores.topk(top_k, dim=-1)
    with torch.no_grad():
        expected = module(hidden, index, weights)
    routes = LayerRoutes(index)
    assert routes.needed == sorted(set(index.flatten().tolist()))
    assert all(routes.count(e) == int((index == e).sum()) for e in range(experts))
    slot_ids = torch.randperm(experts + 5, generator=generator).tolist()
    slot_of = {e: slot_ids[i] for i, e in enumerate(routes.needed)}
    storage, shape = _pool(module, slot_of, experts + 5)
    outputs = PairOutputs(hidden, routes, weights, module.act_fn)
    needed = routes.needed
    host, late, ready = needed[:1], needed[1:3], needed[3:]
    outputs.from_slots(storage, shape, {e: slot_of[e] for e in ready})
    for e in reversed(late):
        outputs.from_slots(storage, shape, {e: slot_of[e]})
    for e in host:
        outputs.from_blob(e, module.gate_up_proj[e].detach(), module.down_proj[e].detach())
    torch.testing.assert_close(outputs.total(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", [True, False])
def test_padded_plans_fill_a_layer_in_calls_of_one_shape(kernel):
    """What a graphed step's slot graph replays (``planned_pairs`` over a padded ``PairOutputs.plan``):
    the ready experts, then each late one, then one from the host, every call of the same shapes;
    each call writes its experts' rows and no other (the rest stay as they were: NaN here), and the
    layer's output is transformers' eager loop's. ``kernel`` False: the fallback without ``grouped_mm``."""
    from specter.experts import grouped

    module = _experts(12, 16, 12, seed=3)
    generator = torch.Generator().manual_seed(3)
    tokens, top_k = 5, 3
    hidden = torch.randn(tokens, 16, generator=generator)
    weights, index = torch.rand(tokens, 12, generator=generator).softmax(-1).topk(top_k, dim=-1)
    with torch.no_grad():
        expected = module(hidden, index, weights)
    routes = LayerRoutes(index)
    slot_ids = torch.randperm(20, generator=generator).tolist()
    slot_of = {e: slot_ids[i] for i, e in enumerate(routes.needed)}
    storage, shape = _pool(module, slot_of, 20)
    gate_up, down = shape.split_rows(storage)
    buffer = torch.full((tokens * top_k + 1, 16), float("nan"))  # the pairs, then the scratch row
    outputs = PairOutputs(hidden, routes, weights, module.act_fn, buffer[:-1])
    needed = routes.needed
    host, late, ready = needed[:1], needed[1:3], needed[3:]
    before = dict(grouped._GROUPED_OK)
    if not kernel:
        grouped._GROUPED_OK[("cpu", torch.float32)] = False
    try:
        plans = []
        for group in (ready, *[[e] for e in late]):
            plan = outputs.plan({e: slot_of[e] for e in group}, 20, padded=True)
            plans.append(plan)
            planned_pairs(hidden, torch.from_numpy(plan), gate_up, down, module.act_fn, buffer)
            done = set(ready) | {e for g in [[e] for e in late][: len(plans) - 1] for e in g}
            filled = ~torch.isnan(buffer[:-1]).any(dim=-1)
            assert filled.tolist() == [e in done for e in index.reshape(-1).tolist()]
    finally:
        grouped._GROUPED_OK.clear()
        grouped._GROUPED_OK.update(before)
    assert len({plan.shape for plan in plans}) == 1 and plans[0].shape == (2 * tokens * top_k + 20,)
    for e in host:
        outputs.from_blob(e, module.gate_up_proj[e].detach(), module.down_proj[e].detach())
    total = weighted_sum(buffer[:-1].view(tokens, top_k, -1), weights, None)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"out: expected the layer's \(15, 16\) pair outputs"):
        PairOutputs(hidden, routes, weights, module.act_fn, buffer)


def test_a_resident_layer_is_a_few_ops_and_one_read():
    """All experts resident: one read of the routing and a fixed count of ops whatever top-k is."""
    module = _experts(32, 16, 12, seed=5)
    storage, shape = _pool(module, {e: e for e in range(32)}, 32)
    hidden = torch.randn(1, 16)
    counts = {}
    for top_k in (2, 8):
        weights, index = torch.rand(1, 32).softmax(-1).topk(top_k, dim=-1)
        with DispatchCount() as counted:
            routes = LayerRoutes(index)
            outputs = PairOutputs(hidden, routes, weights, module.act_fn)
            outputs.from_slots(storage, shape, {e: e for e in routes.needed})
            outputs.total()
        counts[top_k] = (counted.ops, counted.reads)
    assert counts[2] == counts[8]
    assert counts[2][1] == 1 and counts[2][0] <= 9, counts


@pytest.mark.parametrize("tokens", [1, 5])
def test_resident_experts_equal_the_eager_loop_and_one_token_gathers_no_rows(tokens):
    """``resident_experts`` (a draft's stacked experts, or a target layer all in slots through its
    device-side slot map) is transformers' eager loop's output; a one-token step (every decode step,
    every draft step) takes its pairs' rows as copies of the token's, without the division and the
    gather a pass of several tokens needs."""
    experts, top_k = 12, 3
    module = _experts(experts, 16, 12, seed=tokens)
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 16, generator=generator)
    weights, index = torch.rand(tokens, experts, generator=generator).softmax(-1).topk(top_k, dim=-1)
    residual = torch.randn(tokens, 16, generator=generator)
    with torch.no_grad():
        expected = residual + module(hidden, index, weights)
    slot_ids = torch.randperm(experts + 4, generator=generator).tolist()[:experts]
    storage, shape = _pool(module, dict(enumerate(slot_ids)), experts + 4)
    gate_up, down = shape.split_rows(storage)
    with torch.inference_mode(), DispatchCount() as counted:
        got = resident_experts(hidden, index, weights, gate_up, down, module.act_fn, residual,
                               slot_map=torch.tensor(slot_ids))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert ("div" in counted.by_name) == (tokens > 1), counted.by_name


def test_one_tokens_pair_rows_given_are_taken_as_they_are_and_checked():
    """A one-token layer whose pair rows the caller made (``_Fused.moe_input``: the norm's output, the
    token's row k times) is the layer computed from the token alone, bit for bit, with no copy of the
    row; rows of another shape, or rows for several tokens, are refused by name."""
    experts, top_k = 12, 3
    module = _experts(experts, 16, 12, seed=3)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 16, generator=generator)
    weights, index = torch.rand(1, experts, generator=generator).softmax(-1).topk(top_k, dim=-1)
    residual = torch.randn(1, 16, generator=generator)
    storage, shape = _pool(module, {e: e for e in range(experts)}, experts)
    gate_up, down = shape.split_rows(storage)
    with torch.inference_mode():
        alone = resident_experts(hidden, index, weights, gate_up, down, module.act_fn, residual)
        rows = torch.cat([hidden] * top_k)  # what the norm writes: the row k times, contiguous
        with DispatchCount() as counted:
            given = resident_experts(hidden, index, weights, gate_up, down, module.act_fn, residual, rows=rows)
        with DispatchCount() as copied:
            resident_experts(hidden, index, weights, gate_up, down, module.act_fn, residual)
        assert torch.equal(given, alone)
        assert counted.kernels == copied.kernels - 1 and "contiguous" not in counted.kernels_by_name, (
            counted.kernels_by_name, copied.kernels_by_name)
        with pytest.raises(ValueError, match=r"rows: one token's 3 pair rows of 16 expected, got \(2, 16\)"):
            resident_experts(hidden, index, weights, gate_up, down, module.act_fn, residual, rows=rows[:2])
        two = torch.randn(2, 16)
        with pytest.raises(ValueError, match=r"rows: .* for 2 tokens"):
            resident_experts(two, index.expand(2, -1), weights.expand(2, -1), gate_up, down, module.act_fn,
                             rows=torch.cat([two] * 3))


def test_grouped_linear_fallback_equals_the_grouped_kernel():
    """The loop-free fallback (per-row gathered weights, one ``bmm``) computes what ``grouped_mm`` does."""
    weights = torch.randn(5, 7, 4)
    x = torch.randn(6, 4)
    ends = torch.tensor([2, 2, 3, 6, 6], dtype=torch.int32)
    kernel = grouped_linear(x, weights, ends)
    group = torch.tensor([0, 0, 2, 3, 3, 3])
    expected = torch.stack([weights[g] @ x[i] for i, g in enumerate(group.tolist())])
    torch.testing.assert_close(kernel, expected)
    from specter.experts import grouped

    grouped._GROUPED_OK[("cpu", torch.float32)] = False
    try:
        torch.testing.assert_close(grouped_linear(x, weights, ends), expected)
    finally:
        grouped._GROUPED_OK.pop(("cpu", torch.float32))
