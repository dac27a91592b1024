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
                                  "specter+fixed")  # every round drafts: recall and acceptance are measured
    try:
        for prompt in prompts:
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
            got, stats = Engine(target, draft, 4).generate_fresh(prompt, 24, eos_token_id=0)
            assert got == want.tolist()[: len(got)] and len(got) == len(want)
            assert stats.extra["recall"] > 0.8 and stats.extra["mean_accepted"] > 2  # real routing, real draft
    finally:
        target.close()
