"""AWQ, RTN and int8 quantization of expert weights."""

from __future__ import annotations

import pytest
import torch

from specter.draft.format.qweight import choose_group_size, quantize_weight
from specter.draft.quantize.awq import QuantSpec, quantize_expert, quantize_experts
from specter.draft.quantize.clip import clip_ratios, search_clip
from specter.draft.quantize.search import ExpertLoss, apply_clip, output_error, search_scale


def _acts(gen: torch.Generator, n: int, outliers: bool) -> torch.Tensor:
    x = torch.randn(n, 128, generator=gen)
    if outliers:
        x[:, :4] *= 30.0  # a few input channels of large magnitude, as in real LLM activations
    return x


@pytest.mark.parametrize("outliers", [True, False])
def test_awq_beats_rtn_when_a_few_input_channels_dominate(outliers: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen)
    calib, held_out = _acts(gen, 256, outliers), _acts(gen, 256, outliers)
    chosen = search_scale(weight, calib, QuantSpec("awq", 128), 128)
    awq = chosen.quant
    rtn = quantize_weight(weight, 4, 128, torch.float32)
    ratio = output_error(weight, awq.dequantize(), held_out) / output_error(
        weight, rtn.dequantize(), held_out
    )
    assert chosen.error <= chosen.rtn_error
    if outliers:
        assert chosen.alpha > 0 and awq.awq_scale is not None
        assert ratio < 0.5  # protecting the salient channels cuts the output error a lot
    else:
        assert ratio > 0.8  # without salient channels there is little to gain


def test_rtn_error_is_within_half_a_step() -> None:
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    quant = quantize_weight(weight, 4, 32, torch.float32)
    assert quant.codes.min() >= -8 and quant.codes.max() <= 7
    assert quant.zero.min() >= -8 and quant.zero.max() <= 7
    step = quant.scale.repeat_interleave(32, dim=1)
    assert ((weight - quant.dequantize()).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize(
    "in_dim,want", [(256, 128), (128, 128), (64, 64), (96, 32), (48, 16), (40, 8), (7, 7)]
)
def test_group_size_fallbacks(in_dim: int, want: int) -> None:
    assert choose_group_size(in_dim, 128) == want


def test_fused_3d_equals_per_expert_and_counts_fallbacks() -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(3, 32, 64, generator=gen), torch.randn(3, 64, 16, generator=gen)
    inputs = [
        (torch.randn(20, 64, generator=gen), torch.randn(20, 16, generator=gen)),
        None,
        (torch.randn(5, 64, generator=gen), torch.randn(5, 16, generator=gen)),
    ]
    fused = quantize_experts(gate_up, down, inputs, method="awq", group_size=128, grid=8)
    assert [q.fallback for q in fused] == [False, True, False]
    assert fused[1].alpha_gate_up is None and fused[1].tokens == 0
    one = quantize_experts(gate_up[2], down[2], [inputs[2]], method="awq", group_size=128, grid=8)[0]
    assert torch.equal(one.gate.codes, fused[2].gate.codes) and torch.equal(
        one.down.codes, fused[2].down.codes
    )
    # gate and up see the same input, so they carry the same AWQ scale.
    if fused[0].gate.awq_scale is not None:
        assert torch.equal(fused[0].gate.awq_scale, fused[0].up.awq_scale)


def test_methods_rank_by_weight_error() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(64, 128, generator=gen), torch.randn(128, 32, generator=gen)
    x, h = torch.randn(64, 128, generator=gen), torch.randn(64, 32, generator=gen)
    errors = {}
    for method in ("rtn", "int8"):
        q = quantize_expert(gate_up, down, x, h, QuantSpec(method, 128))
        errors[method] = q.mse_gate_up
        assert q.gate.num_bits == (8 if method == "int8" else 4)
    assert errors["int8"] < errors["rtn"] / 50
    q = quantize_expert(gate_up, down, x, h, QuantSpec("int8", 128))
    assert q.gate.group_size == 128 and q.gate.scale.shape == (32, 1)  # per output channel


def test_bad_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="method"):
        QuantSpec("gptq")
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec("awq", 0)
    with pytest.raises(ValueError, match="clip_min"):
        QuantSpec("awq", clip_min=0.0)
    with pytest.raises(ValueError, match="clip"):
        quantize_weight(torch.zeros(4, 8), 4, 8, torch.float32, clip=torch.ones(4, 2))
    with pytest.raises(ValueError, match="inputs"):
        quantize_experts(torch.zeros(2, 8, 8), torch.zeros(2, 8, 4), [None])


def _expert_case(seed: int) -> tuple[torch.Tensor, ...]:
    """A small expert (H 64, I 32) with heavy-tailed weights and a few loud input channels."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(64, 64, generator=gen) * (1 + 4 * torch.rand(64, 64, generator=gen).pow(8))
    down = torch.randn(64, 32, generator=gen)
    x = _acts(gen, 96, True)[:, :64]
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    return gate_up, down, x, h, torch.rand(96, generator=gen)


@pytest.mark.parametrize("seed", range(4))
def test_clipping_never_raises_the_calibration_loss(seed: int) -> None:
    gate_up, down, x, h, router = _expert_case(seed)
    weight = router.pow(2)
    loss = ExpertLoss(gate_up, down, x, weight, torch.nn.functional.silu)
    spec = QuantSpec("awq", 32, grid=6)
    for w, inputs, score in ((gate_up, x, loss), (down, h, None)):
        if score is None:
            score = lambda q, w=w, inputs=inputs: output_error(w, q.dequantize(), inputs, weight)  # noqa: E731
        unclipped = search_scale(w, inputs, spec, 32, score, weight)
        clipped = apply_clip(w, inputs, weight, unclipped, spec, score)
        assert clipped.error <= unclipped.error <= unclipped.rtn_error
        assert clipped.error == pytest.approx(score(clipped.quant))
        # the stored form is unchanged: codes, group scales and zero points, AWQ scale
        assert clipped.quant.scale.shape == unclipped.quant.scale.shape


def test_clip_search_picks_a_shrunk_range_when_one_weight_is_an_outlier() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 32, generator=gen)
    weight[:, 0] = 40.0  # one outlier per row stretches every group's range
    x = torch.randn(256, 32, generator=gen)
    x[:, 0] = 0.0  # ... but its input is silent, so rounding it costs nothing
    ratios = clip_ratios(11, 0.5)
    clip = search_clip(weight, x, None, 4, 32, torch.float32, None, ratios)
    assert clip.shape == (8, 1) and (clip < 1.0).all()
    clipped = quantize_weight(weight, 4, 32, torch.float32, clip=clip)
    plain = quantize_weight(weight, 4, 32, torch.float32)
    assert output_error(weight, clipped.dequantize(), x) < output_error(weight, plain.dequantize(), x) / 4


def test_awq_expert_output_error_is_below_rtn_with_router_weights() -> None:
    gate_up, down, x, h, router = _expert_case(7)
    awq = quantize_expert(gate_up, down, x, h, QuantSpec("awq", 32, grid=6), router)
    rtn = quantize_expert(gate_up, down, x, h, QuantSpec("rtn", 32), router)
    assert awq.out_err < rtn.out_err and awq.out_ref == pytest.approx(rtn.out_ref)
    assert awq.clip_gate_up is not None and awq.clip_gate_up <= 1.0
