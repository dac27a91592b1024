"""The packed format: bit-exact round trips, the compressed-tensors layout, plain safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specter.draft.format.pack import (
    AWQ_SCALE,
    bits_for,
    pack_int32,
    quantization_config,
    read_weight,
    unpack_int32,
    weight_tensors,
)
from specter.draft.format.qweight import quantize_weight
from specter.models.checkpoint import Checkpoint


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(16, 64), (13, 37), (1, 1)])
def test_pack_unpack_round_trip(bits: int, dim: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(bits * 10 + dim)
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    codes = torch.randint(low, high, shape, generator=gen, dtype=torch.int8)
    packed = pack_int32(codes, bits, dim)
    per_word = 32 // bits
    assert packed.dtype == torch.int32
    want = (shape[0], -(-shape[1] // per_word)) if dim == 1 else (-(-shape[0] // per_word), shape[1])
    assert tuple(packed.shape) == want
    assert torch.equal(unpack_int32(packed, bits, shape[dim], dim), codes)


def test_pack_layout_matches_compressed_tensors() -> None:
    # Element j of a word sits in bits [4j, 4j+4) as code + 8: codes -8..-1 → nibbles 0..7.
    codes = torch.arange(-8, 8, dtype=torch.int8).view(2, 8)
    packed = pack_int32(codes, 4, dim=1)
    assert packed[0, 0].item() == 0x76543210
    assert packed[1, 0].item() == 0xFEDCBA98 - (1 << 32)  # top nibble set: negative int32


def test_pack_rejects_out_of_range_and_bad_dtype() -> None:
    with pytest.raises(ValueError, match="4 bits"):
        pack_int32(torch.tensor([[9]], dtype=torch.int8), 4, 1)
    with pytest.raises(ValueError, match="int8"):
        pack_int32(torch.zeros(2, 2, dtype=torch.int32), 4, 1)
    with pytest.raises(ValueError, match="num_bits"):
        pack_int32(torch.zeros(2, 2, dtype=torch.int8), 3, 1)


@pytest.mark.parametrize("awq,clipped", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("bits,group", [(4, 24), (4, 16), (8, 48)])
def test_save_load_reproduces_dequantized_weight_exactly(
    tmp_path, awq: bool, clipped: bool, bits: int, group: int
) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 48, generator=gen)
    s = torch.rand(48, generator=gen) + 0.5 if awq else None
    # AWQ's clipping shrinks group ranges: only the stored scales and zero points differ.
    clip = 0.5 + 0.5 * torch.rand(40, 48 // group, generator=gen) if clipped else None
    quant = quantize_weight(weight, bits, group, torch.bfloat16, s, clip)
    module = "model.layers.0.mlp.experts.3.gate_proj"
    tensors = weight_tensors(module, quant)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
    ckpt = Checkpoint(tmp_path)
    back = read_weight(module, ckpt.read, ckpt.entries.__contains__, bits)
    assert torch.equal(back.codes, quant.codes) and torch.equal(back.zero, quant.zero)
    assert back.group_size == group and back.scale.dtype == torch.bfloat16
    assert torch.equal(back.dequantize(), quant.dequantize())
    # The plain safetensors package reads the same file, with the compressed-tensors names.
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
        assert handle.get_tensor(f"{module}.weight_shape").tolist() == [40, 48]
        assert torch.equal(handle.get_tensor(f"{module}.weight_packed"), tensors[f"{module}.weight_packed"])
    assert {f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_zero_point"} <= keys
    assert (f"{module}.{AWQ_SCALE}" in keys) == awq


def test_read_weight_names_missing_parts() -> None:
    quant = quantize_weight(torch.randn(8, 32), 4, 32, torch.float32)
    tensors = weight_tensors("m", quant)
    del tensors["m.weight_scale"]
    with pytest.raises(ValueError, match="weight_scale"):
        read_weight("m", tensors.__getitem__, tensors.__contains__, 4)


def test_quantization_config_block() -> None:
    schemes = {r".*\.experts\.\d+\.(w1|w3)": (4, 128, 256), r".*\.experts\.\d+\.w2": (4, 64, 128)}
    config = quantization_config(schemes, ["lm_head", "model.layers.0.self_attn.q_proj"])
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = [g["weights"] for g in config["config_groups"].values()]
    assert sorted(w["group_size"] for w in weights) == [64, 128]
    assert all(w["num_bits"] == 4 and w["symmetric"] is False and w["strategy"] == "group" for w in weights)
    assert "lm_head" in config["ignore"]
    assert bits_for("model.layers.1.block_sparse_moe.experts.7.w3", config) == 4
    with pytest.raises(ValueError, match="no quantization_config group"):
        bits_for("model.layers.1.self_attn.q_proj", config)
    channel = quantization_config({r".*w2": (8, 64, 64)}, [])
    assert next(iter(channel["config_groups"].values()))["weights"]["strategy"] == "channel"


def test_unpack_builds_its_shifts_on_the_words_device() -> None:
    """The packed words may live on the accelerator (the draft's experts do): nothing of the unpack
    may come from the CPU. The meta device stands in for CUDA here: mixing devices fails on it too."""
    codes = torch.randint(-8, 8, (4, 16), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int32(codes, 4, dim=1)
    out = unpack_int32(packed.to("meta"), 4, 16, dim=1)
    assert out.device.type == "meta" and out.shape == codes.shape and out.dtype == torch.int8
    assert torch.equal(unpack_int32(packed, 4, 16, dim=1), codes)
