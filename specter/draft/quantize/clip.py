"""AWQ's second step: shrink each group's quantization range where that lowers the output error.

Min-max quantization spends its 16 levels on the whole ``[min, max]`` range of a group, so one
outlying weight coarsens the step of all the others. Clipping the range to ``[r·min, r·max]``
(``r < 1``) rounds the outlier to the range's end and gives every other weight a finer step.
Whether that pays is decided, per (output row, group), by the error it causes in that row's
output on the recorded calibration inputs:

    err(o, g, r) = Σ_t w_t · (x_t,g · (W_o,g − Ŵ_o,g(r)))²  =  d_o,gᵀ · G_g · d_o,g

with ``G_g = Σ_t w_t x_t,g x_t,gᵀ`` the (token-weighted) Gram matrix of the group's input
channels and ``d = W − Ŵ(r)`` in the original (unscaled) weight space, so the AWQ scale chosen
before is taken into account. Groups are scored independently (the cross-group terms of the row's
error are ignored, as AutoAWQ does); the caller keeps the clipped weight only if the full loss
did not grow.
"""

from __future__ import annotations

import torch

from specter.draft.format.qweight import quantize_weight


def clip_ratios(grid: int, lowest: float) -> list[float]:
    """The ratios tried, from 1.0 (no clipping) down to ``lowest``, ``grid`` of them."""
    return torch.linspace(1.0, lowest, grid).tolist() if grid > 1 else [1.0]


def group_gram(x: torch.Tensor, token_weight: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """``(groups, g, g)``: per input group, ``Σ_t w_t x_t,g x_t,gᵀ`` in float64."""
    x = x.double()
    if token_weight is not None:
        x = x * token_weight.double().sqrt().unsqueeze(-1)
    n, inp = x.shape
    xg = x.view(n, inp // group_size, group_size).transpose(0, 1)  # (groups, n, g)
    return xg.transpose(1, 2) @ xg


def group_errors(diff: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``(out, groups)``: ``d_o,gᵀ G_g d_o,g`` for a weight difference ``diff`` (out, in)."""
    groups, size = gram.shape[0], gram.shape[1]
    d = diff.double().view(diff.shape[0], groups, size).transpose(0, 1)  # (groups, out, g)
    return ((d @ gram) * d).sum(-1).T


def search_clip(
    weight: torch.Tensor,
    x: torch.Tensor,
    token_weight: torch.Tensor | None,
    num_bits: int,
    group_size: int,
    scale_dtype: torch.dtype,
    awq_scale: torch.Tensor | None,
    ratios: list[float],
) -> torch.Tensor:
    """Per (row, group), the ratio of ``ratios`` with the lowest output error: ``(out, groups)``.

    Args:
        weight: ``(out, in)`` full-precision weight.
        x: ``(n, in)`` calibration inputs of this weight.
        token_weight: ``(n,)`` non-negative weight of each token in the error, or None.
        num_bits, group_size, scale_dtype: the quantization (as ``quantize_weight``).
        awq_scale: the AWQ input scale already chosen (None: plain RTN scaling).
        ratios: the shrink ratios tried; 1.0 should be among them (it is min-max).
    """
    out, inp = weight.shape
    gram = group_gram(x, token_weight, group_size)
    reference = weight.double()
    best_err = torch.full((out, inp // group_size), float("inf"), dtype=torch.float64)
    best = torch.ones(out, inp // group_size)
    for ratio in ratios:
        clip = torch.full((out, inp // group_size), ratio)
        quant = quantize_weight(weight, num_bits, group_size, scale_dtype, awq_scale, clip)
        err = group_errors(reference - quant.dequantize().double(), gram)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, ratio), best)
    return best
