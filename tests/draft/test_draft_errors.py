"""Bad drafts get an error that names the problem before any work: a quantized checkpoint of
another format or bit width, a truncated packed tensor, a draft of another model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from actors.launcher import launch
from specter.config import LinkConfig, SlotConfig
from specter.draft.runner import DraftModel
from specter.models.checkpoint import CheckpointError

GATE = "model.layers.0.block_sparse_moe.experts.1.w1"  # mixtral's gate projection


def _copy(draft: Path, tmp_path: Path) -> Path:
    out = tmp_path / "draft"
    shutil.copytree(draft, out)
    return out


def _edit_config(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("method", "layout", "named"),
    [
        ("bitsandbytes", None, "quant_method 'bitsandbytes' is not read as a draft"),
        ("awq", "gemv", "AutoAWQ version 'gemv' is not read"),
        ("compressed-tensors", "int-quantized", "compressed-tensors format 'int-quantized' is not read"),
    ],
)
def test_another_quantization_format_is_named(draft_dir, tmp_path, method, layout, named) -> None:
    folder = _copy(draft_dir("mixtral", "rtn"), tmp_path)

    def edit(q: dict) -> None:
        q["quant_method"], q["format"], q["version"] = method, layout, layout

    _edit_config(folder, edit)
    with pytest.raises(CheckpointError, match=named):
        DraftModel.load(folder, device="cpu", mode="dequant-cache")


def test_a_published_format_whose_tensors_are_not_there_names_the_module(draft_dir, tmp_path) -> None:
    folder = _copy(draft_dir("mixtral", "rtn"), tmp_path)

    def edit(q: dict) -> None:
        q["quant_method"], q["bits"], q["group_size"] = "gptq", 4, 32

    _edit_config(folder, edit)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1' is not quantized.*no .*\.w1\.qweight"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache")


@pytest.mark.parametrize(("method", "bits"), [("gptq", 3), ("awq", 8)])
def test_a_published_format_in_an_unread_bit_width_names_the_field(draft_dir, tmp_path, method, bits) -> None:
    folder = _copy(draft_dir("mixtral", "rtn"), tmp_path)

    def edit(q: dict) -> None:
        q["quant_method"], q["bits"], q["version"] = method, bits, "gemm"

    _edit_config(folder, edit)
    with pytest.raises(CheckpointError, match=f"quantization_config.bits: .* got {bits}"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache")


def test_an_unsupported_bit_width_names_the_field(draft_dir, tmp_path) -> None:
    folder = _copy(draft_dir("mixtral", "rtn"), tmp_path)

    def edit(q: dict) -> None:
        next(iter(q["config_groups"].values()))["weights"]["num_bits"] = 3

    _edit_config(folder, edit)
    with pytest.raises(ValueError, match=r"quantization_config\.config_groups\.group_\d+\.weights\.num_bits must be 4 or 8, got 3"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache")


def test_a_truncated_packed_tensor_is_named(draft_dir, tmp_path) -> None:
    folder = _copy(draft_dir("mixtral", "rtn"), tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    packed = tensors[f"{GATE}.weight_packed"]
    tensors[f"{GATE}.weight_packed"] = packed[:, : packed.shape[1] // 2].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^{GATE}\.weight_packed: packed tensor holds .* \(truncated"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache")


def test_a_draft_of_another_model_is_refused_before_any_actor_starts(draft_dir, tiny_dir) -> None:
    # Ray is not even initialized: the check comes first.
    with pytest.raises(ValueError, match="^draft: does not match the target .model_type: draft qwen2_moe vs target mixtral"):
        launch(tiny_dir("mixtral"), draft_dir("qwen2_moe", "rtn"), SlotConfig(fraction=0.5), LinkConfig())
