"""Activation-aware weight quantization (AWQ) of routed experts, plus RTN int4 and int8.

For one expert, AWQ looks at the inputs that expert really receives (the tokens routed to it;
for ``down`` the intermediate ``act(gate(x)) * up(x)``). Input channels with large mean
magnitude matter most to the output, so the weight's columns are multiplied by
``s = mean(|x|)^α`` before group-wise int4 rounding: those columns then get relatively finer
steps. The runtime divides the activation by ``s`` (``y = Q(W·s) (x / s)``), which equals
``x · (Q(W·s) / s)ᵀ``. ``α`` is picked from a grid in [0, 1] by the output error
``‖x Wᵀ − x (Q(W·s)/s)ᵀ‖²`` on the recorded inputs; α = 0 is plain round-to-nearest (RTN), so
AWQ's calibration error is never above RTN's.

Gate and up share their input, hence one ``s``; ``down`` gets its own. Experts that received no
calibration token fall back to RTN and are counted. See docs/draft.md for why ``s`` is stored
as an extra tensor instead of being folded into a neighbouring op.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specter.draft.qweight import QuantWeight, choose_group_size, quantize_weight

log = logging.getLogger(__name__)

METHODS = ("awq", "rtn", "int8")


@dataclass(frozen=True)
class QuantSpec:
    """How experts are quantized.

    Attributes:
        method: ``awq`` (int4 + activation-aware scales), ``rtn`` (int4 round-to-nearest),
            ``int8`` (per-output-channel asymmetric int8).
        group_size: requested int4 group size (falls back per input dim, see ``choose_group_size``).
        grid: number of α values tried in [0, 1] by AWQ.
        scale_dtype: dtype the quantization scales are stored in (the model dtype).
    """

    method: str = "awq"
    group_size: int = 128
    grid: int = 20
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size}")
        if self.grid < 2:
            raise ValueError(f"grid must be at least 2 (α = 0 and α = 1), got {self.grid}")

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


def output_error(weight: torch.Tensor, effective: torch.Tensor, x: torch.Tensor) -> float:
    """Mean squared error of ``x Wᵀ`` against ``x W_effᵀ`` over all outputs of all tokens."""
    diff = weight.float() - effective.float()
    x = x.float()
    if x.shape[0] > x.shape[1]:
        # Fewer flops through the Gram matrix when there are more tokens than input channels.
        gram = x.double().T @ x.double()
        total = ((diff.double() @ gram) * diff.double()).sum()
    else:
        total = (x @ diff.T).double().pow(2).sum()
    return float(total) / (x.shape[0] * weight.shape[0])


def awq_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = mean(|x|)^α`` per input channel, normalised so that max·min = 1 (numerics only:
    min-max group quantization is invariant to a global factor on ``s``)."""
    s = x.float().abs().mean(dim=0).pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scale(
    weight: torch.Tensor, x: torch.Tensor, spec: QuantSpec, group_size: int
) -> tuple[float, QuantWeight, float]:
    """Grid-search α; return (α, the quantized weight for it, its output MSE on ``x``)."""
    best: tuple[float, QuantWeight, float] | None = None
    for alpha in torch.linspace(0.0, 1.0, spec.grid).tolist():
        # α = 0 is RTN: store no scale at all then, so RTN and AWQ-at-0 are the same bytes.
        s = awq_scale(x, alpha) if alpha > 0 else None
        quant = quantize_weight(weight, spec.num_bits, group_size, spec.scale_dtype, s)
        err = output_error(weight, quant.dequantize(), x)
        if best is None or err < best[2]:
            best = (alpha, quant, err)
    assert best is not None  # the grid has at least two points (QuantSpec checks)
    return best


def quantize_expert(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    x: torch.Tensor | None,
    h: torch.Tensor | None,
    spec: QuantSpec,
) -> QuantExpert:
    """Quantize one expert.

    Args:
        gate_up: ``(2I, H)`` gate rows then up rows (transformers' fused layout).
        down: ``(H, I)``.
        x: ``(n, H)`` calibration inputs routed to this expert, or None.
        h: ``(n, I)`` the matching intermediate activations ``act(gate x) * up x``, or None.
        spec: method, group size, α grid, scale dtype.
    """
    two_i, hidden = gate_up.shape
    if down.shape != (hidden, two_i // 2):
        raise ValueError(
            f"down has shape {tuple(down.shape)}, expected {(hidden, two_i // 2)} for gate_up {(two_i, hidden)}"
        )
    g_in, g_mid = spec.group_for(hidden), spec.group_for(two_i // 2)
    if x is None or h is None or x.shape[0] == 0:
        return _round_to_nearest(gate_up, down, spec, fallback=spec.method == "awq")
    if spec.method != "awq":
        expert = _round_to_nearest(gate_up, down, spec, fallback=False)
        expert.tokens = int(x.shape[0])
        expert.mse_gate_up = output_error(
            gate_up, torch.cat([expert.gate.dequantize(), expert.up.dequantize()]), x
        )
        expert.mse_down = output_error(down, expert.down.dequantize(), h)
        return expert
    alpha_gu, gate_up_q, mse_gu = search_scale(gate_up, x, spec, g_in)
    alpha_down, down_q, mse_down = search_scale(down, h, spec, g_mid)
    gate, up = split_rows(gate_up_q, two_i // 2)
    return QuantExpert(gate, up, down_q, alpha_gu, alpha_down, False, int(x.shape[0]), mse_gu, mse_down)


def _round_to_nearest(
    gate_up: torch.Tensor, down: torch.Tensor, spec: QuantSpec, fallback: bool
) -> QuantExpert:
    two_i, hidden = gate_up.shape
    gate_up_q = quantize_weight(gate_up, spec.num_bits, spec.group_for(hidden), spec.scale_dtype)
    down_q = quantize_weight(down, spec.num_bits, spec.group_for(two_i // 2), spec.scale_dtype)
    gate, up = split_rows(gate_up_q, two_i // 2)
    return QuantExpert(gate, up, down_q, fallback=fallback)


def quantize_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    method: str = "awq",
    group_size: int = 128,
    grid: int = 20,
    scale_dtype: torch.dtype | None = None,
) -> list[QuantExpert]:
    """Quantize the experts of one layer.

    Args:
        gate_up: fused ``(E, 2I, H)`` tensor, or one expert's ``(2I, H)``.
        down: fused ``(E, H, I)``, or one expert's ``(H, I)``.
        inputs: per expert ``(x, h)`` calibration inputs, or None where an expert has none.
        method: ``awq`` | ``rtn`` | ``int8``.
        group_size: requested int4 group size.
        grid: α grid points for AWQ.
        scale_dtype: dtype of the stored scales; default ``gate_up``'s dtype.
    """
    if gate_up.dim() == 2:
        gate_up, down = gate_up.unsqueeze(0), down.unsqueeze(0)
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not (E, 2I, H) / (E, H, I)"
        )
    spec = QuantSpec(method, group_size, grid, scale_dtype or gate_up.dtype)
    experts = gate_up.shape[0]
    if inputs is not None and len(inputs) != experts:
        raise ValueError(f"inputs has {len(inputs)} entries for {experts} experts")
    out = []
    for e in range(experts):
        x, h = inputs[e] if inputs is not None and inputs[e] is not None else (None, None)  # type: ignore[misc]
        out.append(quantize_expert(gate_up[e], down[e], x, h, spec))
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
