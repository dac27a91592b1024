"""Published int4 checkpoints read as drafts, without re-quantizing.

A quantized checkpoint of the target — an AutoAWQ GEMM export (``quant_method: awq``), a GPTQ
export (``quant_method: gptq``, symmetric or not, with or without act-order) or a
compressed-tensors ``pack-quantized`` one (W4A16 / W8A16, symmetric or not; Specter's own drafts
are these) — is turned, module by module, into ``QuantWeight``: signed codes, one scale and zero
point per (output row, group), and for act-order an input-channel ``order``. The routed experts
stay quantized (``specter.draft.kernels``); any other quantized module (attention, a shared
expert) is dequantized once into the dense model.

Layouts, as each library writes them (``out`` × ``in`` weight, ``g`` groups, ``p = 32 / bits``):

* AutoAWQ GEMM: ``qweight`` int32 ``(in, out / p)``, ``qzeros`` int32 ``(g, out / p)``, ``scales``
  ``(g, out)``; a word holds ``p`` consecutive output columns in the order ``AWQ_ORDER``; codes and
  zeros unsigned; ``W = (q − z) · s``.
* GPTQ: ``qweight`` int32 ``(in / p, out)`` packed along the input dim, ``qzeros`` int32
  ``(g, out / p)``, ``scales`` ``(g, out)``, ``g_idx`` int32 ``(in,)`` (the group of each input
  channel; with act-order not ``i // group``); element ``j`` of a word in bits ``[b·j, b·(j+1))``;
  the ``gptq`` (v1) checkpoint format stores ``z − 1``, ``gptq_v2`` stores ``z``.
* compressed-tensors: ``specter.draft.format.pack`` (symmetric schemes have no zero point;
  act-order adds ``weight_g_idx``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from specter.draft.format.pack import FORMATS, PACKED_SUFFIXES, group_bits, group_for, read_weight
from specter.draft.format.qweight import QuantWeight

Read = Callable[[str], torch.Tensor]
Has = Callable[[str], bool]

# AutoAWQ GEMM: element i of a word holds output column p·w + AWQ_ORDER[i] of word w.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))


class UnsupportedDraftFormat(ValueError):
    """A quantized checkpoint in a method, layout or bit width no reader takes."""


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``(R, W)`` int32 words → ``(R, W · 32 / bits)`` unsigned codes (int64), element ``j`` of a
    word in bits ``[bits·j, bits·(j+1))``."""
    per = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


class CompressedTensorsScheme:
    """compressed-tensors ``pack-quantized`` (and Specter's ``specter-awq``) modules."""

    name = "compressed-tensors"
    main = "weight_packed"
    parts = (*PACKED_SUFFIXES, "weight_g_idx", "weight_awq_scale")

    def __init__(self, qconfig: dict[str, Any]):
        self.qconfig = qconfig

    def read(self, module: str, read: Read, has: Has) -> QuantWeight:
        name, group = group_for(module, self.qconfig)
        symmetric = bool((group.get("weights") or {}).get("symmetric")) and not has(f"{module}.weight_zero_point")
        quant = read_weight(module, read, has, group_bits(name, group), symmetric)
        if has(f"{module}.weight_g_idx"):
            return _with_act_order(quant, read(f"{module}.weight_g_idx"), f"{module}.weight_g_idx")
        return quant


class AwqGemmScheme:
    """AutoAWQ's GEMM layout (``quant_method: awq``, ``version: gemm``)."""

    name = "awq"
    main = "qweight"
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, qconfig: dict[str, Any]):
        self.bits = int(qconfig.get("bits", qconfig.get("w_bit", 4)))
        self.group = int(qconfig.get("group_size", qconfig.get("q_group_size", 128)))
        if self.bits != 4:
            raise UnsupportedDraftFormat(f"quantization_config.bits: AutoAWQ GEMM drafts are 4-bit, got {self.bits}")
        if not qconfig.get("zero_point", True):
            raise UnsupportedDraftFormat("quantization_config.zero_point: AutoAWQ drafts without zero points are not read")

    def read(self, module: str, read: Read, has: Has) -> QuantWeight:
        _require(module, self.parts, has)
        qweight, qzeros, scales = (read(f"{module}.{s}") for s in self.parts)
        codes = _awq_columns(unpack_words(_int32(qweight, f"{module}.qweight"), self.bits))  # (in, out)
        zeros = _awq_columns(unpack_words(_int32(qzeros, f"{module}.qzeros"), self.bits))  # (g, out)
        inp, out = codes.shape
        groups = inp // self.group if self.group > 0 else 1
        if (self.group > 0 and inp % self.group) or scales.shape != (groups, out) or zeros.shape != (groups, out):
            raise ValueError(
                f"{module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                f"{tuple(scales.shape)} do not fit one {out}×{inp} weight in groups of {self.group} "
                "(truncated, or another model's)"
            )
        return _signed(codes.T, zeros.T, scales.T, self.bits, inp // groups)


class GptqScheme:
    """GPTQ's layout (``quant_method: gptq``; AutoGPTQ / GPTQModel / optimum exports)."""

    name = "gptq"
    main = "qweight"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, qconfig: dict[str, Any]):
        self.bits = int(qconfig.get("bits", 4))
        self.group = int(qconfig.get("group_size", 128))
        if self.bits not in (4, 8):
            raise UnsupportedDraftFormat(f"quantization_config.bits: GPTQ drafts must be 4 or 8-bit, got {self.bits}")
        fmt = qconfig.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedDraftFormat(
                f"quantization_config.checkpoint_format {fmt!r}: GPTQ drafts are read in 'gptq' or 'gptq_v2'"
            )
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores z − 1

    def read(self, module: str, read: Read, has: Has) -> QuantWeight:
        _require(module, self.parts[:3], has)
        qweight, qzeros, scales = (read(f"{module}.{s}") for s in self.parts[:3])
        codes = unpack_words(_int32(qweight, f"{module}.qweight").T.contiguous(), self.bits)  # (out, in)
        zeros = unpack_words(_int32(qzeros, f"{module}.qzeros"), self.bits) + self.zero_offset  # (g, out)
        out, inp = codes.shape
        groups = scales.shape[0] if scales.dim() == 2 else 0
        if (groups < 1 or scales.shape[1] != out or zeros.shape != (groups, out) or inp % groups
                or (self.group > 0 and inp != groups * self.group)):
            raise ValueError(
                f"{module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                f"{tuple(scales.shape)} do not fit one {out}×{inp} weight (truncated, or another model's)"
            )
        quant = _signed(codes, zeros.T, scales.T, self.bits, inp // groups)
        if has(f"{module}.g_idx"):
            return _with_act_order(quant, read(f"{module}.g_idx"), f"{module}.g_idx")
        return quant


Scheme = CompressedTensorsScheme | AwqGemmScheme | GptqScheme


def scheme_for(qconfig: dict[str, Any]) -> Scheme:
    """The reader of a checkpoint's ``quantization_config``, or an error naming what is not read."""
    method = qconfig.get("quant_method")
    if method in (None, "compressed-tensors"):
        fmt = qconfig.get("format")
        if fmt not in FORMATS:
            raise UnsupportedDraftFormat(
                f"compressed-tensors format {fmt!r} is not read as a draft; drafts are {', '.join(FORMATS)}"
            )
        return CompressedTensorsScheme(qconfig)
    if method == "awq":
        version = str(qconfig.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedDraftFormat(
                f"AutoAWQ version {version!r} is not read as a draft; export the AutoAWQ checkpoint in 'gemm'"
            )
        return AwqGemmScheme(qconfig)
    if method == "gptq":
        return GptqScheme(qconfig)
    raise UnsupportedDraftFormat(
        f"quant_method {method!r} is not read as a draft; drafts are compressed-tensors ({', '.join(FORMATS)}), "
        "AutoAWQ GEMM ('awq') or GPTQ ('gptq')"
    )


def quantized_modules(scheme: Scheme, keys: Iterable[str]) -> list[str]:
    """Every module of a checkpoint that the scheme stores quantized."""
    suffix = f".{scheme.main}"
    return sorted(k.removesuffix(suffix) for k in keys if k.endswith(suffix))



def _require(module: str, suffixes: tuple[str, ...], has: Has) -> None:
    missing = [f"{module}.{s}" for s in suffixes if not has(f"{module}.{s}")]
    if missing:
        raise ValueError(f"quantized module {module!r} is incomplete: missing {missing}")


def _int32(t: torch.Tensor, key: str) -> torch.Tensor:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{key} must be a 2D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return t


def _awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's interleaved columns back in order."""
    rows, cols = codes.shape
    undo = torch.tensor(_AWQ_UNDO)
    index = (torch.arange(cols) // 8) * 8 + undo[torch.arange(cols) % 8]
    return codes[:, index]


def _signed(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> QuantWeight:
    """A ``QuantWeight`` from unsigned codes ``(out, in)``, zeros ``(out, g)`` and scales: ``(q − z)·s``
    with both shifted by ``2^(bits−1)`` to the signed range the draft format uses."""
    offset = 1 << (bits - 1)
    return QuantWeight(
        (codes - offset).to(torch.int8).contiguous(),
        scales.contiguous(),
        (zeros - offset).to(torch.int8).contiguous(),
        bits,
        group,
    )


def _with_act_order(quant: QuantWeight, g_idx: torch.Tensor, key: str) -> QuantWeight:
    """Codes regrouped for act-order: input channel ``i`` belongs to group ``g_idx[i]``. Channels
    are sorted by group (stable) so that groups are contiguous; ``order`` says where each came from."""
    out, inp = quant.shape
    groups = quant.scale.shape[1]
    g_idx = g_idx.to(torch.int64).flatten()
    if g_idx.numel() != inp or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{key}: expected {inp} group indices in [0, {groups}), got shape {tuple(g_idx.shape)}")
    if torch.equal(g_idx, torch.arange(inp) // quant.group_size):
        return quant
    if not bool((torch.bincount(g_idx, minlength=groups) == quant.group_size).all()):
        raise ValueError(f"{key}: every group must hold {quant.group_size} input channels")
    order = torch.argsort(g_idx, stable=True)
    return QuantWeight(
        quant.codes[:, order].contiguous(), quant.scale, quant.zero, quant.num_bits, quant.group_size,
        quant.awq_scale, order=order,
    )
