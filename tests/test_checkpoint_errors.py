"""Missing, truncated, corrupt or foreign checkpoints fail with errors that name the culprit."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import save_tiny

from specter.config import LinkConfig, SlotConfig
from specter.models.checkpoint import Checkpoint, CheckpointError
from specter.models.families import UnsupportedArchitectureError
from specter.models.loader import build_dense, load_store
from specter.target import OffloadedTarget

LINK = LinkConfig(kind="sim", bandwidth=5e9, latency=0.0)


def _copy(tiny_dir, family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(tiny_dir(family), dst)
    return dst


def _load(folder):
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK)
    target.close()


def test_store_blob_holds_exactly_the_disk_tensors(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    loaded = build_dense(folder)
    store = load_store(loaded)
    gate_up, down = store.shape.split(store.blob(2, 5))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.2.mlp.experts.5.gate_proj.weight")
        up = f.get_tensor("model.layers.2.mlp.experts.5.up_proj.weight")
        down_ref = f.get_tensor("model.layers.2.mlp.experts.5.down_proj.weight")
    assert torch.equal(gate_up, torch.cat([gate, up]))
    assert torch.equal(down, down_ref)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tmp_path):
    folder = save_tiny("mixtral", tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    _load(folder)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=shards[1].name):
        _load(folder)


def test_missing_expert_key_is_named(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "olmoe", tmp_path)
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.experts.6.up_proj.weight"}
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.6\.up_proj\.weight"):
        _load(folder)


def test_missing_dense_key_is_named(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "mixtral", tmp_path)
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.0.self_attn.q_proj.weight"}
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_proj\.weight"):
        _load(folder)


def test_truncated_file_is_named(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, "mixtral", tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(folder)


@pytest.mark.parametrize("garbage", [b"\x00\x01", struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 5) + b"{nope"])
def test_corrupt_header_is_named(tiny_dir, tmp_path, garbage):
    folder = _copy(tiny_dir, "mixtral", tmp_path)
    (folder / "model.safetensors").write_bytes(garbage)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _load(folder)


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError, match=r"'llama'.*mixtral.*qwen2_moe"):
        _load(tmp_path)


def test_malformed_config_and_missing_folder(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "absent")


def test_hf_cache_layout_is_resolved(tiny_dir, tmp_path):
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    shutil.copytree(tiny_dir("qwen3_moe"), snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert Checkpoint(repo).dir == snap
    _load(repo)


def test_fused_3d_expert_tensors_on_disk_load_like_per_expert(tiny_dir, tmp_path):
    """Some exporters store one (E, 2I, H) tensor per layer; one expert is read as a slice of it."""
    folder = _copy(tiny_dir, "qwen3_moe", tmp_path)
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    per_expert = {k: v for k, v in tensors.items() if ".experts." in k}
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(3):
        base = f"model.layers.{layer}.mlp.experts"
        fused[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[f"{base}.{e}.gate_proj.weight"], per_expert[f"{base}.{e}.up_proj.weight"]])
             for e in range(8)]
        )
        fused[f"{base}.down_proj"] = torch.stack([per_expert[f"{base}.{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, str(path), metadata={"format": "pt"})
    want = load_store(build_dense(tiny_dir("qwen3_moe")))
    got = load_store(build_dense(folder))
    for layer in range(3):
        for e in range(8):
            assert torch.equal(got.blob(layer, e), want.blob(layer, e))
