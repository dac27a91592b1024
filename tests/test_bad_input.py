"""Bad requests fail with an error naming the field and what was expected; the engine still works."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.plan import make_policy
from specter.target import OffloadedTarget

LINK = LinkConfig(kind="sim", bandwidth=5e9, latency=0.0)
PROMPT = [5, 9, 3, 17]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK, "specter")
    yield Engine(target, ResidentDraft(folder), 3)
    target.close()


@pytest.mark.parametrize(
    ("prompt", "new", "field"),
    [
        ([], 4, "prompt"),
        ([1, "x"], 4, "prompt"),
        ([1, 128], 4, "prompt"),  # vocab is 128
        ([1, -1], 4, "prompt"),
        (PROMPT, 0, "max_new_tokens"),
        (PROMPT, -3, "max_new_tokens"),
        (PROMPT, 10**9, "max_new_tokens"),  # absurd: past the context
        ([1] * 250, 8, "max_new_tokens"),  # over-context prompt (context 256)
    ],
)
def test_bad_requests_name_the_field_and_leave_the_engine_usable(engine, prompt, new, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.generate(prompt, new)
    tokens, _ = engine.generate_fresh(PROMPT, 4)
    assert len(tokens) == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"temperature": 1e-40}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k")],
)
def test_bad_sampling_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingConfig(**kwargs)


def test_unknown_policy_window_and_budget(tiny_dir):
    with pytest.raises(ValueError, match="^policy: unknown policy 'magic'; known: .*specter"):
        make_policy("magic")
    folder = tiny_dir("qwen2_moe")
    with pytest.raises(ValueError, match="^budget: .*minimum is 2"):
        OffloadedTarget.load(folder, SlotConfig(experts=1), LINK)
    with pytest.raises(ValueError, match="^budget:"):
        SlotConfig(fraction=1.5)
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK)
    try:
        for window in (-1, 65):
            with pytest.raises(ValueError, match="^window:"):
                Engine(target, ResidentDraft(folder), window)
        with pytest.raises(ValueError, match="^window: K > 0 needs a draft"):
            Engine(target, None, 2)
    finally:
        target.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [("vocab_size", 256), ("num_hidden_layers", 4), ("num_experts", 16), ("hidden_size", 64)],
)
def test_draft_that_does_not_match_the_target_is_refused(tiny_dir, tmp_path, field, value):
    folder = tiny_dir("qwen2_moe")
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config[field] = value
    config.pop("layer_types", None)  # derived from the layer count
    (other / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(other)).save_pretrained(other)
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK)
    try:
        with pytest.raises(ValueError, match=f"^draft: does not match the target.*{field}"):
            Engine(target, ResidentDraft(other), 2)
    finally:
        target.close()


def test_malformed_prompt_lines_are_reported_with_their_line_number(tmp_path):
    from specter.eval.prompts import read_jsonl

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "def f():"}\n\n{"id": "b", "prompt": 3}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:3: expected an object with a non-empty string 'prompt'"):
        read_jsonl(path)
    path.write_text('{"id": "a", "prompt": "x"}\n{not json\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not valid JSON"):
        read_jsonl(path)


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        ("def f():", TypeError, "^prompts: expected a list"),
        ([b"bytes"], TypeError, r"^prompts\[0\]: expected a non-empty string"),
        (["ok", 3], TypeError, r"^prompts\[1\]: expected"),
        (["ok", [1, "2"]], TypeError, r"^prompts\[1\]: expected"),
        (["ok", [True]], TypeError, r"^prompts\[1\]: expected"),
        (["ok", []], TypeError, r"^prompts\[1\]: expected"),
        (["ok", "  "], ValueError, r"^prompts\[1\]: must not be empty"),
    ],
)
def test_client_checks_every_prompt_before_any_work(prompts, error, message):
    from transformers import AutoTokenizer

    from actors.client import Client
    from specter.assets import ASSETS

    client = Client.__new__(Client)  # no Ray: the checks run before the replica is called
    client.tokenizer = AutoTokenizer.from_pretrained(str(ASSETS / "moe-fine"))
    client.handle = None  # any call to the replica would fail with AttributeError, not the check's error
    with pytest.raises(error, match=message):
        client.generate(prompts, max_new_tokens=4)
