"""The shipped trained models and their AWQ drafts: speculation on real routing is lossless."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.assets import ASSETS
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import check_draft_matches, load_draft
from specter.engine import Engine
from specter.eval.prompts import load_prompts
from specter.models.checkpoint import read_config_dict
from specter.target import OffloadedTarget


@pytest.mark.parametrize("name", ["moe-fine", "moe-coarse"])
def test_shipped_draft_matches_its_target_and_is_int4(name):
    target, draft = ASSETS / name, ASSETS / f"{name}-awq"
    config = read_config_dict(draft)
    check_draft_matches(config, read_config_dict(target))
    quant = config["quantization_config"]
    assert quant["format"] == "pack-quantized"
    assert quant["config_groups"]["group_0"]["weights"]["num_bits"] == 4


@pytest.mark.parametrize("name", ["moe-fine", "moe-coarse"])
def test_speculative_greedy_on_the_trained_model_equals_transformers(name):
    model = ASSETS / name
    prompts = load_prompts(model, None, 3)
    ref = AutoModelForCausalLM.from_pretrained(str(model), experts_implementation="eager", dtype=torch.float32)
    draft = load_draft(ASSETS / f"{name}-awq")
    target = OffloadedTarget.load(model, SlotConfig(fraction=0.25), LinkConfig(bandwidth=5e9, latency=0),
                                  "specter+fixed+last")  # every round drafts and routes all K + 1 positions
    try:
        for prompt in prompts:
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
            got, stats = Engine(target, draft, 4).generate_fresh(prompt, 24, eos_token_id=0)
            assert got == want.tolist()[: len(got)] and len(got) == len(want)
            # real routing, real draft: the int4 draft's routers name the experts the target's use (without
            # +last the K-th draft's position is not routed, and recall is bounded near K / (K + 1))
            assert stats.extra["recall"] > 0.95 and stats.extra["precision"] > 0.95, stats.extra
            assert stats.extra["mean_accepted"] > 2
    finally:
        target.close()
