"""The draft model end to end: quantize a tiny checkpoint, load it, compare with transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_models import CONFIGS
from transformers import AutoModelForCausalLM

from specter.assets import DEFAULT_MODEL
from specter.draft.format.published import scheme_for
from specter.draft.kernels import ExpertKernels
from specter.draft.quantize.calibrate import GenerationSpec
from specter.draft.quantize.model import quantize_model
from specter.draft.runner import DraftExperts, DraftModel, read_experts
from specter.models.checkpoint import CheckpointError
from specter.models.routing import router_modules

FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v2"]


def _ids(n: int = 10, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _target(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(folder), experts_implementation="eager").eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_equals_transformers_with_its_dequantized_experts(family, plain_dir, draft_dir) -> None:
    draft = DraftModel.load(draft_dir(family, "awq"), device="cpu", mode="dequant-cache")
    experts, _ = read_experts(draft.loaded, scheme_for(draft.loaded.checkpoint.config["quantization_config"]))
    target = _target(plain_dir(family))
    # The draft's dense tensors (its norms and routers hold the folded AWQ scales), by memory name.
    family_ = draft.loaded.family
    dense = load_file(str(draft_dir(family, "awq") / "model.safetensors"))
    state = {family_.memory_name(k): t for k, t in dense.items() if not family_.is_expert_key(k)}
    missing = set(state) - set(target.state_dict())
    assert not missing, missing
    target.load_state_dict(state, strict=False)
    with torch.no_grad():
        for layer, module in enumerate(target.model.layers):
            fused = getattr(module.mlp, "experts", None)
            for expert in range(fused.num_experts if fused is not None else 0):
                gate, up, down = experts[(layer, expert)]
                fused.gate_up_proj[expert] = torch.cat([gate.dequantize(), up.dequantize()])
                fused.down_proj[expert] = down.dequantize()
        want = target(_ids()).logits
    torch.testing.assert_close(draft.forward(_ids()), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_logits_close_to_target_int8_closest(family, plain_dir, draft_dir) -> None:
    with torch.no_grad():
        want = _target(plain_dir(family))(_ids()).logits
    rel = {}
    for method in ("awq", "int8"):
        got = DraftModel.load(draft_dir(family, method), device="cpu", mode="dequant-cache").forward(_ids())
        rel[method] = float((got - want).norm() / want.norm())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert rel["awq"] < 2e-2
    assert rel["int8"] < 1e-3 and rel["int8"] < rel["awq"] / 5


def test_routing_capture_matches_the_routers(plain_dir, draft_dir) -> None:
    draft = DraftModel.load(draft_dir("qwen2_moe", "awq"), device="cpu", mode="dequant-cache")
    seen: dict[int, torch.Tensor] = {}
    routers = router_modules(draft.model)
    handles = [
        r.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].clone()))
        for i, r in routers.items()
    ]
    draft.forward(_ids())
    for h in handles:
        h.remove()
    assert sorted(draft.last_routing) == sorted(routers) and routers
    for layer, router in routers.items():
        ids, probs = draft.last_routing[layer]
        with torch.inference_mode():
            logits, _, index = router(seen[layer])
        assert ids.dtype == torch.long and ids.shape == (10, 2) and probs.shape == (10, 2)
        assert torch.equal(ids, index.long())
        torch.testing.assert_close(probs, torch.softmax(logits.float(), -1).gather(1, ids))
    # The first MoE layer sees no quantized expert upstream: its routing is the target's exactly.
    target = _target(plain_dir("qwen2_moe"))
    first = min(routers)
    captured: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
        captured["ids"] = out[2]

    router_modules(target)[first].register_forward_hook(keep)
    with torch.no_grad():
        target(_ids())
    assert torch.equal(draft.last_routing[first][0], captured["ids"].long())


def test_cache_steps_and_crop_match_a_full_forward(draft_dir) -> None:
    draft = DraftModel.load(draft_dir("mixtral", "awq"), device="cpu", mode="dequant-cache")
    ids = _ids(8)
    full = draft.forward(ids)
    cache = draft.new_cache()
    draft.forward(ids[:, :5], cache)
    step = draft.step(ids[:, 5:6], cache)
    torch.testing.assert_close(step.logits[0, -1], full[0, 5], rtol=1e-5, atol=1e-5)
    assert set(step.routing) == set(draft.last_routing) and step.routing[0][0].shape == (1, 2)
    draft.forward(torch.tensor([[1, 2]]), cache)  # a rejected continuation …
    draft.crop(cache, 6)  # … rolled back
    assert cache.get_seq_length() == 6
    again = draft.forward(ids[:, 6:8], cache)
    torch.testing.assert_close(again[0], full[0, 6:8], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="length"):
        draft.crop(cache, 99)


def test_draft_folder_contents(plain_dir, draft_dir) -> None:
    folder = draft_dir("mixtral", "awq")
    report = json.loads((folder / "draft_report.json").read_text())
    assert report["method"] == "awq" and report["num_bits"] == 4
    assert report["group_sizes"] == {"gate_up": 32, "down": 16}  # hidden 32, intermediate 48
    assert report["rtn_fallback_experts"] >= 0 and set(report["layers"]) == {"0", "1", "2"}
    layer = report["layers"]["0"]
    assert 0.0 <= layer["alpha_gate_up"]["min"] <= layer["alpha_gate_up"]["max"] <= 1.0
    assert layer["mse_gate_up"] > 0 and layer["weight_rel_err"] < 0.2
    assert report["packed_bytes"] < report["target_expert_bytes"] / 3
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert "lm_head" in qc["ignore"] and "model.layers.0.block_sparse_moe.gate" in qc["ignore"]
    with (
        safe_open(str(folder / "model.safetensors"), "pt") as out,
        safe_open(str(plain_dir("mixtral") / "model.safetensors"), "pt") as src,
    ):
        keys = set(out.keys())
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight_packed" in keys
        assert not any(k.endswith("w1.weight") for k in keys)
        assert torch.equal(out.get_tensor("model.embed_tokens.weight"), src.get_tensor("model.embed_tokens.weight"))
        for layer, fold in report["layers"].items():  # the router and the norm change only by a folded scale
            router, norm = (f"model.layers.{layer}.{n}.weight" for n in ("block_sparse_moe.gate", "post_attention_layernorm"))
            if fold["input_scale"] is None:
                assert torch.equal(out.get_tensor(router), src.get_tensor(router))
                continue
            s = src.get_tensor(norm) / out.get_tensor(norm)
            torch.testing.assert_close(out.get_tensor(router), src.get_tensor(router) * s)
            assert not torch.allclose(s, torch.ones_like(s))
    draft = DraftModel.load(folder, device="cpu", mode="dequant-cache")
    assert draft.packed_bytes == report["packed_bytes"]
    # what the memory plan reserves is what the draft holds: its dequantized cache (fp32 here: 8x the
    # packed int4 codes, less the packed scales), not the packed bytes
    assert draft.device_bytes == draft.kernels.nbytes + draft.dense_bytes
    assert draft.kernels.nbytes > 4 * draft.packed_bytes
    packed = DraftModel.load(folder, device="cpu", mode="dequant-on-the-fly")
    assert packed.device_bytes < draft.device_bytes


def test_rtn_without_calibration_and_awq_needs_it(plain_dir, tmp_path) -> None:
    report = quantize_model(plain_dir("mixtral"), tmp_path / "rtn", method="rtn", progress=False)
    assert report["calibration"]["tokens"] == 0 and report["layers"]["0"]["mse_gate_up"] is None
    with pytest.raises(ValueError, match="calib"):
        quantize_model(plain_dir("mixtral"), tmp_path / "awq", method="awq", progress=False)


def test_awq_experts_without_tokens_fall_back_to_rtn(plain_dir, tmp_path) -> None:
    report = quantize_model(
        plain_dir("mixtral"),
        tmp_path / "d",
        method="awq",
        calib_ids=[3],
        cap=4,
        grid=4,
        progress=False,
        generation=GenerationSpec(windows=0),
    )
    # One token (no self-generated calibration) reaches top-2 of 8 experts per layer: six experts
    # per layer get none.
    assert report["rtn_fallback_experts"] == 3 * 6


def test_load_rejects_a_folder_that_is_not_a_draft(plain_dir) -> None:
    with pytest.raises(CheckpointError, match="not a Specter draft"):
        DraftModel.load(plain_dir("mixtral"), device="cpu")


def test_bf16_checkpoint_keeps_bf16_scales_and_dense_parts(tmp_path, calib_ids) -> None:
    torch.manual_seed(0)
    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_config(CONFIGS["qwen3_moe"], dtype=torch.bfloat16).save_pretrained(src)
    quantize_model(src, tmp_path / "d", calib_ids=calib_ids, cap=64, grid=5, progress=False)
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as handle:
        assert (
            handle.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight_scale").dtype == torch.bfloat16
        )
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    with torch.no_grad():
        want = _target(src)(_ids()).logits.float()
    got = DraftModel.load(tmp_path / "d", device="cpu", mode="dequant-cache").forward(_ids())
    assert float((got - want).norm() / want.norm()) < 3e-2




def _same_experts_loop(plain: str, draft_folder: str, dtype: torch.dtype, grouped: bool = False) -> None:
    draft = DraftModel.load(draft_folder, device="cpu", mode="dequant-cache")
    experts, _ = read_experts(draft.loaded, scheme_for(draft.loaded.checkpoint.config["quantization_config"]))
    layer = draft.loaded.moe_layers[0]
    module = draft.loaded.experts_modules[layer]
    reference = _target(plain).model.layers[layer].mlp.experts.to(dtype)
    with torch.no_grad():
        for expert in range(reference.num_experts):
            gate, up, down = experts[(layer, expert)]
            reference.gate_up_proj[expert] = torch.cat([gate.dequantize(), up.dequantize()])
            reference.down_proj[expert] = down.dequantize()
    runner = DraftExperts(ExpertKernels(experts, "dequant-cache", dtype, torch.device("cpu")), grouped=grouped)
    gen = torch.Generator().manual_seed(3)
    k = draft.loaded.top_k
    for tokens in (1, 1, 2, 3, 9, 33):
        hidden = torch.randn(tokens, reference.gate_up_proj.shape[-1], generator=gen).to(dtype)
        index = torch.stack([torch.randperm(reference.num_experts, generator=gen)[:k] for _ in range(tokens)])
        index[-1] = index[0]  # two tokens share all their experts
        weights = torch.rand(tokens, k, generator=gen)
        with torch.no_grad():
            want = reference(hidden, index, weights)
            got = runner.forward(module, layer, hidden, index, weights)
        if grouped:  # one batched weighted sum, not k rounded adds: equal to rounding
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            continue
        assert torch.equal(got, want), f"{tokens} tokens: max |diff| {float((got - want).abs().max())}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_loop_is_transformers_bit_for_bit(family, dtype, plain_dir, draft_dir) -> None:
    """The draft's per-expert loop (sorted by expert once) adds in transformers' order, so it equals
    transformers' eager loop exactly; the grouped calls (the default) equal it to rounding."""
    _same_experts_loop(str(plain_dir(family)), str(draft_dir(family, "awq")), dtype)
    _same_experts_loop(str(plain_dir(family)), str(draft_dir(family, "awq")), dtype, grouped=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_loop_is_transformers_bit_for_bit_on_the_shipped_model(dtype) -> None:
    """The same on the embedded moe-fine (64 experts, top-4, H 256), where torch's bf16 kernels
    take their vectorized paths."""
    _same_experts_loop(str(DEFAULT_MODEL), str(DEFAULT_MODEL) + "-awq", dtype)
