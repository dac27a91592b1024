"""The draft's on-disk format: compressed-tensors ``pack-quantized`` (W4A16 / W8A16).

Per quantized projection ``P`` (a per-expert module name such as
``model.layers.0.mlp.experts.3.gate_proj``), the file holds

* ``P.weight_packed``  int32 ``(out, ceil(in / (32 / bits)))``: codes shifted to unsigned
  (``code + 2^(bits-1)``) and packed along the input dim, element ``j`` of a word in bits
  ``[bits·j, bits·(j+1))``;
* ``P.weight_scale``   ``(out, in / group)`` in the model dtype;
* ``P.weight_zero_point`` int32 ``(ceil(out / (32 / bits)), in / group)``: signed zero points
  shifted and packed the same way, along the *output* dim;
* ``P.weight_shape``   int64 ``[out, in]``;
* ``P.weight_awq_scale`` fp32 ``(in,)`` — only in AWQ's ``per-expert`` layout, where AWQ chose
  α > 0: the runtime divides the projection's input by it (see docs/draft.md). Such a file is
  marked with the format ``specter-awq``, which stock readers refuse; the default ``folded``
  layout has no such tensor and is plain ``pack-quantized``.

``config.json`` carries the matching ``quantization_config`` block.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from specter.draft.format.qweight import QuantWeight

AWQ_SCALE = "weight_awq_scale"
PACK_QUANTIZED = "pack-quantized"
# The format of a draft whose projections carry ``weight_awq_scale`` (AWQ's per-expert layout): a
# name compressed-tensors does not know, so stock readers refuse the file rather than compute
# ``Q(W s)`` as if it were ``W``.
SPECTER_AWQ = "specter-awq"
FORMATS = (PACK_QUANTIZED, SPECTER_AWQ)
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def pack_int32(values: torch.Tensor, num_bits: int, dim: int) -> torch.Tensor:
    """Pack signed ``num_bits`` codes (int8, 2D) into int32 words along ``dim`` (0 or 1)."""
    _check_bits(num_bits)
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(
            f"values must be a 2D int8 tensor, got {values.dtype} of shape {tuple(values.shape)}"
        )
    per_word = 32 // num_bits
    unsigned = values.to(torch.int64) + (1 << (num_bits - 1))
    if unsigned.numel() and (int(unsigned.min()) < 0 or int(unsigned.max()) >= 1 << num_bits):
        raise ValueError(f"values do not fit in {num_bits} bits")
    rows = unsigned if dim == 1 else unsigned.T
    pad = -rows.shape[1] % per_word
    rows = torch.nn.functional.pad(rows, (0, pad)).view(rows.shape[0], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=rows.device) * num_bits
    words = (rows << shifts).sum(dim=-1)
    # Reinterpret the unsigned 32-bit word as int32 (two's complement), as the format stores it.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words if dim == 1 else words.T.contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack_int32``: ``size`` signed int8 codes per row (``dim`` = 1) or column."""
    _check_bits(num_bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(
            f"packed must be a 2D int32 tensor, got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    per_word = 32 // num_bits
    words = (packed if dim == 1 else packed.T).to(torch.int64) & 0xFFFFFFFF
    if words.shape[1] * per_word < size:
        raise ValueError(f"packed tensor holds {words.shape[1] * per_word} codes per row, {size} requested")
    shifts = torch.arange(per_word, dtype=torch.int64, device=packed.device) * num_bits  # on the words' device
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    codes = codes.reshape(words.shape[0], -1)[:, :size] - (1 << (num_bits - 1))
    codes = codes.to(torch.int8)
    return codes if dim == 1 else codes.T.contiguous()


def weight_tensors(module: str, quant: QuantWeight) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one quantized projection ``module``."""
    out, inp = quant.shape
    tensors = {
        f"{module}.weight_packed": pack_int32(quant.codes, quant.num_bits, dim=1),
        f"{module}.weight_scale": quant.scale.clone(),
        f"{module}.weight_zero_point": pack_int32(quant.zero, quant.num_bits, dim=0),
        f"{module}.weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }
    if quant.awq_scale is not None:
        tensors[f"{module}.{AWQ_SCALE}"] = quant.awq_scale.float().clone()
    return tensors


def read_weight(
    module: str,
    read: Callable[[str], torch.Tensor],
    has: Callable[[str], bool],
    num_bits: int,
    symmetric: bool = False,
) -> QuantWeight:
    """Rebuild a ``QuantWeight`` from its on-disk tensors (``read(key)`` returns one tensor);
    ``symmetric``: the scheme stores no zero point (all zero)."""
    needed = [s for s in PACKED_SUFFIXES if not (symmetric and s == "weight_zero_point")]
    missing = [f"{module}.{s}" for s in needed if not has(f"{module}.{s}")]
    if missing:
        raise ValueError(f"packed weight {module!r} is incomplete: missing {missing}")
    out, inp = (int(v) for v in read(f"{module}.weight_shape").tolist())
    scale = read(f"{module}.weight_scale")
    groups = scale.shape[1] if scale.dim() == 2 else 0
    if scale.shape[0] != out or groups < 1 or inp % groups:
        raise ValueError(
            f"{module}.weight_scale has shape {tuple(scale.shape)}, which does not fit weight_shape {[out, inp]}"
        )
    codes = _unpack(read, f"{module}.weight_packed", num_bits, inp, dim=1)
    zero = (
        torch.zeros(out, groups, dtype=torch.int8)
        if symmetric
        else _unpack(read, f"{module}.weight_zero_point", num_bits, out, dim=0)
    )
    if codes.shape != (out, inp) or zero.shape != (out, groups):
        raise ValueError(f"{module}: packed codes or zero points do not match weight_shape {[out, inp]}")
    awq = read(f"{module}.{AWQ_SCALE}").float() if has(f"{module}.{AWQ_SCALE}") else None
    if awq is not None and awq.shape != (inp,):
        raise ValueError(f"{module}.{AWQ_SCALE} has shape {tuple(awq.shape)}, expected ({inp},)")
    return QuantWeight(codes, scale, zero, num_bits, inp // groups, awq)


def _unpack(read: Callable[[str], torch.Tensor], key: str, num_bits: int, size: int, dim: int) -> torch.Tensor:
    """``unpack_int32`` of one stored tensor; a short (truncated) or misshapen one is named."""
    try:
        return unpack_int32(read(key), num_bits, size, dim=dim)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc} (truncated, or packed for other shapes or bits)") from None


def quantization_config(
    schemes: dict[str, tuple[int, int, int]], ignore: Iterable[str], fmt: str = PACK_QUANTIZED
) -> dict[str, Any]:
    """The ``quantization_config`` block of config.json.

    Args:
        schemes: target regex (matched against module names) → (num_bits, group_size, in_dim);
            a group size equal to the input dim is written as the ``channel`` strategy.
        ignore: module names left in full precision.
        fmt: ``pack-quantized``, or ``specter-awq`` where projections carry ``weight_awq_scale``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    grouped: dict[tuple[int, int | None, str], list[str]] = {}
    for target, (bits, group, in_dim) in schemes.items():
        strategy = "channel" if group == in_dim else "group"
        grouped.setdefault((bits, group if strategy == "group" else None, strategy), []).append(
            f"re:{target}"
        )
    groups: dict[str, Any] = {
        f"group_{n}": {
            "targets": sorted(targets),
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": False,
                "strategy": strategy,
                "group_size": group,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
                "observer_kwargs": {},
                "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": fmt,
        }
        for n, ((bits, group, strategy), targets) in enumerate(sorted(grouped.items(), key=str))
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def group_for(module: str, qconfig: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The config group whose target names ``module`` (a regex or its name); else the group that
    targets the class ``Linear`` (llm-compressor's presets), every packed module being one."""
    groups = qconfig.get("config_groups", {})
    for name, group in groups.items():
        for target in group.get("targets", []):
            pattern = target[3:] if target.startswith("re:") else re.escape(target)
            if re.fullmatch(pattern, module):
                return name, group
    for name, group in groups.items():
        if "Linear" in group.get("targets", []):
            return name, group
    raise ValueError(f"no quantization_config group targets module {module!r}")


def bits_for(module: str, qconfig: dict[str, Any]) -> int:
    """``num_bits`` of the config group that holds ``module``."""
    return group_bits(*group_for(module, qconfig))


def group_bits(name: str, group: dict[str, Any]) -> int:
    """``num_bits`` of config group ``name`` (4 or 8, else an error naming the field)."""
    bits = int(group["weights"]["num_bits"])
    _check_bits(bits, f"quantization_config.config_groups.{name}.weights.num_bits")
    return bits


def _check_bits(num_bits: int, field: str = "num_bits") -> None:
    if num_bits not in (4, 8):
        raise ValueError(f"{field} must be 4 or 8, got {num_bits}")
