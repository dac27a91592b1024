"""What the draft's plans make the schedule do: a step's plan delta predicts the experts of the position
the verify pass runs, and no other; prefetching for later layers never takes the running layer's slots."""

from __future__ import annotations

import pytest
import torch
from tiny_models import noisy_copy
from transformers import AutoModelForCausalLM

from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.experts.link import DEMAND
from specter.proposer import LocalProposer
from specter.protocol import PlanDelta
from specter.target import OffloadedTarget

PROMPT = [5, 99, 17, 42, 8, 63, 21]
SKIPPED = [11, 120, 37]  # committed since the draft last ran: a round's first step feeds them all


@pytest.mark.parametrize("policy", ["specter+fixed", "specter+fixed+nopipe"])
def test_a_layer_never_fetches_back_an_expert_it_found_resident(tiny_dir, tmp_path, policy):
    """Once a verify layer's routing is known, the schedule run at that moment may prefetch for later
    layers, but not into the slots of the experts this layer is about to run: those are resident when
    the routing is read and must not come back over the link as the layer's own demand. (Before, the
    running layer counted as passed, its experts were the first victims, and on the as-built Mixtral
    workload a pass fetched back four of its own experts: 58 ms where 21 do.) Tokens stay transformers'."""
    folder = tiny_dir("mixtral")
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    draft = ResidentDraft(noisy_copy(folder, tmp_path / "draft", scale=0.3))
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.25), LinkConfig(kind="sim", bandwidth=2e9), policy)
    offload, specter = target.offload, target.offload.policy
    found: set[tuple[int, int]] = set()  # the running layer's experts resident as its routing was read
    fetched_back: list[tuple[int, int]] = []
    layers = 0
    before_layer, fetch = specter.before_layer, offload.fetch

    def watch_layer(layer, hidden, needed):
        nonlocal layers
        layers += 1
        found.clear()
        found.update(k for e in needed if offload.pool.holds(k := (layer, e)) and not offload.pool.is_loading(k))
        before_layer(layer, hidden, needed)

    def watch_fetch(key, priority, protect, choose=None):
        if priority == DEMAND and key in found:
            fetched_back.append(key)
        return fetch(key, priority, protect, choose)

    specter.before_layer, offload.fetch = watch_layer, watch_fetch
    try:
        engine = Engine(target, draft, 4)
        for prompt in (PROMPT, [3, 14, 15, 92, 65, 35], [100, 7, 7, 31, 2]):
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
            tokens, _ = engine.generate(prompt, 24)
            assert tokens == want[0, len(prompt):].tolist()
    finally:
        target.close()
    assert layers > 50 and fetched_back == []


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_step_that_catches_up_predicts_only_its_last_positions_experts(tiny_dir, family):
    """The first step of a round feeds every token the draft has not seen (here three, as after plain
    steps) and routes them all; the target has run all but the last, so the plan names the last one's
    top-k per layer only, the experts transformers' routers pick there. Each later step names its own
    position's. (Before, the first step's delta named every fed position's experts: 3 × top-k.)"""
    folder = tiny_dir(family)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    top_k = ref.config.num_experts_per_tok
    proposer = LocalProposer(ResidentDraft(folder))  # the target's own weights: its routers are the target's
    proposer.prefill(PROMPT, SamplingConfig())
    deltas: list[PlanDelta] = []
    seq = PROMPT + SKIPPED
    drafts, _ = proposer.propose(0, seq, 2, deltas.append, route_last=True)
    assert [d.step for d in deltas] == [0, 1, 2]
    with torch.no_grad():
        routers = ref(torch.tensor([seq + drafts]), output_router_logits=True).router_logits
    for delta, position in zip(deltas, range(len(seq) - 1, len(seq) + 2), strict=True):
        assert len(delta.layers) == len(routers)  # transformers gives the MoE layers' routers, in order
        for router, layer, experts in zip(routers, delta.layers, delta.experts, strict=True):
            assert len(experts) == top_k, (delta.step, layer)
            want = torch.topk(router.reshape(-1, router.shape[-1])[position], top_k).indices
            assert sorted(experts) == sorted(want.tolist()), (delta.step, layer, position)
