"""AWQ's searches for one weight: the loss they answer to, the scale, then the clipping on top.

For one expert, AWQ looks at the inputs that expert really receives (the tokens routed to it;
for ``down`` the intermediate ``act(gate(x)) * up(x)``) and the router weight each of those
tokens gives the expert's output. Two searches, as in the AWQ paper and AutoAWQ:

1. **Scale.** Input channels with large mean magnitude matter most to the output, so the
   weight's columns are multiplied by ``s`` before group-wise int4 rounding: those columns then
   get relatively finer steps. The runtime divides the activation by ``s``
   (``y = Q(W·s) (x / s)``). Candidates: ``s = mean(|x|)^α`` and the "duo" form
   ``s = mean(|x|)^α / mean(|Ŵ|)^(1-α)`` (``Ŵ``: each weight over its group's max magnitude),
   α on a grid in [0, 1]; no scale at all (RTN) is always a candidate.
2. **Clipping** (``specter.draft.quantize.clip``): per (output row, group), the quantization range is
   shrunk to ``r·[min, max]`` with ``r`` from 1.0 down to 0.5, whichever gives that row's
   output on the recorded inputs the lowest error.

The loss both searches answer to is the error of what the layer adds to the residual stream:
for gate and up (one shared ``s``, they see the same input) the **expert's output**
``down(act(gate x) · up x)`` with gate and up quantized; for ``down`` its own output. Each
token's squared error is weighted by the square of its router weight (the factor the expert's
output is multiplied by). Every candidate, and the clipped weight, is kept only if it lowers
that loss, so AWQ's calibration loss is never above RTN's.

``layer_scale`` is the folded layout's scale search: one gate/up scale for all of a layer's
experts. Putting the results together per expert and per layer is ``specter.draft.quantize.awq``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specter.draft.format.qweight import QuantWeight, quantize_weight
from specter.draft.quantize.clip import clip_ratios, search_clip

if TYPE_CHECKING:
    from specter.draft.quantize.awq import Activation, QuantSpec


@dataclass
class Searched:
    """The outcome of AWQ's searches for one weight.

    Attributes:
        quant: the quantized weight.
        error: its loss on the calibration inputs.
        alpha: the chosen α (0: no AWQ scale, plain RTN won).
        duo: the scale has the weight-magnitude term.
        clip: mean clipping ratio over (row, group) (1.0: no clipping).
        rtn_error: the loss of plain RTN on the same inputs.
    """

    quant: QuantWeight
    error: float
    alpha: float = 0.0
    duo: bool = False
    clip: float = 1.0
    rtn_error: float = 0.0


def output_error(
    weight: torch.Tensor, effective: torch.Tensor, x: torch.Tensor, token_weight: torch.Tensor | None = None
) -> float:
    """Mean squared error of ``x Wᵀ`` against ``x W_effᵀ`` over all outputs of all tokens; with
    ``token_weight`` (n,), each token's squared error is weighted (weights normalised to mean 1)."""
    diff = weight.double() - effective.double()
    x = x.double()
    if token_weight is not None:
        x = x * (token_weight.double() / token_weight.double().mean().clamp(min=1e-30)).sqrt().unsqueeze(-1)
    if x.shape[0] > x.shape[1]:
        # Fewer flops through the Gram matrix when there are more tokens than input channels.
        gram = x.T @ x
        total = ((diff @ gram) * diff).sum()
    else:
        total = (x @ diff.T).pow(2).sum()
    return float(total) / (x.shape[0] * weight.shape[0])


class ExpertLoss:
    """The router-weighted output error of one expert when gate and up are replaced.

    ``y = down(act(gate x) · up x)`` is computed once in full precision; ``__call__`` returns the
    weighted mean squared error of ``y`` when ``gate_up`` is replaced by a quantized one.
    """

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        x: torch.Tensor,
        token_weight: torch.Tensor | None,
        act: Activation,
    ):
        self.x, self.down, self.act = x.float(), down.float(), act
        n = x.shape[0]
        self.raw = torch.ones(n) if token_weight is None else token_weight.float()
        self.w = self.raw / self.raw.mean()
        self.y = self.output(gate_up.float())

    def output(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self.x, gate_up).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down)

    def __call__(self, quant: QuantWeight) -> float:
        diff = (self.output(quant.dequantize()) - self.y).double().pow(2).sum(-1)
        return float((diff * self.w.double()).sum()) / (self.x.shape[0] * self.y.shape[1])

    def total(self, quant: QuantWeight) -> float:
        """``Σ_t w_t ‖ŷ_t − y_t‖²`` with the raw token weights: sums across experts compare."""
        diff = (self.output(quant.dequantize()) - self.y).double().pow(2).sum(-1)
        return float((diff * self.raw.double()).sum())


def _weight_magnitude(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel: the mean over rows of ``|W|`` relative to its group's max magnitude."""
    out, inp = weight.shape
    groups = weight.float().abs().view(out, inp // group_size, group_size)
    return (groups / groups.amax(dim=-1, keepdim=True).clamp(min=1e-12)).view(out, inp).mean(dim=0)


def awq_scale(x: torch.Tensor, alpha: float, weight_mag: torch.Tensor | None = None) -> torch.Tensor:
    """``s = mean(|x|)^α`` (or ``/ weight_mag^(1-α)``, the duo form) per input channel,
    normalised so that max·min = 1 (numerics only: min-max group quantization is invariant to a
    global factor on ``s``)."""
    s = x.float().abs().mean(dim=0).pow(alpha)
    if weight_mag is not None:
        s = s / weight_mag.clamp(min=1e-4).pow(1.0 - alpha)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def scale_candidates(
    weight: torch.Tensor, x: torch.Tensor, spec: QuantSpec, group_size: int
) -> Iterator[tuple[float, bool, torch.Tensor | None]]:
    """``(α, duo, s)`` for every scale AWQ tries; the first is RTN (no scale)."""
    alphas = torch.linspace(0.0, 1.0, spec.grid).tolist()
    yield 0.0, False, None
    for alpha in alphas[1:]:
        yield alpha, False, awq_scale(x, alpha)
    if spec.duo:
        magnitude = _weight_magnitude(weight, group_size)
        for alpha in alphas[:-1]:  # α = 1 has no weight term: the plain scale, tried above
            yield alpha, True, awq_scale(x, alpha, magnitude)


def search_scale(
    weight: torch.Tensor,
    x: torch.Tensor,
    spec: QuantSpec,
    group_size: int,
    loss: Callable[[QuantWeight], float] | None = None,
    token_weight: torch.Tensor | None = None,
) -> Searched:
    """Try every scale candidate; keep the one with the lowest ``loss`` (default: the weighted
    output error of this weight on ``x``). RTN comes first and wins ties, so no scale is stored
    unless one lowers the loss."""
    if loss is None:
        loss = lambda q: output_error(weight, q.dequantize(), x, token_weight)  # noqa: E731
    best: Searched | None = None
    for alpha, duo, s in scale_candidates(weight, x, spec, group_size):
        quant = quantize_weight(weight, spec.num_bits, group_size, spec.scale_dtype, s)
        err = loss(quant)
        if best is None:
            best = Searched(quant, err, rtn_error=err)
        elif err < best.error:
            best = Searched(quant, err, alpha, duo, rtn_error=best.rtn_error)
    assert best is not None  # RTN is always a candidate
    return best


def apply_clip(
    weight: torch.Tensor,
    x: torch.Tensor,
    token_weight: torch.Tensor | None,
    chosen: Searched,
    spec: QuantSpec,
    loss: Callable[[QuantWeight], float],
) -> Searched:
    """AWQ's clipping search on top of the chosen scale; the clipped weight replaces ``chosen``
    only if it lowers ``loss`` (so clipping never raises the calibration loss)."""
    ratios = clip_ratios(spec.clip_grid, spec.clip_min)
    if len(ratios) < 2:
        return chosen
    quant = chosen.quant
    clip = search_clip(
        weight, x, token_weight, quant.num_bits, quant.group_size, spec.scale_dtype, quant.awq_scale, ratios
    )
    if bool((clip == 1.0).all()):
        return chosen
    clipped = quantize_weight(weight, quant.num_bits, quant.group_size, spec.scale_dtype, quant.awq_scale, clip)
    err = loss(clipped)
    if err >= chosen.error:
        return chosen
    return Searched(clipped, err, chosen.alpha, chosen.duo, float(clip.mean()), chosen.rtn_error)


def search_weight(
    weight: torch.Tensor,
    x: torch.Tensor,
    token_weight: torch.Tensor | None,
    spec: QuantSpec,
    group_size: int,
    loss: Callable[[QuantWeight], float] | None = None,
) -> Searched:
    """Scale search then clipping search for one (possibly fused) weight."""
    if loss is None:
        loss = lambda q: output_error(weight, q.dequantize(), x, token_weight)  # noqa: E731
    chosen = search_scale(weight, x, spec, group_size, loss, token_weight)
    return apply_clip(weight, x, token_weight, chosen, spec, loss)

def layer_scale(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
    calibrated: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    losses: dict[int, ExpertLoss],
    spec: QuantSpec,
    group_size: int,
) -> tuple[torch.Tensor | None, float, bool, dict[int, QuantWeight]]:
    """The one gate/up input scale of a layer: the candidate (RTN first, kept on ties) with the
    lowest sum over calibrated experts of their raw router-weighted output error. The statistics
    are the layer's: ``mean |x|`` over every recorded (token, expert) input, the weight magnitude
    over every expert's gate and up rows. Returns the scale, its α and form, and each calibrated
    expert's gate/up quantized with it."""
    every_input = torch.cat([rec[0].float() for rec in calibrated.values()])
    every_weight = torch.cat([gate_up.float() for gate_up, _ in weights])
    best: tuple[float, torch.Tensor | None, float, bool, dict[int, QuantWeight]] | None = None
    for alpha, duo, s in scale_candidates(every_weight, every_input, spec, group_size):
        if s is not None:
            # Powers of two: dividing the norm and multiplying the router (and the shared expert) by
            # them involves no rounding in any binary float, so the fold by itself changes no router
            # logit; arbitrary scales rounded to bf16 alone flipped ~1-2 % of the top-k sets.
            s = torch.exp2(torch.round(torch.log2(s)))
        quants = {e: quantize_weight(weights[e][0], spec.num_bits, group_size, spec.scale_dtype, s) for e in calibrated}
        total = sum(losses[e].total(q) for e, q in quants.items())
        if best is None or total < best[0]:
            best = (total, s, alpha, duo, quants)
    assert best is not None  # RTN is always a candidate
    return best[1:]
