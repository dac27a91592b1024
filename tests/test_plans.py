"""A draft step's plan delta predicts the experts of the position the verify pass runs, and no other."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.config import SamplingConfig
from specter.draft.resident import ResidentDraft
from specter.proposer import LocalProposer
from specter.protocol import PlanDelta

PROMPT = [5, 99, 17, 42, 8, 63, 21]
SKIPPED = [11, 120, 37]  # committed since the draft last ran: a round's first step feeds them all


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
