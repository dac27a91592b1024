"""A MoE layer's routed experts computed in grouped calls over the device slot pool.

The routing of one MoE layer is read to the host once (``LayerRoutes``: the layer's only read of
device data; the schedule needs to know which experts to fetch). Every (token, top-k position)
pair of the layer gets its expert's output in ``PairOutputs``: the pairs whose experts sit in
slots are computed together — rows gathered once, sorted by slot, one grouped matmul for
``gate_up`` and one for ``down`` over the whole slot pool (``torch.nn.functional.grouped_mm``;
slots no pair uses are empty groups), the rows put back in pair order — so a layer whose experts
are all resident is a fixed handful of ops, whatever its top-k. Experts still in flight join with
a call of their own when they land; an expert the host computes fills its rows from its blob.
The layer's output is each token's pair outputs weighted by the router and summed over top-k, in
one batched matmul.

Per pair, the arithmetic is transformers' eager loop's (``F.linear`` on the expert's rows,
``act(gate) * up``, ``F.linear``); the weighted sum over a token's k experts is one batched matmul
here and k rounded adds in ascending expert id there, which moves results by rounding alone. As in
the eager loop, a pair's bits may depend on how many rows share its expert's matmul (the BLAS picks
its kernel by shape), so a verify pass and a plain step agree to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from specter.experts.store import ExpertShape
from specter.timing.dispatch import host_read

FromSlots = Callable[[np.ndarray], None]  # computes the pairs a padded ``PairOutputs.plan`` names, from slots
_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}
_EXPERT_IDS: dict[tuple[int, torch.device], torch.Tensor] = {}


class LayerRoutes:
    """One MoE layer's routing ``(T, k)`` on the host, read once (or given, already read).

    Attributes:
        ids: ``(T, k)`` expert ids (numpy).
        needed: the experts routed to, ascending.
    """

    def __init__(self, top_k_index: torch.Tensor | np.ndarray):
        if isinstance(top_k_index, torch.Tensor):  # the one read
            top_k_index = np.asarray(host_read(top_k_index), dtype=np.int64).reshape(top_k_index.shape)
        self.ids = top_k_index
        self.tokens, self.k = self.ids.shape
        experts, counts = np.unique(self.ids, return_counts=True)
        self._count = dict(zip(experts.tolist(), counts.tolist(), strict=True))
        self.needed: list[int] = list(self._count)

    def count(self, expert: int) -> int:
        """Pairs (token rows) routed to ``expert`` (0 if none)."""
        return self._count.get(expert, 0)

    def pairs_by_slot(self, slot_of: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The pairs (``t * k + j``) of the experts in ``slot_of``, sorted by their slot (stable), and
        each pair's slot."""
        flat = self.ids.reshape(-1)
        lookup = np.full(int(flat.max()) + 1, -1, dtype=np.int64)  # expert → slot, -1: not in this call
        lookup[list(slot_of)] = list(slot_of.values())
        slots = lookup[flat]
        chosen = np.flatnonzero(slots >= 0)
        order = chosen[np.argsort(slots[chosen], kind="stable")]
        return order, slots[order]


class PairOutputs:
    """Each (token, top-k position) pair's expert output of one MoE layer, filled in grouped calls.

    Args:
        hidden: the layer's input rows ``(T, H)``.
        routes: the layer's routing on the host.
        weights: the routing weights ``(T, k)``.
        act_fn: the experts' activation (``module.act_fn``).
        out: ``(T·k, H)`` where the pair outputs go (default a new tensor): a graphed step's buffer.
    """

    def __init__(self, hidden: torch.Tensor, routes: LayerRoutes, weights: torch.Tensor,
                 act_fn: Callable[[torch.Tensor], torch.Tensor], out: torch.Tensor | None = None):
        self.hidden = hidden
        self.routes = routes
        self.weights = weights
        self.act_fn = act_fn
        shape = (routes.tokens * routes.k, hidden.shape[-1])
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"out: expected the layer's {shape} pair outputs, got {tuple(out.shape)}")
        self.out = hidden.new_empty(shape) if out is None else out

    def plan(self, slot_of: dict[int, int], groups: int, padded: bool = False) -> np.ndarray:
        """What one grouped call over ``groups`` slots computes for the experts in ``slot_of`` (expert →
        slot), as int32: each pair's token row, then its pair row (sorted by slot), then each slot's
        cumulative row count. ``padded``: the same length for any ``slot_of`` (``2·T·k + groups``: a
        captured graph's input, ``planned_pairs``), the rows past the pairs being token 0's, computed
        in the last slot's group (every row in a group, as the grouped kernels are used everywhere
        else) and written to the scratch row ``T·k``."""
        pairs, slots = self.routes.pairs_by_slot(slot_of)
        ends = np.cumsum(np.bincount(slots, minlength=groups))
        return plan_of(pairs // self.routes.k, pairs, ends, self.routes.tokens * self.routes.k if padded else None)

    def from_slots(self, storage: torch.Tensor, shape: ExpertShape, slot_of: dict[int, int],
                   graph: FromSlots | None = None) -> None:
        """Compute the pairs of the experts in ``slot_of`` (expert → slot of ``storage``), in one call: the
        ops issued here, or ``graph`` given the padded plan (a graphed step's slot graph replayed)."""
        if not slot_of:
            return
        if graph is not None:
            graph(self.plan(slot_of, storage.shape[0], padded=True))
            return
        plan = torch.from_numpy(self.plan(slot_of, storage.shape[0])).to(self.hidden.device, non_blocking=True)
        gate_up, down = shape.split_rows(storage)
        planned_pairs(self.hidden, plan, gate_up, down, self.act_fn, self.out)

    def from_blob(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Compute ``expert``'s pairs from its own weights (a host-computed expert's blob)."""
        pairs = np.flatnonzero(self.routes.ids.reshape(-1) == expert)
        rows = torch.from_numpy(pairs).to(self.hidden.device)
        x = self.hidden.index_select(0, rows // self.routes.k)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        self.out.index_copy_(0, rows, F.linear(self.act_fn(gate) * up, down))

    def total(self, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output: every token's pair outputs times their weights, summed over top-k (plus
        ``residual``, in the same batched matmul, when given)."""
        routes = self.routes
        return weighted_sum(self.out.view(routes.tokens, routes.k, -1), self.weights, residual)


def resident_experts(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor], residual: torch.Tensor | None = None,
    slot_map: torch.Tensor | None = None, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """A MoE layer whose experts are all resident (the draft's stacked experts, or a target layer
    whose every expert sits ready in a slot): no read of device data.

    The pairs are sorted by expert on the device and the group ends found by a search of the
    sorted ids (no ``bincount``, whose output size a GPU would have to read), so the layer is a
    fixed sequence of ops with static shapes.

    Args:
        hidden: ``(T, H)``; top_k_index, top_k_weights: ``(T, k)``.
        gate_up: ``(G, 2I, H)``; down: ``(G, H, I)``: every expert's weights (``G`` = E), or the
            slot pool's views (``G`` slots) with ``slot_map``.
        act_fn: the experts' activation.
        residual: added to the output in the weighted sum's op, when given.
        slot_map: ``(E,)`` each expert's slot (the target's pool), on the device.
        rows: one token's pair rows already made, ``(k, H)``: its row ``k`` times (``_Fused.moe_input``:
            written by the norm's own kernels, where copying ``hidden`` out ``k`` times is a kernel more).
    """
    tokens, k = top_k_index.shape
    if rows is not None and (tokens != 1 or tuple(rows.shape) != (k, hidden.shape[-1])):
        raise ValueError(f"rows: one token's {k} pair rows of {hidden.shape[-1]} expected, got {tuple(rows.shape)} "
                         f"for {tokens} tokens")
    groups = gate_up.shape[0]
    key = (groups, hidden.device)
    if key not in _EXPERT_IDS:
        _EXPERT_IDS[key] = torch.arange(groups, device=hidden.device)
    ids = top_k_index.reshape(-1) if slot_map is None else slot_map[top_k_index.reshape(-1)]
    sorted_ids, order = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, _EXPERT_IDS[key], right=True, out_int32=True)
    if tokens == 1:  # every pair's row is the one token's, whatever the order: one copy (or none), no division
        x = hidden.expand(k, -1).contiguous() if rows is None else rows
    else:
        x = hidden.index_select(0, torch.div(order, k, rounding_mode="floor"))
    gate, up = grouped_linear(x, gate_up, ends).chunk(2, dim=-1)
    y = grouped_linear(act_fn(gate) * up, down, ends)
    pairs = hidden.new_empty(tokens * k, hidden.shape[-1]).index_put_((order,), y)
    return weighted_sum(pairs.view(tokens, k, -1), top_k_weights, residual)


def plan_of(tokens: np.ndarray, rows: np.ndarray, ends: np.ndarray, padded_to: int | None = None) -> np.ndarray:
    """A grouped call's plan as int32: the pairs' token rows, their output rows, the slots' cumulative
    row counts. ``padded_to``: ``T·k`` rows whatever the pairs (a captured graph's input), the rows past
    them token 0's in the last slot's group, written to the scratch row ``T·k`` (an empty padded plan
    computes nothing)."""
    if padded_to is not None:
        extra = padded_to - len(tokens)
        tokens = np.concatenate([tokens, np.zeros(extra, dtype=np.int64)])
        rows = np.concatenate([rows, np.full(extra, padded_to, dtype=np.int64)])
        ends = ends.copy()
        ends[-1] = padded_to
    return np.concatenate([tokens, rows, ends]).astype(np.int32)


def planned_pairs(
    hidden: torch.Tensor, plan: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor], out: torch.Tensor,
) -> None:
    """The pairs a ``PairOutputs.plan`` names (on the device: token rows, pair rows, then the ``G``
    slots' ends), computed from the slots ``gate_up`` ``(G, 2I, H)`` and ``down`` ``(G, H, I)`` into
    their rows of ``out``: rows gathered, one grouped matmul each for gate_up and down, rows put
    back. A padded plan (``out`` has its scratch row then) keeps the shapes of every call the same."""
    n = (plan.shape[0] - gate_up.shape[0]) // 2
    tokens, rows, ends = plan[:n], plan[n : 2 * n], plan[2 * n :]
    x = hidden.index_select(0, tokens)
    gate, up = grouped_linear(x, gate_up, ends).chunk(2, dim=-1)
    y = grouped_linear(act_fn(gate) * up, down, ends)
    out.index_put_((rows,), y)


def weighted_sum(pairs: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``(T, k, H)`` pair outputs times ``(T, k)`` weights summed over k, plus ``residual`` (one op)."""
    row = weights.unsqueeze(1).to(pairs.dtype)
    if residual is None:
        return torch.bmm(row, pairs).squeeze(1)
    return torch.baddbmm(residual.unsqueeze(1), row, pairs).squeeze(1)


def has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs on ``device`` in ``dtype`` (tried once on a small case, then remembered).

    On CUDA only bf16 counts: the H200 (torch 2.11) ran fp32 through a fallback that copies the group
    offsets to the host — a sync per call, and a CUDA graph cannot capture it."""
    key = (device.type, dtype)
    if device.type == "cuda" and dtype != torch.bfloat16:
        return False
    if key not in _GROUPED_OK:
        try:
            x = torch.zeros(2, 8, device=device, dtype=dtype)
            w = torch.zeros(2, 8, 8, device=device, dtype=dtype)
            F.grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([1, 2], device=device, dtype=torch.int32))
            _GROUPED_OK[key] = True
        except (RuntimeError, NotImplementedError):  # no grouped kernel for this device or dtype
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``F.linear(x[rows of group g], weights[g])`` for every group g, in one call.

    Args:
        x: ``(n, in)`` rows sorted by group.
        weights: ``(G, out, in)``, one matrix per group (the slot pool's views).
        ends: ``(G,)`` int32, the cumulative row count at the end of each group.
    """
    if has_grouped_mm(x.device, x.dtype):
        return F.grouped_mm(x, weights.transpose(1, 2), offs=ends)
    group = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device, dtype=ends.dtype), right=True)
    return torch.bmm(weights.index_select(0, group), x.unsqueeze(-1)).squeeze(-1)
