"""Self-generated calibration: windows of the calibration ids, continued greedily by the target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.draft.quantize.calibrate import (
    GenerationSpec,
    calibration_ids,
    prompt_windows,
    record_expert_inputs,
)
from specter.models.greedy import greedy_continuation
from specter.models.loader import build_dense, load_store

SHIPPED = Path(__file__).resolve().parents[2] / "specter" / "assets" / "moe-coarse"


def test_prompt_windows_are_evenly_spaced_slices() -> None:
    ids = list(range(100))
    windows = prompt_windows(ids, 3, 10)
    assert windows == [list(range(0, 10)), list(range(45, 55)), list(range(90, 100))]
    assert prompt_windows(ids, 1, 10) == [list(range(10))]
    assert prompt_windows(ids[:4], 3, 10) == [[0, 1, 2, 3]]  # shorter than one window: one window
    assert prompt_windows(ids, 0, 10) == []


def test_generation_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="windows"):
        GenerationSpec(windows=-1)
    with pytest.raises(ValueError, match="new_tokens"):
        GenerationSpec(new_tokens=0)


def _record(model_dir: Path, ids: list[int], generation: GenerationSpec):
    loaded = build_dense(model_dir)
    return record_expert_inputs(loaded, load_store(loaded), ids, cap=64, generation=generation), loaded


def test_self_generated_sequences_are_the_targets_greedy_continuations(plain_dir, calib_ids) -> None:
    model_dir = plain_dir("mixtral")
    spec = GenerationSpec(windows=3, prompt_tokens=8, new_tokens=6)
    recorder, loaded = _record(model_dir, calib_ids, spec)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), experts_implementation="eager").eval()
    assert len(recorder.generated) == 3
    for sequence, prompt in zip(recorder.generated, prompt_windows(calib_ids, 3, 8), strict=True):
        assert sequence[:8] == prompt
        assert sequence[8:] == greedy_continuation(reference, prompt, 6)
    # Every position of the text and of each window + continuation was recorded once per chosen expert.
    seen = sum(r.seen for layer in loaded.moe_layers for r in recorder.inputs(layer) if r is not None)
    assert seen == len(loaded.moe_layers) * loaded.top_k * (len(calib_ids) + 3 * (8 + 6))


def test_self_generated_calibration_is_deterministic_and_can_be_off(plain_dir, calib_ids) -> None:
    model_dir = plain_dir("mixtral")
    spec = GenerationSpec(windows=2, prompt_tokens=8, new_tokens=4)
    first, loaded = _record(model_dir, calib_ids, spec)
    second, _ = _record(model_dir, calib_ids, spec)
    assert first.generated == second.generated
    for layer in loaded.moe_layers:
        for a, b in zip(first.inputs(layer), second.inputs(layer), strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert torch.equal(a.x, b.x) and torch.equal(a.w, b.w)
    off, _ = _record(model_dir, calib_ids, GenerationSpec(windows=0))
    assert off.generated == []
    seen = sum(r.seen for layer in loaded.moe_layers for r in off.inputs(layer) if r is not None)
    assert seen == len(loaded.moe_layers) * loaded.top_k * len(calib_ids)


@pytest.mark.skipif(not (SHIPPED / "tokenizer.json").is_file(), reason="shipped model not present")
def test_shipped_self_generated_prompts_come_from_the_calibration_text_only() -> None:
    ids = calibration_ids(SHIPPED, None, 256)
    assert ids is not None
    recorder, _ = _record(SHIPPED, ids, GenerationSpec(windows=2, prompt_tokens=16, new_tokens=4))
    starts = [0, 256 - 16]
    for sequence, start in zip(recorder.generated, starts, strict=True):
        assert sequence[:16] == ids[start : start + 16]
        assert len(sequence) == 20


def test_a_calibration_text_of_no_tokens_is_an_error_not_a_warning_of_zero(tmp_path, caplog) -> None:
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("", encoding="utf-8")
    short.write_text("def f(x):\n    return x\n", encoding="utf-8")
    with (caplog.at_level("WARNING", logger="specter.draft.quantize.calibrate"),
          pytest.raises(ValueError, match="empty.txt encodes to no tokens")):
        calibration_ids(SHIPPED, empty, 64)
    assert "gives only" not in caplog.text
    with caplog.at_level("WARNING", logger="specter.draft.quantize.calibrate"):
        ids = calibration_ids(SHIPPED, short, 4096)
    assert 0 < len(ids) < 4096
    assert f"gives only {len(ids)} tokens (4096 asked)" in caplog.text
