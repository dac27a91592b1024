"""Stock readers compute Specter's drafts right (issue 20, points 1 and 2).

The reader is the real one: the ``compressed-tensors`` package decompresses every packed
projection (its own config parsing, target matching and unpacking), transformers builds the model
from the decompressed weights. The default AWQ layout folds its scales into the draft's dense
tensors, so what they compute is what ``DraftModel`` computes; the per-expert layout, which a stock
reader would misread, carries a format name they refuse.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_name
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import CONFIGS, save_tiny
from transformers import AutoModelForCausalLM

from specter.assets import ASSETS
from specter.draft.format.pack import AWQ_SCALE, PACKED_SUFFIXES, bits_for, read_weight
from specter.draft.format.qweight import quantize_weight
from specter.draft.quantize.awq import fold_down_scale
from specter.draft.quantize.model import fold_input_scale, quantize_model
from specter.draft.runner import DraftModel
from specter.models.loader import build_dense

TRAINED = ("moe-fine", "moe-coarse")
PROMPT = torch.tensor([[3, 17, 92, 5, 41, 200, 7, 64, 11, 150, 33, 8, 71, 120, 19, 2]])


def stock_decompress(draft: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a draft as compressed-tensors reads it: packed projections decompressed to
    ``<module>.weight`` with the scheme its config assigns; returns the tensors and, per
    decompressed module, the name of the config group that matched it."""
    qconfig = QuantizationConfig.model_validate(json.loads((draft / "config.json").read_text())["quantization_config"])
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, str] = {}
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for key in sorted(keys):
            if key.endswith(".weight_packed"):
                module = key.removesuffix(".weight_packed")
                name, scheme = next((n, g) for n, g in qconfig.config_groups.items()
                                    if any(match_name(module, t) for t in g.targets))
                parts = {s: f.get_tensor(f"{module}.{s}") for s in PACKED_SUFFIXES if f"{module}.{s}" in keys}
                tensors[f"{module}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
                groups[module] = name
            elif not any(key.endswith(f".{s}") for s in (*PACKED_SUFFIXES, AWQ_SCALE)):
                tensors[key] = f.get_tensor(key)
    return tensors, groups


def stock_model(draft: Path, out: Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """transformers' model of the decompressed draft (a plain checkpoint: no quantization_config)."""
    tensors, _ = stock_decompress(draft)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((draft / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(str(out), experts_implementation="eager", dtype=dtype).eval()


def outlier_target(family: str, folder: Path) -> Path:
    """A default-init tiny model whose post-attention norms boost four channels ×8: activation
    outliers, what AWQ's scales are for (on plain random weights RTN wins everywhere)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[family]).save_pretrained(folder)  # transformers' own init
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    for key in tensors:
        if key.endswith("post_attention_layernorm.weight"):
            tensors[key] = tensors[key].clone()
            tensors[key][:4] *= 8
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def trained_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """The shipped AWQ drafts and RTN / int8 drafts of both trained models."""
    drafts = {}
    for model in TRAINED:
        shipped = ASSETS / f"{model}-awq"
        if json.loads((shipped / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized":
            drafts[(model, "awq")] = shipped
        else:  # the shipped draft has per-expert scales: a folded one, with a shorter search
            drafts[(model, "awq")] = tmp_path_factory.mktemp(f"{model}-awq-folded")
            quantize_model(ASSETS / model, drafts[(model, "awq")], method="awq", calib_tokens=1024, grid=6,
                           layout="folded", progress=False)
        for method in ("rtn", "int8"):
            out = tmp_path_factory.mktemp(f"{model}-{method}")
            quantize_model(ASSETS / model, out, method=method, calib_tokens=256, progress=False)  # calibration: report only
            drafts[(model, method)] = out
    return drafts


@pytest.mark.parametrize("method", ["awq", "rtn", "int8"])
@pytest.mark.parametrize("model", TRAINED)
def test_compressed_tensors_decompresses_the_weights_specter_computes_with(trained_drafts, model, method) -> None:
    draft = trained_drafts[(model, method)]
    config = json.loads((draft / "config.json").read_text())
    qconfig = config["quantization_config"]
    assert qconfig["format"] == "pack-quantized"
    tensors, groups = stock_decompress(draft)
    dtype = build_dense(draft).shape.dtype
    kinds: dict[str, int] = {}
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert not any(k.endswith(AWQ_SCALE) for k in keys)
        for module, group in groups.items():
            ours = read_weight(module, f.get_tensor, keys.__contains__, bits_for(module, qconfig))
            theirs = tensors[f"{module}.weight"]
            assert theirs.dtype == dtype, module
            assert torch.equal(theirs, ours.dequantize(dtype)), module
            bits = qconfig["config_groups"][group]["weights"]["num_bits"]
            assert bits == (8 if method == "int8" else 4)
            kinds[module.rsplit(".", 1)[1]] = kinds.get(module.rsplit(".", 1)[1], 0) + 1
    layers, experts = config["num_hidden_layers"], config.get("num_experts") or config["num_local_experts"]
    assert len(kinds) == 3 and set(kinds.values()) == {layers * experts}, kinds  # gate, up, down of every expert


def test_a_per_expert_drafts_codes_are_standard_and_only_its_scale_is_extra(calib_ids, tmp_path) -> None:
    """compressed-tensors, told that a per-expert draft is ``pack-quantized``, decompresses every
    projection to ``Q(W s)``; Specter divides by ``s`` (``weight_awq_scale``), which it alone reads."""
    draft = tmp_path / "draft"
    quantize_model(outlier_target("mixtral", tmp_path / "target"), draft, method="awq", calib_ids=calib_ids,
                   cap=128, grid=10, progress=False, layout="per-expert")
    config = json.loads((draft / "config.json").read_text())
    qconfig = config["quantization_config"]
    assert qconfig["format"] == "specter-awq"
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "model.safetensors").symlink_to(draft / "model.safetensors")
    qconfig["format"] = "pack-quantized"
    for group in qconfig["config_groups"].values():
        group["format"] = "pack-quantized"
    (renamed / "config.json").write_text(json.dumps(config))
    tensors, groups = stock_decompress(renamed)
    scaled = 0
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for module in groups:
            ours = read_weight(module, f.get_tensor, keys.__contains__, bits_for(module, qconfig))
            theirs = tensors[f"{module}.weight"]
            assert torch.equal(theirs, ours.dequantize_scaled().to(theirs.dtype)), module
            scaled += ours.awq_scale is not None
    assert scaled > 0


@pytest.mark.parametrize("model", TRAINED)
def test_a_stock_reader_computes_the_folded_draft_as_specter_does(trained_drafts, model, tmp_path) -> None:
    draft = trained_drafts[(model, "awq")]
    # the checkpoint's dtype, as a stock reader runs it (bit for bit; on a CPU Specter's default is fp32)
    specter_draft = DraftModel.load(draft, device="cpu", mode="dequant-cache", dtype=torch.bfloat16, grouped=False)
    stock = stock_model(draft, tmp_path / "stock", dtype=specter_draft.model.dtype)
    target = AutoModelForCausalLM.from_pretrained(str(ASSETS / model), experts_implementation="eager",
                                                  dtype=specter_draft.model.dtype).eval()
    with torch.inference_mode():
        ours = specter_draft.forward(PROMPT)
        theirs = stock(PROMPT).logits.float()
        reference = target(PROMPT).logits.float()
    specter_draft.close()
    assert torch.equal(ours, theirs)
    # ... and what they compute follows the target (an unfolded scale would not: see the fp32 test below).
    assert float((theirs.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.9
    assert float((theirs - reference).norm() / reference.norm()) < 0.1


FOLD_FAMILIES = ("mixtral", "phimoe", "qwen2_moe", "deepseek_v2")


@pytest.mark.parametrize("family", FOLD_FAMILIES)
def test_folding_an_input_scale_leaves_the_model_unchanged(family, tmp_path) -> None:
    """Every reader of the post-attention norm takes the fold (router, shared expert and its gate,
    a LayerNorm's bias): with full-precision experts the folded model equals the target."""
    target_dir = save_tiny(family, tmp_path / "target")
    loaded = build_dense(target_dir)
    tensors = load_file(str(next(target_dir.glob("*.safetensors"))))
    gen = torch.Generator().manual_seed(0)
    for layer in loaded.moe_layers:
        s = torch.rand(loaded.shape.hidden, generator=gen) * 3 + 0.25
        tensors.update(fold_input_scale(tensors, loaded, layer, s))
        for key in list(tensors):
            gate_or_up = not any(p in key for p in ("down_proj", loaded.family.proj_names[2] + "."))
            if key.startswith(f"model.layers.{layer}.") and loaded.family.is_expert_key(key) and gate_or_up:
                tensors[key] = tensors[key] * s
    folded = tmp_path / "folded"
    shutil.copytree(target_dir, folded)
    for old in folded.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(folded / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 128, (1, 24), generator=gen)
    with torch.inference_mode():
        want = AutoModelForCausalLM.from_pretrained(str(target_dir), experts_implementation="eager")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(folded), experts_implementation="eager")(ids).logits
        unfolded = dict(tensors)
        for layer in loaded.moe_layers:  # the control: the norm's fold undone, the rest kept
            key = f"model.layers.{layer}.post_attention_layernorm.weight"
            unfolded[key] = load_file(str(next(target_dir.glob("*.safetensors"))))[key]
        save_file(unfolded, str(folded / "model.safetensors"), metadata={"format": "pt"})
        wrong = AutoModelForCausalLM.from_pretrained(str(folded), experts_implementation="eager")(ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(wrong, want, rtol=1e-2, atol=1e-2)


def test_folding_down_scale_into_up_rows_keeps_the_expert_output() -> None:
    gen = torch.Generator().manual_seed(3)
    up, down = torch.randn(32, 64, generator=gen), torch.randn(64, 32, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    s = torch.rand(32, generator=gen) + 0.5
    up_q = quantize_weight(up, 4, 32, torch.float32)
    down_q = quantize_weight(down, 4, 32, torch.float32, awq_scale=s)
    want = torch.nn.functional.linear(torch.nn.functional.linear(x, up_q.dequantize()), down_q.dequantize())
    folded_up, folded_down = fold_down_scale(up_q, down_q)
    assert folded_down.awq_scale is None and torch.equal(folded_up.codes, up_q.codes)
    got = torch.nn.functional.linear(torch.nn.functional.linear(x, folded_up.dequantize()), folded_down.dequantize())
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_the_folded_awq_draft_is_plain_w4a16_that_a_stock_reader_computes_right(family, calib_ids, tmp_path) -> None:
    draft = tmp_path / "draft"
    report = quantize_model(outlier_target(family, tmp_path / "target"), draft, method="awq", calib_ids=calib_ids,
                            cap=128, grid=10, progress=False)
    assert report["awq_scaled_projections"] == 0
    assert any(layer["input_scale"] for layer in report["layers"].values())  # a scale was chosen and folded
    specter_draft = DraftModel.load(draft, device="cpu", mode="dequant-cache")
    stock = stock_model(draft, tmp_path / "stock", dtype=torch.float32)
    with torch.inference_mode():
        ours = specter_draft.forward(PROMPT % 128)
        theirs = stock(PROMPT % 128).logits.float()
    specter_draft.close()
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_per_expert_layout_is_refused_by_stock_readers_and_read_by_specter(calib_ids, tmp_path) -> None:
    draft = tmp_path / "draft"
    report = quantize_model(outlier_target("mixtral", tmp_path / "target"), draft, method="awq",
                            calib_ids=calib_ids, cap=128, grid=10, progress=False, layout="per-expert")
    assert report["awq_scaled_projections"] > 0
    qconfig = json.loads((draft / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "specter-awq"
    with pytest.raises(ValidationError, match="format"):
        QuantizationConfig.model_validate(qconfig)
    with pytest.raises(ValidationError, match="format"):
        AutoModelForCausalLM.from_pretrained(str(draft))
    specter_draft = DraftModel.load(draft, device="cpu", mode="dequant-cache")
    assert specter_draft.forward(PROMPT % 128).shape[-1] == 128
    specter_draft.close()
