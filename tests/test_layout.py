"""The experts' layout read from a checkpoint's headers (``specter/models/layout.py``, what the transfer
process sizes its store and slots by) against transformers' model of the same checkpoint, and the
verifier refusing a transfer process whose layout differs from its model's."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import FAMILIES

from specter.config import LinkConfig, SlotConfig
from specter.models.checkpoint import CheckpointError
from specter.models.layout import layout_facts, read_layout
from specter.models.loader import build_dense, load_store
from specter.target import slot_groups


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle has no __iter__)


def _copy(tiny_dir, family: str, dst: Path) -> Path:
    shutil.copytree(tiny_dir(family), dst)
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layout_from_the_headers_is_the_one_transformers_model_has(family, tiny_dir):
    folder = tiny_dir(family)
    layout, loaded = read_layout(folder, torch.float32), build_dense(folder, torch.float32)
    assert layout.facts() == layout_facts(loaded.moe_layers, loaded.num_experts, loaded.top_k, loaded.shape)
    budget = SlotConfig(fraction=0.3)
    assert budget.groups(layout.moe_layers, layout.num_experts, layout.shape.nbytes, layout.top_k) == \
        slot_groups(budget, loaded)


def test_the_layout_streams_the_same_experts_and_takes_the_checkpoints_dtype(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "qwen2_moe", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    layout, loaded = read_layout(folder), build_dense(folder)
    assert layout.shape == loaded.shape and layout.shape.dtype == torch.bfloat16
    ours, theirs = load_store(layout), load_store(loaded)  # type: ignore[arg-type]
    assert all(torch.equal(ours.blob(layer, e), theirs.blob(layer, e))
               for layer in loaded.moe_layers for e in range(loaded.num_experts))


def test_fused_expert_tensors_give_the_same_layout(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "mixtral", tmp_path / "m")
    tensors = _tensors(folder)
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(3):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        fused[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{base}.{e}.w1.weight"], tensors[f"{base}.{e}.w3.weight"]]) for e in range(8)])
        fused[f"{base}.down_proj"] = torch.stack([tensors[f"{base}.{e}.w2.weight"] for e in range(8)])
    save_file(fused, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert read_layout(folder).facts() == read_layout(tiny_dir("mixtral")).facts()


def test_expert_tensors_of_a_layer_beyond_the_models_depth_are_not_its(tiny_dir, tmp_path, caplog):
    """DeepSeek-V3's checkpoints carry a multi-token-prediction layer past ``num_hidden_layers``
    (layer 61 of 61), experts and all; transformers' model ignores it, and so does the layout. Its
    dense tensors are named in one warning, not one each."""
    folder = _copy(tiny_dir, "deepseek_v3", tmp_path / "m")
    tensors = _tensors(folder)
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.2.")}
    save_file({**tensors, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="specter.models.loader"):
        loaded = build_dense(folder, torch.float32)
    assert read_layout(folder, torch.float32).facts() == \
        layout_facts(loaded.moe_layers, loaded.num_experts, loaded.top_k, loaded.shape)
    assert loaded.moe_layers == [1, 2]
    dense = sorted(k for k in extra if ".experts." not in k)
    assert [r.getMessage() for r in caplog.records] == \
        [f"ignoring {len(dense)} tensor(s) of the checkpoint the model has no parameter for: {', '.join(dense[:3])}, …"]


def test_a_checkpoint_without_routed_experts_is_refused_by_name(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "olmoe", tmp_path / "m")
    save_file({k: v for k, v in _tensors(folder).items() if ".experts." not in k}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no routed expert tensors of a olmoe model \(model\.layers\.N\.mlp"):
        read_layout(folder)


def test_layers_with_different_expert_counts_are_refused(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "olmoe", tmp_path / "m")
    save_file({k: v for k, v in _tensors(folder).items() if ".layers.2.mlp.experts.7." not in k},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"different expert counts \{0: 8, 1: 8, 2: 7\}"):
        read_layout(folder)


def test_a_config_without_top_k_is_refused(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "olmoe", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["num_experts_per_tok"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_experts_per_tok must be a positive integer, got None"):
        read_layout(folder)


def test_the_transfer_role_builds_no_transformers_model():
    """The transfer process's start-up: its module and role import no transformers (and so no meta
    model is built there), which is what the layout is for."""
    code = ("import sys, actors.transfer, specter.remote.roles.transfer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_verifier_refuses_a_transfer_process_whose_layout_differs_from_its_model(tiny_dir, tmp_path):
    """qwen2_moe's layer 0 is dense (``mlp_only_layers``); stray expert tensors for it on disk make the
    headers' layout name a layer the model does not route: the verifier says so when it connects."""
    from specter.remote.roles.transfer import TransferRole
    from specter.remote.roles.verifier import VerifierRole

    folder = _copy(tiny_dir, "qwen2_moe", tmp_path / "m")
    tensors = _tensors(folder)
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stray = tensors[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].clone()
            tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = stray
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    link = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)
    transfer = TransferRole(str(folder), SlotConfig(fraction=0.5), link, timeout_s=5.0)
    verifier = VerifierRole(str(folder), SlotConfig(fraction=0.5), "demand-lru", timeout_s=5.0, link=link)
    try:
        info = transfer.info()
        assert info["layout"]["moe_layers"] == [0, 1, 2]
        with pytest.raises(RuntimeError, match=r"transfer process read the experts' layout .*'moe_layers': \[0, 1, 2\]"
                                               r".*the verifier's model has .*'moe_layers': \[1, 2\]"):
            verifier.connect(info["slots"], info["endpoint"], None, info["layout"])
    finally:
        verifier.close()
        transfer.close()
