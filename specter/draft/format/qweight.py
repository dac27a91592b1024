"""One weight matrix quantized to signed integers, group-wise along its input dimension.

A ``QuantWeight`` holds exactly what the draft file stores for one projection, in the layout of
compressed-tensors' ``pack-quantized`` format before packing: signed integer codes (``[-8, 7]``
for 4 bits, ``[-128, 127]`` for 8 bits), one scale and one zero point per (output row, group),
and, for AWQ, the per-input-channel scale ``s`` that the weight was multiplied by before it was
quantized. The effective weight is

    W ≈ (codes - zero) * scale / s        (scale and zero broadcast over each group; s per column)

``dequantize`` is a pure function of the stored tensors, so a weight dequantized right after
quantization and one read back from disk are bit-identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Group sizes tried, in order, after the requested one: compressed-tensors and the CPU int4
# kernel both want the input dim split into whole groups.
_FALLBACK_GROUPS = (64, 32, 16, 8)


@dataclass
class QuantWeight:
    """A quantized ``(out, in)`` weight.

    Attributes:
        codes: int8 ``(out, in)`` signed codes.
        scale: ``(out, in // group_size)`` step sizes, in the storage dtype.
        zero: int8 ``(out, in // group_size)`` signed zero points (same range as the codes).
        num_bits: 4 or 8.
        group_size: input channels per group (``in`` for one group per row, i.e. per channel).
        awq_scale: fp32 ``(in,)`` AWQ input-channel scale ``s``, or None (plain round-to-nearest).
        order: int64 ``(in,)`` for act-order checkpoints (GPTQ's ``g_idx``): stored column ``j`` is
            the weight's input channel ``order[j]`` (groups are contiguous in stored order); None:
            stored order is the weight's.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    num_bits: int
    group_size: int
    awq_scale: torch.Tensor | None = None
    order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.order is not None and self.awq_scale is not None:
            raise ValueError("a weight has either an AWQ scale or an act-order, not both")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    @property
    def packed_nbytes(self) -> int:
        """Bytes this weight takes in the packed format (codes and zero points bit-packed)."""
        out, inp = self.shape
        per_word = 32 // self.num_bits
        groups = self.scale.shape[1]
        nbytes = out * -(-inp // per_word) * 4 + -(-out // per_word) * groups * 4
        nbytes += self.scale.numel() * self.scale.element_size()
        if self.awq_scale is not None:
            nbytes += self.awq_scale.numel() * self.awq_scale.element_size()
        return nbytes

    def dequantize_scaled(self) -> torch.Tensor:
        """``(codes - zero) * scale`` in fp32, in stored column order: the weight *before* dividing
        by the AWQ scale (and before undoing an act-order)."""
        out, inp = self.shape
        groups = self.scale.shape[1]
        codes = self.codes.view(out, groups, inp // groups).float()
        zero = self.zero.float().unsqueeze(-1)
        return ((codes - zero) * self.scale.float().unsqueeze(-1)).view(out, inp)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective weight ``W ≈ (codes - zero) * scale / s`` as a dense tensor."""
        weight = self.dequantize_scaled()
        if self.awq_scale is not None:
            weight = weight / self.awq_scale.float()
        if self.order is not None:
            weight = torch.empty_like(weight).index_copy_(1, self.order, weight)
        return weight.to(dtype)


def choose_group_size(in_dim: int, requested: int) -> int:
    """The group size used for an input dim: ``requested`` if it splits ``in_dim`` into whole
    groups, else the first of 64, 32, 16, 8 that does, else one group per row (``in_dim``)."""
    if requested < 1:
        raise ValueError(f"group_size must be a positive integer, got {requested}")
    for size in (requested, *(g for g in _FALLBACK_GROUPS if g < requested)):
        if size <= in_dim and in_dim % size == 0:
            return size
    return in_dim


def quantize_weight(
    weight: torch.Tensor,
    num_bits: int,
    group_size: int,
    scale_dtype: torch.dtype,
    awq_scale: torch.Tensor | None = None,
    clip: torch.Tensor | None = None,
) -> QuantWeight:
    """Asymmetric min-max round-to-nearest quantization of ``weight · diag(awq_scale)``.

    Args:
        weight: ``(out, in)`` full-precision weight.
        num_bits: 4 or 8.
        group_size: input channels per group; must divide ``in``.
        scale_dtype: dtype the scales are stored in (the model dtype); codes are computed
            against the *stored* (rounded) scales so that dequantization matches exactly.
        awq_scale: optional ``(in,)`` positive per-input-channel scale ``s``.
        clip: optional ``(out, in // group_size)`` ratios in (0, 1]: each group's range
            ``[min, max]`` shrinks to ``[r·min, r·max]`` (AWQ's clipping); values outside it
            round to the nearest end. Only the stored scale and zero point change.
    """
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    out, inp = weight.shape
    if group_size < 1 or inp % group_size:
        raise ValueError(f"group_size {group_size} does not split the input dim {inp} into whole groups")
    scaled = weight.float()
    if awq_scale is not None:
        awq_scale = awq_scale.float().contiguous()
        scaled = scaled * awq_scale
    qmin, qmax = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    groups = scaled.view(out, inp // group_size, group_size)
    # The range always contains 0 so that the zero point stays inside [qmin, qmax].
    low = groups.amin(dim=-1).clamp(max=0.0)
    high = groups.amax(dim=-1).clamp(min=0.0)
    if clip is not None:
        if clip.shape != low.shape:
            raise ValueError(f"clip has shape {tuple(clip.shape)}, expected {tuple(low.shape)} (out, groups)")
        low, high = low * clip.float(), high * clip.float()
    # Rounded to the storage dtype first: codes are computed against the scale that is stored.
    step = ((high - low) / (qmax - qmin)).to(scale_dtype).clamp(min=torch.finfo(scale_dtype).tiny)
    step_f = step.float()
    zero = (qmin - torch.round(low / step_f)).clamp(qmin, qmax)
    codes = (torch.round(groups / step_f.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(qmin, qmax)
    return QuantWeight(
        codes=codes.view(out, inp).to(torch.int8),
        scale=step,
        zero=zero.to(torch.int8),
        num_bits=num_bits,
        group_size=group_size,
        awq_scale=awq_scale,
    )
