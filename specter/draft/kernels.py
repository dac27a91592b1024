"""How the draft computes with its quantized experts: three interchangeable ways.

* ``int4-kernel`` — torch's int4 W4A16 matmul (``aten._weight_int4pack_mm_for_cpu`` on a CPU,
  ``aten._weight_int4pack_mm`` in bf16 on CUDA) on weights converted once to its tiled layout; the
  AWQ scale divides the input first. 4-bit, and only where the kernel accepts the shape (output dim
  a multiple of 16, input dim of 32, group 32–256); other projections use the dequantized cache.
  A layer whose experts all take the kernel is also stacked (``Int4Layer``): a step of a few tokens
  gathers its routed experts by their device-side ids and needs no read of the routing (a CUDA graph
  captures it); the device holds the experts in int4, a quarter of the dequantized cache's bytes.
* ``dequant-cache`` — every expert dequantized once at load into a dense compute cache
  (``W = (codes - zero) * scale / s``); plain ``F.linear`` per step.
* ``dequant-on-the-fly`` — only the packed words stay resident; each call unpacks and
  dequantizes the experts it needs (least memory, most work per step).

``auto`` times the first two on one expert and keeps the faster: on this project's CPUs the
int4 kernel measured several times slower than a dense fp32 matmul (see NOTES.md), on a GPU
int4 kernels pay.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specter.draft.format.pack import pack_int32, unpack_int32
from specter.draft.format.qweight import QuantWeight
from specter.experts.grouped import weighted_sum
from specter.experts.slots import Key

log = logging.getLogger(__name__)

MODES = ("auto", "int4-kernel", "dequant-cache", "dequant-on-the-fly")
_KERNEL_GROUPS = (32, 64, 128, 256)

# (gate, up, down) of one expert.
ExpertWeights = tuple[QuantWeight, QuantWeight, QuantWeight]


def can_fuse(top: QuantWeight, bottom: QuantWeight) -> bool:
    """Whether gate and up stack into one weight: same bits, groups, AWQ scale and act-order."""

    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

    return (top.group_size == bottom.group_size and top.num_bits == bottom.num_bits
            and same(top.awq_scale, bottom.awq_scale) and same(top.order, bottom.order))


def fuse_rows(top: QuantWeight, bottom: QuantWeight) -> QuantWeight:
    """Stack gate and up into one ``(2I, H)`` quantized weight (they share group size and AWQ scale)."""
    if not can_fuse(top, bottom):
        raise ValueError("gate and up must share num_bits, group_size, AWQ input scale and act-order to be stacked")
    return QuantWeight(
        torch.cat([top.codes, bottom.codes]),
        torch.cat([top.scale, bottom.scale]),
        torch.cat([top.zero, bottom.zero]),
        top.num_bits,
        top.group_size,
        top.awq_scale,
        top.order,
    )


def kernel_accepts(quant: QuantWeight) -> bool:
    """Whether the int4 kernel takes this weight's shape and grouping (the CPU's and CUDA's both)."""
    out, inp = quant.shape
    return (
        quant.num_bits == 4
        and out % 16 == 0
        and inp % 32 == 0
        and quant.group_size in _KERNEL_GROUPS
        and inp % quant.group_size == 0
    )


def _inner_k_tiles(inp: int) -> int:
    """CUDA's int4 layout tiles the input dim by ``16 * inner_k_tiles`` (8, 4 or 2)."""
    return next(tiles for tiles in (8, 4, 2) if inp % (16 * tiles) == 0)


class Int4Layer:
    """One MoE layer's experts in the int4 kernel's layout, stacked (each expert's weights are views of
    the stacks): a step's ``T * k`` routed pairs (at most ``max_pairs``) gather their experts by the
    device-side ids (``index_select``) and run one pair per kernel call, the activation once over all
    pairs: a fixed number of ops, no read of the routing, static shapes (a CUDA graph captures it).
    An expert's gate_up and down sit side by side in one row of each stack (codes, scales, inverse AWQ
    scales), so one gather per stack fetches both: two gathers a step (three with AWQ scales), not four.

    Args:
        gate_ups, downs: the layer's experts' projections, in expert order (all ``_Int4``, no act-order).
    """

    max_pairs = 16  # a draft step's tokens x top-k: one token, or a round's catch-up of two

    def __init__(self, gate_ups: list[_Int4], downs: list[_Int4]):
        self.packed = _Rows(gate_ups, downs, "packed")
        self.scales = _Rows(gate_ups, downs, "scale_zero")
        self.inv = _Rows(gate_ups, downs, "inv_awq") if any(p.inv_awq is not None for p in (*gate_ups, *downs)) else None
        self.up_group, self.down_group = gate_ups[0].group, downs[0].group
        self.matmul = gate_ups[0].matmul

    def __call__(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor], residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden (T, H)``'s routed experts weighted and summed (plus ``residual``), ``T * k <= max_pairs``."""
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)  # pair p = token p // k, its (p % k)-th expert
        up_w, down_w = self.packed.gather(ids)
        up_s, down_s = self.scales.gather(ids)
        assert up_w is not None and down_w is not None and up_s is not None and down_s is not None  # every expert has both
        up_inv, down_inv = self.inv.gather(ids) if self.inv is not None else (None, None)
        x = hidden.repeat_interleave(k, dim=0) if tokens > 1 else hidden.expand(k, -1)
        if up_inv is not None:
            x = x * up_inv
        pairs = range(tokens * k)  # a fixed count of pairs, each its gathered expert: one kernel call each
        gate_up = torch.cat([self.matmul(x[p : p + 1].contiguous(), up_w[p], self.up_group, up_s[p]) for p in pairs])
        gate, up = gate_up.chunk(2, dim=-1)
        h = act_fn(gate) * up  # every pair's activation at once
        if down_inv is not None:
            h = h * down_inv
        outs = torch.cat([self.matmul(h[p : p + 1], down_w[p], self.down_group, down_s[p]) for p in pairs])
        return weighted_sum(outs.view(tokens, k, -1), top_k_weights, residual)


class _Rows:
    """One tensor of every expert's gate_up and down, ``(E, up numel + down numel)``: an expert's row
    holds its gate_up's ``attr`` then its down's, flattened, and each projection's own tensor becomes a
    view of its part (no second copy). A part no expert has (an inverse AWQ scale) is left out of the
    rows, and ``gather`` gives None for it; an expert lacking a part the others have gets ones there."""

    def __init__(self, gate_ups: list[_Int4], downs: list[_Int4], attr: str):
        self.up_shape, self.down_shape = _shape_of(gate_ups, attr), _shape_of(downs, attr)
        self.split = 0 if self.up_shape is None else math.prod(self.up_shape)
        like = next(getattr(p, attr) for p in (*gate_ups, *downs) if getattr(p, attr) is not None)
        rows = []
        for pair in zip(gate_ups, downs, strict=True):
            parts = []
            for p, shape in zip(pair, (self.up_shape, self.down_shape), strict=True):
                if shape is not None:
                    t = getattr(p, attr)
                    parts.append(t.reshape(-1) if t is not None else like.new_ones(math.prod(shape)))
            rows.append(torch.cat(parts))
        self.stack = torch.stack(rows)
        for i, pair in enumerate(zip(gate_ups, downs, strict=True)):
            for p, view in zip(pair, self._views(self.stack[i]), strict=True):
                if getattr(p, attr) is not None:
                    setattr(p, attr, view)

    def _views(self, row: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``row (..., n)``'s gate_up part and down part, shaped as the projections' (views)."""
        lead = row.shape[:-1]
        up = None if self.up_shape is None else row[..., : self.split].view(*lead, *self.up_shape)
        down = None if self.down_shape is None else row[..., self.split :].view(*lead, *self.down_shape)
        return up, down

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The ``ids`` experts' gate_up and down parts, ``(len(ids), *shape)`` each: one gather."""
        return self._views(self.stack.index_select(0, ids))


def _shape_of(projections: list[_Int4], attr: str) -> tuple[int, ...] | None:
    """The shape of the projections' ``attr`` (the first that has one); None if none has it."""
    return next((tuple(getattr(p, attr).shape) for p in projections if getattr(p, attr) is not None), None)


class _Dense:
    """A dequantized projection: ``F.linear(x, W)``."""

    def __init__(self, quant: QuantWeight, dtype: torch.dtype, device: torch.device):
        self.weight = quant.dequantize(dtype).to(device)
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Int4:
    """A projection through torch's int4 kernel (tinygemm layout: ``_for_cpu`` on a CPU; on CUDA the
    kernel takes bf16 and the codes packed two to a byte, the even column in the high nibble)."""

    def __init__(self, quant: QuantWeight, dtype: torch.dtype, device: torch.device):
        unsigned = quant.codes.to(torch.int32) + 8
        if device.type == "cuda":
            pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8).to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(quant.shape[1]))
            self.matmul = torch.ops.aten._weight_int4pack_mm
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned.to(device), 2)
            self.matmul = torch.ops.aten._weight_int4pack_mm_for_cpu
        # The kernel computes (q_unsigned - 8) * scale + zero; ours is (code - zp) * scale,
        # with code = q_unsigned - 8, so its "zero" is -zp * scale.
        scale = quant.scale.float()
        shift = -quant.zero.float() * scale
        self.scale_zero = torch.stack([scale.T, shift.T], dim=-1).contiguous().to(device, dtype)
        self.group = quant.group_size
        self.inv_awq = None if quant.awq_scale is None else (1.0 / quant.awq_scale).to(device, dtype)
        self.order = None if quant.order is None else quant.order.to(device)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_awq is not None:
            x = x * self.inv_awq
        if self.order is not None:  # act-order: the codes' columns are the input's in this order
            x = x[:, self.order]
        return self.matmul(x.contiguous(), self.packed, self.group, self.scale_zero)


class _OnTheFly:
    """A projection kept packed; unpacked and dequantized at each call."""

    def __init__(self, quant: QuantWeight, dtype: torch.dtype, device: torch.device):
        self.words = pack_int32(quant.codes, quant.num_bits, dim=1).to(device)
        self.shape = quant.shape
        self.bits, self.group = quant.num_bits, quant.group_size
        self.scale, self.zero = quant.scale.to(device), quant.zero.to(device)
        self.awq = None if quant.awq_scale is None else quant.awq_scale.to(device)
        self.order = None if quant.order is None else quant.order.to(device)
        self.dtype = dtype
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.words, self.scale, self.zero))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes = unpack_int32(self.words, self.bits, self.shape[1], dim=1)
        quant = QuantWeight(codes, self.scale, self.zero, self.bits, self.group, self.awq, self.order)
        return F.linear(x, quant.dequantize(self.dtype))


Projection = Callable[[torch.Tensor], torch.Tensor]


class _Pair:
    """Gate and up as two projections (they could not be stacked into one weight)."""

    def __init__(self, gate: Projection, up: Projection):
        self.gate, self.up = gate, up
        self.nbytes = gate.nbytes + up.nbytes  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.gate(x), self.up(x)], dim=-1)


class ExpertKernels:
    """Every draft expert, resident, behind one compute mode.

    Args:
        experts: (layer, expert) → (gate, up, down) quantized weights.
        mode: ``int4-kernel`` | ``dequant-cache`` | ``dequant-on-the-fly`` (not ``auto``).
        dtype: compute dtype (the model's).
        device: where the weights live.
    """

    def __init__(
        self, experts: dict[Key, ExpertWeights], mode: str, dtype: torch.dtype, device: torch.device
    ):
        if mode not in MODES or mode == "auto":
            raise ValueError(f"mode must be one of {', '.join(MODES[1:])}; got {mode!r}")
        if mode == "int4-kernel" and device.type not in ("cpu", "cuda"):
            raise ValueError(f"mode 'int4-kernel' runs on cpu or cuda, not {device.type}")
        if mode == "int4-kernel" and device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError(f"mode 'int4-kernel' on cuda computes in bfloat16, not {dtype}")
        self.mode = mode
        self.kernel_fallbacks = 0
        self._gate_up: dict[Key, Projection] = {}
        self._down: dict[Key, Projection] = {}
        for key, (gate, up, down) in experts.items():
            if can_fuse(gate, up):
                self._gate_up[key] = self._make(fuse_rows(gate, up), dtype, device)
            else:  # act-order checkpoints order gate's and up's inputs differently
                self._gate_up[key] = _Pair(self._make(gate, dtype, device), self._make(up, dtype, device))
            self._down[key] = self._make(down, dtype, device)
        self.stacked = self._stack(experts, dtype, device) if mode == "dequant-cache" else {}
        self.gathered = self._stack_int4_layers(experts) if mode == "int4-kernel" else {}
        if self.kernel_fallbacks:
            log.info(
                "int4-kernel: %d projections outside the kernel's shapes use the dequantized cache",
                self.kernel_fallbacks,
            )

    def _stack(
        self, experts: dict[Key, ExpertWeights], dtype: torch.dtype, device: torch.device,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer → ``(gate_up (E, 2I, H), down (E, H, I))`` of its dequantized experts, for grouped calls;
        each expert's weights become views of them (no second copy). Layers whose gate and up could
        not be fused (act-order) are left out."""
        stacked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in sorted({key[0] for key in experts}):
            keys = sorted(key for key in experts if key[0] == layer)
            gate_ups = [self._gate_up[key] for key in keys]
            downs = [self._down[key] for key in keys]
            if not all(isinstance(p, _Dense) for p in (*gate_ups, *downs)):
                continue
            if keys != [(layer, e) for e in range(len(keys))]:
                continue
            gate_up = torch.stack([p.weight for p in gate_ups])  # type: ignore[attr-defined]
            down = torch.stack([p.weight for p in downs])  # type: ignore[attr-defined]
            for i, (a, b) in enumerate(zip(gate_ups, downs, strict=True)):
                a.weight, b.weight = gate_up[i], down[i]  # type: ignore[attr-defined]
            stacked[layer] = (gate_up, down)
        return stacked

    def _stack_int4_layers(self, experts: dict[Key, ExpertWeights]) -> dict[int, Int4Layer]:
        """layer → its ``Int4Layer``, for the layers whose every expert runs gate and up stacked and
        down through the int4 kernel without act-order."""
        layers: dict[int, Int4Layer] = {}
        for layer in sorted({key[0] for key in experts}):
            keys = sorted(key for key in experts if key[0] == layer)
            gate_ups, downs = [self._gate_up[key] for key in keys], [self._down[key] for key in keys]
            if keys != [(layer, e) for e in range(len(keys))]:
                continue
            if all(isinstance(p, _Int4) and p.order is None for p in (*gate_ups, *downs)):
                layers[layer] = Int4Layer(gate_ups, downs)  # type: ignore[arg-type]
        return layers

    def _make(self, quant: QuantWeight, dtype: torch.dtype, device: torch.device) -> Projection:
        if self.mode == "dequant-on-the-fly":
            return _OnTheFly(quant, dtype, device)
        if self.mode == "int4-kernel" and kernel_accepts(quant):
            return _Int4(quant, dtype, device)
        self.kernel_fallbacks += self.mode == "int4-kernel"
        return _Dense(quant, dtype, device)

    @property
    def nbytes(self) -> int:
        """Bytes the compute representation holds (the cache, the kernel layout, or packed words)."""
        return sum(p.nbytes for p in (*self._gate_up.values(), *self._down.values()))  # type: ignore[attr-defined]

    def gate_up(self, key: Key, x: torch.Tensor) -> torch.Tensor:
        """``x (n, H) → (n, 2I)`` gate outputs then up outputs."""
        return self._gate_up[key](x)

    def down(self, key: Key, h: torch.Tensor) -> torch.Tensor:
        """``h (n, I) → (n, H)``."""
        return self._down[key](h)


def time_modes(
    expert: ExpertWeights, dtype: torch.dtype, device: torch.device, tokens: int = 1, repeat: int = 50
) -> dict[str, float]:
    """Median seconds of one expert's gate_up + down on ``tokens`` tokens, per usable mode."""
    modes = ["dequant-cache", "dequant-on-the-fly"]
    gate_up = [fuse_rows(expert[0], expert[1])] if can_fuse(expert[0], expert[1]) else list(expert[:2])
    if device.type == "cpu" and all(kernel_accepts(q) for q in (*gate_up, expert[2])):
        modes.insert(0, "int4-kernel")
    x = torch.randn(tokens, expert[0].shape[1], dtype=dtype, device=device)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for mode in modes:
            out[mode] = _median_time(
                _one_expert(ExpertKernels({(0, 0): expert}, mode, dtype, device), x), repeat, device
            )
    return out


def _one_expert(kernels: ExpertKernels, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        gate, up = kernels.gate_up((0, 0), x).chunk(2, dim=-1)
        return kernels.down((0, 0), gate * up)

    return run


CACHE_SHARE = 0.1  # ``auto`` on a GPU: the dequantized cache only where it takes at most this share of the free memory


def choose_mode(
    expert: ExpertWeights, dtype: torch.dtype, device: torch.device, count: int = 1,
) -> tuple[str, dict[str, float]]:
    """``auto``'s mode for ``count`` experts shaped as ``expert``, with the timings behind it: on a CPU the
    faster of ``int4-kernel`` and ``dequant-cache`` for one decode token; on a GPU ``device_mode``'s."""
    if device.type != "cpu":
        return device_mode(expert, dtype, count, torch.cuda.mem_get_info(device)[0]), {}
    timings = time_modes(expert, dtype, device, tokens=1, repeat=30)
    candidates = {m: t for m, t in timings.items() if m in ("int4-kernel", "dequant-cache")}
    return min(candidates, key=lambda m: candidates[m]), timings


def device_mode(expert: ExpertWeights, dtype: torch.dtype, count: int, free_bytes: int) -> str:
    """``auto`` on a GPU: ``dequant-cache`` (bf16 copies: the fewer kernels a step) where the ``count``
    experts' copies take at most ``CACHE_SHARE`` of the device's ``free_bytes``; else ``int4-kernel``
    where the kernel takes them (4-bit, its shapes, bf16 compute). The copies hold as many bytes as
    the target's routed experts: memory that, given to the target's slots, would hold every expert,
    so a model that offloads at all wants its draft in int4 (a quarter of them)."""
    gate_up = [fuse_rows(expert[0], expert[1])] if can_fuse(expert[0], expert[1]) else list(expert[:2])
    cache = count * sum(q.shape[0] * q.shape[1] for q in (*gate_up, expert[2])) * dtype.itemsize
    takes = dtype == torch.bfloat16 and all(kernel_accepts(q) for q in (*gate_up, expert[2]))
    return "int4-kernel" if takes and cache > CACHE_SHARE * free_bytes else "dequant-cache"


def _median_time(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
