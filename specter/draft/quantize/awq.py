"""Activation-aware weight quantization (AWQ) of routed experts, plus RTN int4 and int8.

``QuantSpec`` says how; ``quantize_expert`` quantizes one expert and ``quantize_layer`` a layer's
experts, placing AWQ's scales in the chosen layout (one folded gate/up scale per layer, or a scale
per expert). The searches themselves, and the loss they answer to, are
``specter.draft.quantize.search``'s.

Experts that received no calibration token fall back to RTN and are counted. See docs/draft.md
for why AWQ's scale ``s`` is stored as an extra tensor instead of being folded into a neighbouring op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specter.draft.format.qweight import QuantWeight, choose_group_size, quantize_weight
from specter.draft.quantize import LAYOUTS, METHODS
from specter.draft.quantize.search import (
    ExpertLoss,
    Searched,
    apply_clip,
    layer_scale,
    output_error,
    search_weight,
)

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class QuantSpec:
    """How experts are quantized.

    Attributes:
        method: ``awq`` (int4 + activation-aware scales and clipping), ``rtn`` (int4
            round-to-nearest), ``int8`` (per-output-channel asymmetric int8).
        group_size: requested int4 group size (falls back per input dim, see ``choose_group_size``).
        grid: number of α values tried in [0, 1] by AWQ's scale search.
        scale_dtype: dtype the quantization scales are stored in (the model dtype).
        duo: also try the weight-magnitude ("duo") form of the scale.
        clip_grid: clipping ratios tried from 1.0 down to ``clip_min`` (1: no clipping search).
        clip_min: the smallest clipping ratio, in (0, 1].
        router_weighted: weight each token's error by its squared router weight.
        layout: ``folded`` | ``per-expert`` (see ``LAYOUTS``); only AWQ has a scale to place.
    """

    method: str = "awq"
    group_size: int = 128
    grid: int = 20
    scale_dtype: torch.dtype = torch.float32
    duo: bool = True
    clip_grid: int = 11
    clip_min: float = 0.5
    router_weighted: bool = True
    layout: str = "folded"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size}")
        if self.grid < 2:
            raise ValueError(f"grid must be at least 2 (α = 0 and α = 1), got {self.grid}")
        if self.clip_grid < 1:
            raise ValueError(f"clip_grid must be a positive integer, got {self.clip_grid}")
        if not 0.0 < self.clip_min <= 1.0:
            raise ValueError(f"clip_min must lie in (0, 1], got {self.clip_min}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")

    @property
    def num_bits(self) -> int:
        return 8 if self.method == "int8" else 4

    def group_for(self, in_dim: int) -> int:
        """Group size used for an input dim (int8 is per channel: one group per row)."""
        return in_dim if self.method == "int8" else choose_group_size(in_dim, self.group_size)


@dataclass
class QuantExpert:
    """One routed expert, quantized, with what the fidelity report needs.

    Attributes:
        gate, up, down: the three quantized projections (gate and up share ``awq_scale``).
        alpha_gate_up, alpha_down: chosen α (None unless AWQ ran on calibration inputs).
        fallback: AWQ was asked for but the expert got no calibration token (so RTN).
        tokens: calibration tokens the quantization used for this expert.
        mse_gate_up, mse_down: output mean squared error on those tokens (None without tokens).
        duo_gate_up, duo_down: the chosen scale has the weight-magnitude term.
        clip_gate_up, clip_down: mean clipping ratio (None unless AWQ ran).
        out_err, out_ref: router-weighted ``Σ ‖y − ŷ‖²`` and ``Σ ‖y‖²`` of the expert's output
            with all three projections quantized, over its calibration tokens.
        down_scale: the folded layout's down scale ``s``, already folded (up's rows hold ``1/s``,
            down is ``Q(D s)`` with no scale of its own); None where nothing was folded.
    """

    gate: QuantWeight
    up: QuantWeight
    down: QuantWeight
    alpha_gate_up: float | None = None
    alpha_down: float | None = None
    fallback: bool = False
    tokens: int = 0
    mse_gate_up: float | None = None
    mse_down: float | None = None
    duo_gate_up: bool = False
    duo_down: bool = False
    clip_gate_up: float | None = None
    clip_down: float | None = None
    out_err: float = 0.0
    out_ref: float = 0.0
    down_scale: torch.Tensor | None = None

    def effective(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up (2I, H), down (H, I))`` in fp32 as they act on the expert's original input,
        with a down scale folded into up (``down_scale``) moved back to down."""
        up, down = self.up.dequantize(), self.down.dequantize()
        if self.down_scale is not None:
            up, down = up * self.down_scale.unsqueeze(-1), down / self.down_scale
        return torch.cat([self.gate.dequantize(), up]), down


def quantize_expert(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    x: torch.Tensor | None,
    h: torch.Tensor | None,
    spec: QuantSpec,
    router_weight: torch.Tensor | None = None,
    act: Activation = F.silu,
) -> QuantExpert:
    """Quantize one expert.

    Args:
        gate_up: ``(2I, H)`` gate rows then up rows (transformers' fused layout).
        down: ``(H, I)``.
        x: ``(n, H)`` calibration inputs routed to this expert, or None.
        h: ``(n, I)`` the matching intermediate activations ``act(gate x) * up x``, or None.
        spec: method, group size, search grids, scale dtype.
        router_weight: ``(n,)`` the router weight of each calibration token, or None (all 1).
        act: the expert's activation (AWQ's gate/up loss runs the expert).
    """
    two_i, hidden = gate_up.shape
    if down.shape != (hidden, two_i // 2):
        raise ValueError(
            f"down has shape {tuple(down.shape)}, expected {(hidden, two_i // 2)} for gate_up {(two_i, hidden)}"
        )
    if x is None or h is None or x.shape[0] == 0:
        return _round_to_nearest(gate_up, down, spec, fallback=spec.method == "awq")
    squared = router_weight.float().pow(2) if router_weight is not None else None
    weight = squared if spec.router_weighted else None
    expert_loss = ExpertLoss(gate_up, down, x, weight, act)
    if spec.method != "awq":
        expert = _round_to_nearest(gate_up, down, spec, fallback=False)
    else:
        gu = search_weight(gate_up, x, weight, spec, spec.group_for(hidden), expert_loss)
        dn = search_weight(down, h, weight, spec, spec.group_for(two_i // 2))
        gate, up = split_rows(gu.quant, two_i // 2)
        expert = QuantExpert(
            gate, up, dn.quant, gu.alpha, dn.alpha, duo_gate_up=gu.duo, duo_down=dn.duo,
            clip_gate_up=gu.clip, clip_down=dn.clip,
        )
    _score(expert, gate_up, down, x, h, expert_loss, squared)
    return expert


@dataclass
class QuantLayer:
    """The routed experts of one MoE layer, quantized.

    Attributes:
        experts: one ``QuantExpert`` per expert, weights as computed on the layer's *original*
            input (in the folded layout gate and up carry the layer's ``input_scale`` as their
            ``awq_scale``, and up's rows already hold the down scale).
        input_scale: the folded layout's per-layer gate/up scale ``s`` (None: nothing to fold —
            per-expert layout, RTN, int8, or AWQ chose no scale); the draft file divides the
            post-attention norm by it and multiplies the other readers of that norm by it.
        alpha, duo: the layer scale's α and form (folded layout only).
    """

    experts: list[QuantExpert]
    input_scale: torch.Tensor | None = None
    alpha: float | None = None
    duo: bool = False


def quantize_layer(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None],
    spec: QuantSpec,
    act: Activation = F.silu,
) -> QuantLayer:
    """Quantize every routed expert of one layer.

    Args:
        weights: per expert ``(gate_up (2I, H), down (H, I))``.
        inputs: per expert ``(x, h, router_weight)`` calibration inputs, or None.
        spec: method, layout, group size, search settings.
        act: the experts' activation.

    In the ``folded`` AWQ layout (AutoAWQ's for MoE layers) one input scale is searched for all
    experts' gate and up — the loss is the sum over experts of the router-weighted expert-output
    error, so the scale serves the layer's traffic — then each expert's clipping and down
    projection are searched as in the per-expert layout, and down's scale is folded into up's
    rows: ``down(act(g x) · (u x)) = (Q(D s) / s)(h) = Q(D s)(act(g x) · (u x) / s)``.
    """
    if len(weights) != len(inputs):
        raise ValueError(f"inputs has {len(inputs)} entries for {len(weights)} experts")
    if spec.method != "awq" or spec.layout == "per-expert":
        experts = []
        for (gate_up, down), rec in zip(weights, inputs, strict=True):
            x, h, w = rec if rec is not None else (None, None, None)
            experts.append(quantize_expert(gate_up, down, x, h, spec, w, act))
        return QuantLayer(experts)
    hidden, inter = weights[0][0].shape[1], weights[0][1].shape[1]
    gu_group = spec.group_for(hidden)
    calibrated = {e: rec for e, rec in enumerate(inputs) if rec is not None and rec[0].shape[0]}
    if not calibrated:
        return QuantLayer([_round_to_nearest(gu, dn, spec, fallback=True) for gu, dn in weights])
    squared = {e: rec[2].float().pow(2) if rec[2] is not None else None for e, rec in calibrated.items()}
    token_weight = {e: w if spec.router_weighted else None for e, w in squared.items()}
    losses = {
        e: ExpertLoss(weights[e][0], weights[e][1], rec[0], token_weight[e], act) for e, rec in calibrated.items()
    }
    scale, alpha, duo, quants = layer_scale(weights, calibrated, losses, spec, gu_group)
    experts = []
    for e, (gate_up, down) in enumerate(weights):
        if e not in calibrated:
            experts.append(_round_to_nearest(gate_up, down, spec, fallback=True, gate_up_scale=scale))
            continue
        x, h, _ = calibrated[e]
        chosen = Searched(quants[e], losses[e](quants[e]), alpha, duo)
        gu = apply_clip(gate_up, x, token_weight[e], chosen, spec, losses[e])
        dn = search_weight(down, h, token_weight[e], spec, spec.group_for(inter))
        gate, up = split_rows(gu.quant, inter)
        up, down_q = fold_down_scale(up, dn.quant)
        expert = QuantExpert(
            gate, up, down_q, alpha, dn.alpha, duo_gate_up=duo, duo_down=dn.duo, clip_gate_up=gu.clip,
            clip_down=dn.clip, down_scale=dn.quant.awq_scale,
        )
        _score(expert, gate_up, down, x, h, losses[e], squared[e])
        experts.append(expert)
    return QuantLayer(experts, scale, alpha, duo)


def fold_down_scale(up: QuantWeight, down: QuantWeight) -> tuple[QuantWeight, QuantWeight]:
    """Move down's AWQ input scale ``s`` into up's rows: up's row ``j`` step sizes divided by
    ``s_j`` (codes and zero points unchanged), down left as ``Q(D s)`` with no scale of its own.
    Exact up to rounding the new step sizes to their storage dtype."""
    if down.awq_scale is None:
        return up, down
    s = down.awq_scale.float()
    if s.shape != (up.shape[0],):
        raise ValueError(f"down's scale has shape {tuple(s.shape)}, up has {up.shape[0]} rows")
    scale = (up.scale.float() / s.unsqueeze(-1)).to(up.scale.dtype)
    scale = scale.clamp(min=torch.finfo(up.scale.dtype).tiny)
    folded_up = QuantWeight(up.codes, scale, up.zero, up.num_bits, up.group_size, up.awq_scale)
    return folded_up, QuantWeight(down.codes, down.scale, down.zero, down.num_bits, down.group_size, None)


def _score(
    expert: QuantExpert,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    loss: ExpertLoss,
    squared_weight: torch.Tensor | None,
) -> None:
    """Fill the report fields: per-projection MSE and the expert's output error, each token
    weighted by its squared router weight (its share of the layer's output), whatever the spec."""
    gate_up_q, down_q = expert.effective()
    expert.tokens = int(x.shape[0])
    expert.mse_gate_up = output_error(gate_up, gate_up_q, x)
    expert.mse_down = output_error(down, down_q, h)
    gate, up = F.linear(loss.x, gate_up_q).chunk(2, dim=-1)
    approx = F.linear(loss.act(gate) * up, down_q)
    w = torch.ones(x.shape[0], dtype=torch.float64) if squared_weight is None else squared_weight.double()
    expert.out_err = float(((approx - loss.y).double().pow(2).sum(-1) * w).sum())
    expert.out_ref = float((loss.y.double().pow(2).sum(-1) * w).sum())


def _round_to_nearest(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    spec: QuantSpec,
    fallback: bool,
    gate_up_scale: torch.Tensor | None = None,
) -> QuantExpert:
    """Round-to-nearest (``gate_up_scale``: the folded layout's layer scale, which every expert's
    gate and up must take)."""
    two_i, hidden = gate_up.shape
    gate_up_q = quantize_weight(gate_up, spec.num_bits, spec.group_for(hidden), spec.scale_dtype, gate_up_scale)
    down_q = quantize_weight(down, spec.num_bits, spec.group_for(two_i // 2), spec.scale_dtype)
    gate, up = split_rows(gate_up_q, two_i // 2)
    return QuantExpert(gate, up, down_q, fallback=fallback)


def quantize_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    inputs: Sequence[tuple[torch.Tensor, ...] | None] | None = None,
    method: str = "awq",
    group_size: int = 128,
    grid: int = 20,
    scale_dtype: torch.dtype | None = None,
) -> list[QuantExpert]:
    """Quantize the experts of one layer, each on its own (the per-expert layout; ``quantize_layer``
    places the folded layout's one scale per layer).

    Args:
        gate_up: fused ``(E, 2I, H)`` tensor, or one expert's ``(2I, H)``.
        down: fused ``(E, H, I)``, or one expert's ``(H, I)``.
        inputs: per expert ``(x, h)`` or ``(x, h, router_weight)`` calibration inputs, or None
            where an expert has none.
        method: ``awq`` | ``rtn`` | ``int8``.
        group_size: requested int4 group size.
        grid: α grid points for AWQ (the other search settings: ``QuantSpec``'s defaults).
        scale_dtype: dtype of the stored scales; default ``gate_up``'s dtype.
    """
    if gate_up.dim() == 2:
        gate_up, down = gate_up.unsqueeze(0), down.unsqueeze(0)
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not (E, 2I, H) / (E, H, I)"
        )
    spec = QuantSpec(method, group_size, grid, scale_dtype or gate_up.dtype, layout="per-expert")
    experts = gate_up.shape[0]
    if inputs is not None and len(inputs) != experts:
        raise ValueError(f"inputs has {len(inputs)} entries for {experts} experts")
    out = []
    for e in range(experts):
        rec = inputs[e] if inputs is not None else None
        x, h, w = (rec[0], rec[1], rec[2] if len(rec) > 2 else None) if rec is not None else (None, None, None)
        out.append(quantize_expert(gate_up[e], down[e], x, h, spec, w))
    return out


def split_rows(quant: QuantWeight, rows: int) -> tuple[QuantWeight, QuantWeight]:
    """Split a quantized fused ``gate_up`` into gate (first ``rows`` rows) and up; exact,
    because every group lies within one row."""

    def part(sl: slice) -> QuantWeight:
        return QuantWeight(
            quant.codes[sl].clone(),
            quant.scale[sl].clone(),
            quant.zero[sl].clone(),
            quant.num_bits,
            quant.group_size,
            quant.awq_scale,
        )

    return part(slice(0, rows)), part(slice(rows, None))
