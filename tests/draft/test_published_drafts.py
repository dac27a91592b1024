"""Published int4 checkpoints of the target run as drafts without re-quantizing (issue 20, point 3).

Each format's checkpoint is built with the format's own library where it installs on this CPU:
AutoAWQ GEMM with AutoAWQ's packing (``WQLinear_GEMM.from_linear``) and checked against its
unpacking (``dequantize_gemm``); compressed-tensors W4A16 with the compressed-tensors compressor.
GPTQModel needs torch ≥ 2.14.1 (the project pins the CPU wheel 2.13.0) and AutoGPTQ ships only
CUDA builds, so GPTQ checkpoints are written here from the published layout (``qweight`` packed
along the input dim, ``qzeros`` along the output dim, ``g_idx``, v1's ``z − 1``), and the reader is
checked against the codes they were written from. Every expert *and* the attention projections
are quantized, as these exporters do; each draft then speculates losslessly against its target.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file, save_file
from tiny_models import CONFIGS, save_tiny
from transformers import AutoModelForCausalLM

from specter.config import LinkConfig, SlotConfig
from specter.draft.format.published import scheme_for
from specter.draft.runner import DraftModel
from specter.engine import Engine
from specter.target import OffloadedTarget

with warnings.catch_warnings():  # AutoAWQ announces its deprecation on import
    warnings.simplefilter("ignore")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

GROUP = 16
PROMPT = [5, 17, 3, 99, 42, 7, 64, 23]
NEW = 24
FAMILIES = ("deepseek_v2", "deepseek_v3", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe")


# AutoAWQ's packer wants output dims that are multiples of 32: the tiny models, widened.
WIDER = {"mixtral": {"intermediate_size": 64}, "phimoe": {"intermediate_size": 64},
         "qwen2_moe": {"moe_intermediate_size": 32}, "qwen3_moe": {"moe_intermediate_size": 32},
         "olmoe": {"intermediate_size": 32}, "deepseek_v2": {"moe_intermediate_size": 32},
         "deepseek_v3": {"moe_intermediate_size": 32}}


def tiny_target(family: str, folder: Path) -> Path:
    config = CONFIGS[family]
    wide = type(config)(**{**config.to_dict(), **WIDER[family]})
    with patch.dict(CONFIGS, {family: wide}):
        return save_tiny(family, folder)


def _quantized_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Routed experts, attention projections and shared experts — what AutoAWQ / GPTQ exporters
    quantize (routers, norms, embeddings and lm_head stay full precision) — where the shape fits
    the packers (output a multiple of 32, input of the group)."""
    keep = (".experts.", ".self_attn.", ".shared_expert.", ".shared_experts.")
    return sorted(
        k.removesuffix(".weight") for k, t in tensors.items()
        if k.endswith("_proj.weight") or k.endswith((".w1.weight", ".w2.weight", ".w3.weight"))
        if t.dim() == 2 and any(p in k for p in keep) and "layers." in k
        and t.shape[0] % 32 == 0 and t.shape[1] % GROUP == 0
    )


def _minmax(weight: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsigned codes (out, in), zero points and fp16 scales (out, groups), W ≈ (q − z)·s."""
    out, inp = weight.shape
    w = weight.float().view(out, inp // GROUP, GROUP)
    qmax = (1 << bits) - 1
    if symmetric:
        scale = (w.abs().amax(-1) * 2 / qmax * 1.001).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / qmax * 1.001).clamp(min=1e-6).half().float()
        zero = torch.round(-lo / scale).clamp(0, qmax)
    codes = (torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, qmax)
    return codes.view(out, inp).long(), zero.long(), scale.half()


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes along the last dim, element j of a word in bits [bits·j, bits·(j+1))."""
    per = 32 // bits
    v = values.long().view(*values.shape[:-1], -1, per)
    words = (v << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _save(target: Path, out: Path, tensors: dict[str, torch.Tensor], qconfig: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (target / extra).is_file():
            shutil.copy2(target / extra, out / extra)
    return out


def autoawq_checkpoint(target: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An AutoAWQ GEMM checkpoint packed by AutoAWQ; returns it and AutoAWQ's own dequantized
    weights (``dequantize_gemm``) per module, ``(out, in)``."""
    tensors = load_file(str(next(target.glob("*.safetensors"))))
    reference = {}
    for module in _quantized_modules(tensors):
        weight = tensors.pop(f"{module}.weight")
        codes, zero, scale = _minmax(weight, 4, symmetric=False)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = ((codes - zero.repeat_interleave(GROUP, 1)) * scale.float().repeat_interleave(GROUP, 1))
        packed = WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=scale.T.contiguous(), zeros=zero.T.contiguous())
        for name in ("qweight", "qzeros", "scales"):
            tensors[f"{module}.{name}"] = getattr(packed, name)
        # AutoAWQ's unpacking, its fp16 scales widened so that (q − z)·s is exact, as Specter computes it.
        reference[module] = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, GROUP).T
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": ["gate"]}
    return _save(target, out, tensors, qconfig), reference


def gptq_checkpoint(target: Path, out: Path, bits: int, symmetric: bool, act_order: bool,
                    fmt: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GPTQ checkpoint in the published layout; returns it and ``(q − z)·s`` per module."""
    tensors = load_file(str(next(target.glob("*.safetensors"))))
    reference = {}
    gen = torch.Generator().manual_seed(7)
    for module in _quantized_modules(tensors):
        weight = tensors.pop(f"{module}.weight")
        inp = weight.shape[1]
        order = torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)
        codes_sorted, zero, scale = _minmax(weight[:, order], bits, symmetric)  # groups: runs of ``order``
        codes = torch.empty_like(codes_sorted)
        codes[:, order] = codes_sorted
        g_idx = torch.empty(inp, dtype=torch.int32)
        g_idx[order] = (torch.arange(inp) // GROUP).to(torch.int32)
        tensors[f"{module}.qweight"] = _pack_input_dim(codes, bits)
        tensors[f"{module}.qzeros"] = _words(zero.T - (1 if fmt == "gptq" else 0), bits)
        tensors[f"{module}.scales"] = scale.T.contiguous()
        tensors[f"{module}.g_idx"] = g_idx
        gi = g_idx.long()
        reference[module] = (codes - zero[:, gi]).float() * scale.float()[:, gi]
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "sym": symmetric, "desc_act": act_order,
               "checkpoint_format": fmt}
    return _save(target, out, tensors, qconfig), reference


def _pack_input_dim(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's ``qweight``: ``(in / p, out)``, word row r holding input rows p·r … p·r + p − 1."""
    return _words(codes, bits).T.contiguous()


def compressed_tensors_checkpoint(target: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A symmetric W4A16 compressed-tensors checkpoint made by the compressed-tensors compressor,
    with the preset's class target ``Linear``; returns it and the library's decompressed weights."""
    tensors = load_file(str(next(target.glob("*.safetensors"))))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    reference = {}
    for module in _quantized_modules(tensors):
        weight = tensors.pop(f"{module}.weight")
        w = weight.float().view(weight.shape[0], -1, GROUP)
        scale = (w.abs().amax(-1) / 7.5 * 1.001).clamp(min=1e-6)
        parts = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale, "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8)},
            scheme,
        )
        assert "weight_zero_point" not in parts  # symmetric: the library stores none
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        reference[module] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": scheme.model_dump()},
               "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]}
    return _save(target, out, tensors, qconfig), reference


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized module as Specter's reader dequantizes it."""
    config = json.loads((folder / "config.json").read_text())
    scheme = scheme_for(config["quantization_config"])
    tensors = load_file(str(folder / "model.safetensors"))
    modules = sorted(k.removesuffix(f".{scheme.main}") for k in tensors if k.endswith(f".{scheme.main}"))
    return {m: scheme.read(m, tensors.__getitem__, tensors.__contains__).dequantize() for m in modules}


def _speculate(target: Path, draft: Path, window: int) -> tuple[list[int], list[int], float]:
    reference = AutoModelForCausalLM.from_pretrained(str(target), experts_implementation="eager").eval()
    want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    offloaded = OffloadedTarget.load(target, SlotConfig(fraction=0.5), LinkConfig(kind="sim"), policy="specter+fixed",
                                     device="cpu")
    proposer = DraftModel.load(draft, device="cpu", mode="dequant-cache")
    try:
        tokens, stats = Engine(offloaded, proposer, window).generate(list(PROMPT), NEW)
    finally:
        offloaded.close()
        proposer.close()
    accepted = sum(i * c for i, c in enumerate(stats.extra["accepted_hist"])) / max(1, stats.extra["rounds"])
    return tokens, want[0, len(PROMPT):].tolist(), accepted


BUILDERS = {
    "autoawq": lambda t, o: autoawq_checkpoint(t, o),
    "gptq-sym": lambda t, o: gptq_checkpoint(t, o, 4, True, False, "gptq"),
    "gptq-asym": lambda t, o: gptq_checkpoint(t, o, 4, False, False, "gptq_v2"),
    "gptq-sym-act-order": lambda t, o: gptq_checkpoint(t, o, 4, True, True, "gptq"),
    "gptq-asym-act-order": lambda t, o: gptq_checkpoint(t, o, 4, False, True, "gptq_v2"),
    "gptq-8bit": lambda t, o: gptq_checkpoint(t, o, 8, True, False, "gptq"),
    "compressed-tensors-w4a16": lambda t, o: compressed_tensors_checkpoint(t, o),
}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_each_format_reads_to_its_librarys_weights(kind, tmp_path) -> None:
    target = tiny_target("qwen2_moe", tmp_path / "target")
    folder, reference = BUILDERS[kind](target, tmp_path / "draft")
    ours = _read_all(folder)
    assert set(ours) == set(reference) and any(".self_attn." in m for m in ours)
    for module, weight in reference.items():
        assert torch.equal(ours[module], weight), module


# Every format on two families (one with a shared expert, one without), every family in one format:
# what the reader does per format does not depend on the family, and per family not on the format.
LOSSLESS_CASES = sorted({(k, f) for k in BUILDERS for f in ("mixtral", "qwen2_moe")} | {("autoawq", f) for f in FAMILIES})


@pytest.mark.parametrize(("kind", "family"), LOSSLESS_CASES)
def test_a_published_checkpoint_speculates_losslessly(kind, family, tmp_path) -> None:
    target = tiny_target(family, tmp_path / "target")
    folder, _ = BUILDERS[kind](target, tmp_path / "draft")
    tokens, want, accepted = _speculate(target, folder, window=4)
    assert tokens == want
    # The draft follows its target: a misread one (its logits noise) would accept ~4/128 of a token
    # per round; on these chaotic random tiny models an int4 draft with quantized attention keeps
    # 0.4–2 of 4, and which near-ties its bf16 matmuls break depends on the CPU's kernels.
    assert accepted >= 0.2


def test_a_published_draft_computes_its_dequantized_weights(tmp_path) -> None:
    """The dense modules (attention) are dequantized into the model, the experts computed from
    codes: the draft's logits equal transformers' with every quantized weight dequantized."""
    target = tiny_target("mixtral", tmp_path / "target")
    folder, reference = autoawq_checkpoint(target, tmp_path / "draft")
    tensors = load_file(str(next(target.glob("*.safetensors"))))
    tensors.update({f"{m}.weight": w.float().contiguous() for m, w in reference.items()})
    dense = tmp_path / "dequantized"
    shutil.copytree(target, dense)
    save_file(tensors, str(next(dense.glob("*.safetensors"))), metadata={"format": "pt"})
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = AutoModelForCausalLM.from_pretrained(str(dense), experts_implementation="eager")(ids).logits
    for mode in ("dequant-cache", "dequant-on-the-fly"):
        draft = DraftModel.load(folder, device="cpu", mode=mode)
        torch.testing.assert_close(draft.forward(ids), want, rtol=1e-5, atol=1e-5)
        draft.close()


def test_act_order_weights_compute_alike_in_every_mode() -> None:
    """An act-order weight (GPTQ ``g_idx``) through the int4 kernel, the dequantized cache and the
    on-the-fly path: each permutes the input as the codes' columns say."""
    from specter.draft.format.published import _with_act_order
    from specter.draft.format.qweight import quantize_weight
    from specter.draft.kernels import ExpertKernels

    gen = torch.Generator().manual_seed(2)
    hidden, inter = 64, 32
    x = torch.randn(3, hidden, generator=gen)
    weights = []
    for out, inp in ((inter, hidden), (inter, hidden), (hidden, inter)):
        order = torch.randperm(inp, generator=gen)
        plain = quantize_weight(torch.randn(out, inp, generator=gen)[:, order], 4, 32, torch.float32)
        g_idx = torch.empty(inp, dtype=torch.int64)
        g_idx[order] = torch.arange(inp) // 32
        unpermuted = type(plain)(torch.empty_like(plain.codes).index_copy_(1, order, plain.codes), plain.scale,
                                 plain.zero, 4, 32)
        weights.append(_with_act_order(unpermuted, g_idx, "g_idx"))
    gate, up, down = weights
    assert gate.order is not None and up.order is not None  # down: one group, nothing to reorder
    want_gu = torch.nn.functional.linear(x, torch.cat([gate.dequantize(), up.dequantize()]))
    want = torch.nn.functional.linear(want_gu[:, :inter] * want_gu[:, inter:], down.dequantize())
    for mode in ("int4-kernel", "dequant-cache", "dequant-on-the-fly"):
        kernels = ExpertKernels({(0, 0): (gate, up, down)}, mode, torch.float32, torch.device("cpu"))
        got_gu = kernels.gate_up((0, 0), x)
        got = kernels.down((0, 0), got_gu[:, :inter] * got_gu[:, inter:])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["autoawq", "gptq-sym"])
def test_a_truncated_published_tensor_is_named_before_any_work(kind, tmp_path) -> None:
    target = tiny_target("mixtral", tmp_path / "target")
    folder, _ = BUILDERS[kind](target, tmp_path / "draft")
    tensors = load_file(str(folder / "model.safetensors"))
    key = "model.layers.1.block_sparse_moe.experts.2.w3.qweight"
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.2\.w3: qweight .* do not fit .*truncated"):
        DraftModel.load(folder, device="cpu", mode="dequant-cache")
