"""Decode steps (one token, a verify window, a catch-up) without transformers' per-call machinery.

A decode step of a small draft is mostly not arithmetic: on this project's CPU a one-token forward
of ``moe-fine-awq`` spends about a quarter of its time in transformers' wrappers (input checks,
output capture, the causal mask, ~90 module calls, the attention dispatch), none of which a
decode step with a KV cache needs. ``LeanStep`` runs the same tensor operations in the same
order on the modules' own weights — the layers' norms, attention and MoE block, the router and
experts modules called as they are, so the routing hooks and the draft's experts runner see what
they see in the eager forward — and the logits and routing are bit for bit the eager forward's
(tests). It is the CPU's counterpart of capturing the draft step in a CUDA graph.

It takes the families whose layers are pre-norm attention (q, k, v, o with optional bias and
optional per-head q/k norms, rotary, full attention through SDPA) and an MoE block of router,
experts and an optional gated shared expert: ``mixtral``, ``qwen2_moe``, ``qwen3_moe``. Other
families, a sliding window, another attention implementation, and the prompt (an empty cache)
take transformers' forward. Several tokens after a cache (a round's catch-up: the last draft token
and the bonus) attend through the causal mask transformers builds for them, a boolean
``(1, 1, T, past + T)``. A step's rotary cos and sin are rows of a table the rotary module made once
for many positions (``rotation``), bit for bit its call at those positions.

``fused=True`` (the target's and the draft's) also issues fewer ops for the same arithmetic: q, k
and v in one linear, the rotation of q and k (and qwen3's per-head norms) on both at once, the
router and the shared expert's gate, up and gate-score projections in one linear, the router's
softmax and top-k inline (its choice kept on the device in ``routing()``, read by the caller
once per step rather than by a hook per layer). The fused weights are made once at construction, and the modules' own weights
become views of them, so memory is not doubled and transformers' forward (the prompt) reads the
same bytes. A fused step matches the eager forward to rounding, not bit for bit (a longer matmul
may take another BLAS kernel): the target's lossless tests compare tokens with transformers'
``generate`` and the engine's plain decoding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specter.timing.dispatch import once_per_step

LEAN_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})


def _rms(norm: Any, x: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """An RMSNorm module's forward (``weight * x / rms(x)``, computed in fp32) on its own weight (``rows``:
    ``_rms_weight``'s)."""
    return _rms_weight(x, norm.weight, norm.variance_epsilon, rows)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _is_rms(module: Any) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


class LeanStep:
    """``step(token_ids (1, T), cache) -> logits (1, T, V)`` for a supported model (``fused``: see above)."""

    def __init__(self, model: torch.nn.Module, fused: bool = False):
        self.model = model
        self.inner: Any = model.get_decoder()  # type: ignore[operator]
        self.layers = list(self.inner.layers)
        self.fused = [_Fused(layer) for layer in self.layers] if fused else None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # ``rotation``'s rows, made once
        self._turn: tuple[torch.Tensor, torch.Tensor] | None = None  # ``turn_at``'s table and the cos it was made of
        self._constants: tuple[torch.Tensor, torch.Tensor] | None = None  # ``_turn_constants``

    def routing(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Fused only: layer → (top-k ids, their router probabilities) of the latest step, on the device."""
        assert self.fused is not None
        return {i: f.routing for i, f in enumerate(self.fused) if f.routing is not None}

    @classmethod
    def for_model(cls, model: torch.nn.Module, model_type: str, fused: bool = False) -> LeanStep | None:
        """A lean step for ``model``, or None where it must take transformers' forward."""
        config: Any = model.config
        if model_type not in LEAN_FAMILIES or config._attn_implementation != "sdpa":
            return None
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return None
        if getattr(config, "use_sliding_window", False) or (
            model_type == "mixtral" and getattr(config, "sliding_window", None)
        ):
            return None
        inner: Any = model.get_decoder()  # type: ignore[operator]
        norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if not all(_is_rms(n) for n in norms):
            return None
        for layer in inner.layers:
            attention = layer.self_attn
            for name in ("q_norm", "k_norm"):
                if hasattr(attention, name) and not _is_rms(getattr(attention, name)):
                    return None
        return cls(model, fused)

    def takes(self, input_ids: torch.Tensor, cache: DynamicCache | None) -> bool:
        """Whether this step computes ``input_ids`` after ``cache`` (one sequence; a prompt does not)."""
        return cache is not None and input_ids.shape[0] == 1 and (input_ids.shape[1] == 1 or cache.get_seq_length() > 0)

    def __call__(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        if not self.takes(input_ids, cache):
            raise ValueError(
                f"input_ids: a lean step takes (1, T) tokens after a non-empty cache, or one token; got "
                f"{tuple(input_ids.shape)} after {cache.get_seq_length()} cached positions"
            )
        tokens, past = input_ids.shape[1], cache.get_seq_length()
        device = input_ids.device
        mask = None
        with once_per_step:
            if tokens > 1:  # transformers' sdpa mask for these positions: key j for query i iff j <= past + i
                positions = torch.arange(past, past + tokens, device=device)
                mask = (torch.arange(past + tokens, device=device)[None, :] <= positions[:, None])[None, None]
            rotation = self.rotation(past, tokens)
        return self._run(input_ids, rotation, mask, cache)

    def batch(self, inputs: list[torch.Tensor], caches: list[DynamicCache]) -> list[torch.Tensor]:
        """Several sequences in one step (fused only): ``inputs[i]`` (1, T_i) after ``caches[i]`` (a
        ``DynamicCache``, empty for a prompt's first chunk). Every projection, norm and MoE block runs
        once over all their positions; attention runs per sequence against its own cache, causal within
        its T_i. Returns each sequence's logits (1, T_i, V)."""
        if self.fused is None:
            raise ValueError("a batched step needs the fused lean step")
        if len(inputs) != len(caches) or not inputs:
            raise ValueError(f"a batched step: {len(inputs)} inputs for {len(caches)} caches")
        for ids in inputs:
            if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
                raise ValueError(f"input_ids: a batched step takes (1, T) tokens per sequence; got {tuple(ids.shape)}")
        device = inputs[0].device
        lengths = [ids.shape[1] for ids in inputs]
        pasts = [cache.get_seq_length() for cache in caches]
        segments = []
        with once_per_step:
            positions = torch.tensor([[p + j for p, t in zip(pasts, lengths, strict=True) for j in range(t)]],
                                     device=device)
            for cache, past, tokens in zip(caches, pasts, lengths, strict=True):
                mask = None
                if tokens > 1:  # as ``__call__``'s, for this sequence alone
                    here = torch.arange(past, past + tokens, device=device)
                    mask = (torch.arange(past + tokens, device=device)[None, :] <= here[:, None])[None, None]
                segments.append((cache, mask, tokens))
            rotation = self.rotary(self.inner.embed_tokens.weight, positions)
            ids = torch.cat(inputs, dim=1)
        logits = self._run(ids, rotation, None, None, segments)
        return list(logits.split(lengths, dim=1))

    def _run(self, input_ids: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
             cache: Any, segments: list[tuple[Any, torch.Tensor | None, int]] | None = None) -> torch.Tensor:
        with once_per_step:
            hidden = self.inner.embed_tokens(input_ids)
        cos, sin = rotation
        for i, layer in enumerate(self.layers):
            x = _rms(layer.input_layernorm, hidden)
            if self.fused is None:
                hidden = hidden + self._attention(layer.self_attn, x, cos, sin, mask, cache)
                hidden = hidden + self._mlp(layer.mlp, _rms(layer.post_attention_layernorm, hidden))
            else:
                hidden = self.fused[i].attention(layer.self_attn, x, cos, sin, mask, cache, hidden, segments)
                x, rows = self.fused[i].moe_input(layer.mlp, layer.post_attention_layernorm, hidden)
                hidden = self.fused[i].mlp(layer.mlp, x, hidden, rows)
        with once_per_step:
            return self.model.lm_head(_rms(self.inner.norm, hidden))  # type: ignore[operator]

    def rotation(self, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary``'s cos and sin at positions ``start`` to ``start + tokens``: views of a table of many
        positions, so a step issues no op for them (``rotary`` issues six to eight, and the positions'
        ``arange`` one). A RoPE whose frequencies change with the positions seen (dynamic, longrope)
        is computed each step."""
        weight = self.inner.embed_tokens.weight  # the hidden states' dtype and device, which ``rotary`` takes
        rope = getattr(self.inner.rotary_emb, "rope_type", "default")
        if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope":
            return self.rotary(weight, torch.arange(start, start + tokens, device=weight.device)[None])
        cos, sin = self._rotation_table(start + tokens, weight)
        return cos[..., start : start + tokens, :], sin[..., start : start + tokens, :]

    def turn_at(self, positions: torch.Tensor, capacity: int, like: torch.Tensor) -> torch.Tensor:
        """The graphed step's rotation at ``positions`` (T,) held on the device, all below ``capacity``:
        ``(heads, T, 2d)``, each head's row ``[cos | signed sin]`` at each position for the query and key
        heads of the fused q/k/v projection and ``[1 | 0]`` for its value heads, which the rotation
        then leaves as they are (``_Fused.static_attention``: x·1 + y·0). Two kernels a step: a gather
        of the positions' rows from a table that covers the cache (a graphed step's positions are the
        device's, so it cannot slice them; ``rotary`` issues some fifteen kernels in a bf16 step) and a
        ``where`` that gives the value heads their rows. The table is kept as long as the last one made
        covers ``capacity`` (a graph captured over it holds it by ``_Pieces.table``); a RoPE that changes
        with the positions seen is computed each step."""
        assert self.fused is not None
        fused = self.fused[0]
        rope = getattr(self.inner.rotary_emb, "rope_type", "default")
        if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope":
            cos, sin = self.rotary(like, positions[None])
            rows = torch.cat((cos, sin), dim=-1)[0, 0]
        else:
            rows = self._turn_table(capacity, like).index_select(0, positions)
        keep, values = self._turn_constants(like, fused.q_heads + fused.kv_heads, fused.kv_heads, rows.shape[-1])
        return torch.where(values, keep, rows)

    def turn_table(self) -> torch.Tensor | None:
        """The table ``turn_at`` gathers from (None until made)."""
        return None if self._turn is None else self._turn[0]

    def _turn_table(self, positions: int, like: torch.Tensor) -> torch.Tensor:
        """``[cos | signed sin]`` rows ``(positions, 2d)`` of ``_rotation_table``, remade with it."""
        cos, sin = self._rotation_table(positions, like)
        if self._turn is None or self._turn[1] is not cos:
            self._turn = (torch.cat((cos, sin), dim=-1)[0, 0], cos)
        return self._turn[0]

    def _turn_constants(self, like: torch.Tensor, rotated: int, kept: int, width: int,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1 | 0]`` (width,) in ``like``'s dtype and which heads are value heads ``(heads, 1, 1)``, made
        once per dtype and device (outside any capture: a warm-up makes them)."""
        found = self._constants
        if found is None or found[0].dtype != like.dtype or found[0].device != like.device:
            half = width // 2
            keep = torch.cat((torch.ones(half, dtype=like.dtype, device=like.device),
                              torch.zeros(half, dtype=like.dtype, device=like.device)))
            values = (torch.arange(rotated + kept, device=like.device) >= rotated)[:, None, None]
            found = self._constants = (keep, values)
        return found

    def _rotation_table(self, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary`` at positions 0 to at least ``positions`` in ``like``'s dtype and device, made by one call
        (its ops are elementwise, so each row is what a call at that position alone gives) and remade
        twice as long when a step goes past it."""
        table = self._table
        if table is None or table[0].shape[-2] < positions or (table[0].dtype, table[0].device) != (
                like.dtype, like.device):
            size = max(positions, 2 * table[0].shape[-2] if table is not None else 256)
            table = self._table = self.rotary(like, torch.arange(size, device=like.device)[None])
        return table

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation's cos and sin at ``positions`` (1, T), shaped for the heads (fused: ``sin`` signed)."""
        cos, sin = self.inner.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.fused is not None:  # rotate_half(x) * sin == roll(x, d/2) * (sin with its first half negated)
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos, sin

    @staticmethod
    def _attention(
        attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
        cache: DynamicCache,
    ) -> torch.Tensor:
        tokens = x.shape[1]
        shape = (1, tokens, -1, attention.head_dim)
        q = F.linear(x, attention.q_proj.weight, attention.q_proj.bias).view(shape)
        k = F.linear(x, attention.k_proj.weight, attention.k_proj.bias).view(shape)
        if hasattr(attention, "q_norm"):  # qwen3_moe: per head, before the rotation
            q, k = _rms(attention.q_norm, q), _rms(attention.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = F.linear(x, attention.v_proj.weight, attention.v_proj.bias).view(shape).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = cache.update(k, v, attention.layer_idx)
        out, _ = sdpa_attention_forward(attention, q, k, v, mask, dropout=0.0, scaling=attention.scaling)
        return F.linear(out.reshape(1, tokens, -1), attention.o_proj.weight, attention.o_proj.bias)

    @staticmethod
    def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(mlp, "experts"):  # a dense layer (qwen2_moe's mlp_only_layers)
            return mlp(x)  # type: ignore[no-any-return]
        flat = x.view(x.shape[1], -1)
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            shared_out = F.linear(
                shared.act_fn(F.linear(flat, shared.gate_proj.weight)) * F.linear(flat, shared.up_proj.weight),
                shared.down_proj.weight,
            )
        _, weights, ids = mlp.gate(flat)  # the router module: the draft's routing hook records it
        out = mlp.experts(flat, ids, weights)
        if shared is not None:
            out = out + torch.sigmoid(F.linear(flat, mlp.shared_expert_gate.weight)) * shared_out
        return out.view(x.shape)  # type: ignore[no-any-return]


def _rms_weight(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int = 1) -> torch.Tensor:
    """RMSNorm with a given weight (a module's, or qwen3's q and k head norms stacked: a row per head).

    transformers' arithmetic — ``x / rms(x)`` in fp32, rounded to the model's dtype, times the weight
    in it — with the fp32 part in one op: ``F.rms_norm`` without a weight, on ``x`` in its own dtype
    (it computes in fp32 and rounds its output once, so a bf16 step issues no conversions around it:
    on a GPU one fused kernel where the module's ``to``, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``
    and ``to`` are seven; on a CPU bit for bit those ops). The weight stays outside it: inside, the
    fused kernel would multiply before rounding, where transformers rounds first (a bf16 model's norms
    would round once, not twice).

    ``rows``: ``x`` is one row ``(1, 1, H)`` and the result that row ``rows`` times ``(1, rows, H)``,
    contiguous: the weight's product reads the normed row through a stride-0 view (an elementwise op
    takes one as it is, where a norm kernel may copy its input contiguous first), so the rows cost no
    kernel more and each is the one row's value, bit for bit."""
    normed = F.rms_norm(x, x.shape[-1:], eps=eps)
    if rows > 1:
        normed = normed.expand(*normed.shape[:-2], rows, normed.shape[-1])
    return weight * normed


def _fuse(modules: list[Any], name: str) -> torch.Tensor | None:
    """The ``name`` tensors of ``modules`` stacked by rows; each module's becomes a view of it."""
    given = [getattr(m, name, None) for m in modules]
    if all(p is None for p in given):
        return None
    parts = [p for p in given if p is not None]
    if len(parts) != len(given):
        raise ValueError(f"fused step: {name} is set on some of the fused projections and not others")
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for module, part in zip(modules, parts, strict=True):
        setattr(module, name, torch.nn.Parameter(fused[start : start + part.shape[0]], requires_grad=False))
        start += part.shape[0]
    return fused


def _projected(attention: Any, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual`` plus the output projection of the heads' ``out`` (T, H·d): the sum inside the matmul."""
    tokens = out.shape[0]
    if attention.o_proj.bias is not None:
        return residual + F.linear(out, attention.o_proj.weight, attention.o_proj.bias).view(residual.shape)
    return torch.addmm(residual.view(tokens, -1), out, attention.o_proj.weight.t()).view(residual.shape)


class _Fused:
    """One layer's fused projections (``LeanStep(fused=True)``)."""

    def __init__(self, layer: Any):
        attention = layer.self_attn
        self.q_heads = attention.q_proj.weight.shape[0] // attention.head_dim
        self.kv_heads = attention.k_proj.weight.shape[0] // attention.head_dim
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.qkv = (_fuse(projections, "weight"), _fuse(projections, "bias"))
        self.qk_norm: tuple[torch.Tensor, float] | None = None
        self._halves: torch.Tensor | None = None  # ``static_attention``'s gather: each head's ``[x | roll(x)]``
        if hasattr(attention, "q_norm"):
            q_norm, k_norm = attention.q_norm, attention.k_norm
            weight = torch.cat([q_norm.weight.detach().expand(self.q_heads, -1),
                                k_norm.weight.detach().expand(self.kv_heads, -1)])
            if q_norm.variance_epsilon != k_norm.variance_epsilon:
                raise ValueError("fused step: the q and k head norms have different epsilons")
            self.qk_norm = (weight, q_norm.variance_epsilon)
        mlp = layer.mlp
        self.routed = hasattr(mlp, "experts")
        self.projection: torch.Tensor | None = None  # router, then the shared expert's gate, up, score
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, probs) of the latest call
        if not self.routed:
            return
        router = mlp.gate
        self.experts, self.top_k = router.weight.shape[0], router.top_k
        # qwen2/qwen3 routers say whether they renormalize; mixtral's always do (their forwards in transformers)
        self.normalize = getattr(router, "norm_topk_prob", True)
        shared = getattr(mlp, "shared_expert", None)
        parts = [router]
        if shared is not None:
            self.inter = shared.gate_proj.weight.shape[0]
            parts += [shared.gate_proj, shared.up_proj, mlp.shared_expert_gate]
        if all(getattr(p, "bias", None) is None for p in parts):
            self.projection = _fuse(parts, "weight")

    def attention(
        self, attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
        cache: DynamicCache, residual: torch.Tensor, segments: list[tuple[Any, torch.Tensor | None, int]] | None = None,
    ) -> torch.Tensor:
        """``residual`` plus the attention block's output (the sum in the output projection's matmul).
        ``segments``: several sequences' positions one after another (``LeanStep.batch``), each
        ``(cache, mask, length)``; ``mask`` and ``cache`` are then unused."""
        tokens = x.shape[1]
        weight, bias = self.qkv
        assert weight is not None
        qkv = F.linear(x, weight, bias).view(1, tokens, -1, attention.head_dim)
        split = self.q_heads + self.kv_heads
        qk, v = qkv[:, :, :split], qkv[:, :, split:]
        if self.qk_norm is not None:  # qwen3_moe: per head, before the rotation
            qk = _rms_weight(qk, *self.qk_norm)
        qk = qk.transpose(1, 2)
        qk = qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin
        if segments is not None:
            out = self._per_sequence(attention, qk, v.transpose(1, 2), segments).reshape(tokens, -1)
        else:
            k, v = cache.update(qk[:, self.q_heads :], v.transpose(1, 2), attention.layer_idx)
            out, _ = sdpa_attention_forward(attention, qk[:, : self.q_heads], k, v, mask, dropout=0.0,
                                            scaling=attention.scaling)
            out = out.reshape(tokens, -1)
        return _projected(attention, out, residual)

    def static_attention(self, attention: Any, x: torch.Tensor, turn: torch.Tensor, mask: torch.Tensor,
                         cache: Any, residual: torch.Tensor) -> torch.Tensor:
        """``attention`` for a graphed piece over a ``StaticKV`` (``models/graphed.py``): ``residual`` plus
        the attention block's output. ``turn``: ``LeanStep.turn_at``'s ``(heads, T, 2d)`` rows; ``mask``:
        the additive bias ``masked_attention`` takes.

        The rotation runs on all of the fused projection's heads at once: each head's ``[x | roll(x)]``
        (one ``index_select``), times its ``[cos | signed sin]`` row (one product), the two halves summed (one
        reduction) — transformers' ``x·cos + rotate_half(x)·sin``, each product rounded and then their
        sum, as its three ops and a ``cat`` do; the value heads' rows ``[1 | 0]`` leave them as they are.
        So the new keys and values come out side by side and are written to the cache in one copy
        (``StaticKV.write``): three kernels and one write where the rotation of q and k took four and
        the cache two."""
        tokens, dim = x.shape[1], attention.head_dim
        weight, bias = self.qkv
        assert weight is not None
        qkv = F.linear(x, weight, bias).view(1, tokens, -1, dim)
        if self.qk_norm is not None:  # qwen3_moe: per head, before the rotation
            split = self.q_heads + self.kv_heads
            qkv = torch.cat((_rms_weight(qkv[:, :, :split], *self.qk_norm), qkv[:, :, split:]), dim=2)
        if self._halves is None or self._halves.device != qkv.device:  # made by a warm-up, before any capture
            ids = torch.arange(dim, device=qkv.device)
            self._halves = torch.cat((ids, ids.roll(dim // 2)))
        heads = qkv.shape[2]
        # ``index_select`` lays its output out head by head whatever the input's layout (an indexing follows
        # the input's token-major one): the query heads reshape for attention without a copy when T > 1
        halves = torch.index_select(qkv.transpose(1, 2), -1, self._halves)
        turned = (halves * turn).view(1, heads, tokens, 2, dim).sum(dim=-2)
        k, v = cache.write(turned[:, self.q_heads :], attention.layer_idx)
        out = masked_attention(turned[:, : self.q_heads], k, v, mask, attention.scaling).reshape(tokens, -1)
        return _projected(attention, out, residual)

    def _per_sequence(self, attention: Any, qk: torch.Tensor, v: torch.Tensor,
                      segments: list[tuple[Any, torch.Tensor | None, int]]) -> torch.Tensor:
        """Each sequence's positions of ``qk`` (1, H + H_kv, ΣT, d) and ``v`` (1, H_kv, ΣT, d) against its
        own cache, as one sequence's step computes them; their outputs (1, ΣT, H, d) in order."""
        outs, start = [], 0
        for cache, mask, tokens in segments:
            rows = slice(start, start + tokens)
            k, v_seq = cache.update(qk[:, self.q_heads :, rows], v[:, :, rows], attention.layer_idx)
            out, _ = sdpa_attention_forward(attention, qk[:, : self.q_heads, rows], k, v_seq, mask, dropout=0.0,
                                            scaling=attention.scaling)
            outs.append(out)
            start += tokens
        return torch.cat(outs, dim=1)

    def moe_input(self, mlp: Any, norm: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MoE block's input: ``norm`` of ``hidden`` (1, T, H); and, for one token whose routed experts
        run on a Specter runner that takes them (``takes_rows``: grouped calls over resident weights),
        its pair rows ``(k, H)`` — the normed row ``k`` times, written by the norm's weight product
        (``_rms_weight``'s ``rows``: each row the one row's value, bit for bit), where copying it out
        ``k`` times after the norm is a kernel more; the input is then the first of them (a view).
        Otherwise ``None``."""
        tokens = hidden.shape[1]
        runner = mlp.experts.__dict__.get("_specter_runner") if self.routed else None
        if tokens == 1 and self.projection is not None and getattr(runner, "takes_rows", False):
            rows = _rms(norm, hidden, self.top_k)
            return rows[:, :1], rows[0]
        return _rms(norm, hidden), None

    def mlp(self, mlp: Any, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``residual`` plus the MoE block's output (added in the experts' weighted sum); the router's
        choice is kept in ``routing`` (ids and their probabilities). ``rows``: ``moe_input``'s."""
        if not self.routed:  # a dense layer (qwen2_moe's mlp_only_layers)
            return residual + mlp(x)  # type: ignore[no-any-return]
        if self.projection is None:  # projections with biases: unfused
            return residual + LeanStep._mlp(mlp, x)
        flat, ids, weights, projected = self.route(x)
        out = _experts_with_residual(mlp.experts, flat, ids, weights, residual.view(flat.shape), rows)
        return self.combine(mlp, out, projected).view(x.shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's choice for ``x`` (1, T, H) (kept in ``routing``): the rows ``(T, H)``, top-k ids and
        weights ``(T, k)``, and the fused projection (router logits, then the shared expert's inputs)."""
        assert self.projection is not None
        flat = x.view(x.shape[1], -1)
        projected = F.linear(flat, self.projection)
        logits = projected[:, : self.experts]
        probs, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        self.routing = (ids, probs)
        # the weights in the model's dtype, which the experts' weighted sum takes (``weighted_sum`` casts
        # them there), rounded in the division's own kernel
        if not self.normalize:
            return flat, ids, probs.to(logits.dtype), projected
        weights = torch.div(probs, probs.sum(dim=-1, keepdim=True), out=probs.new_empty(probs.shape, dtype=logits.dtype))
        return flat, ids, weights, projected

    def combine(self, mlp: Any, out: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """The routed experts' output ``out`` (T, H) (with the residual in it) plus the gated shared expert."""
        if projected.shape[1] == self.experts:
            return out
        shared, start = mlp.shared_expert, self.experts
        gate, up = projected[:, start : start + self.inter], projected[:, start + self.inter : start + 2 * self.inter]
        shared_out = F.linear(shared.act_fn(gate) * up, shared.down_proj.weight)
        score = projected[:, start + 2 * self.inter :]
        return torch.addcmul(out, torch.sigmoid(score), shared_out)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scaling: float,
                     ) -> torch.Tensor:
    """Attention as plain matmuls: ``q`` (1, H, T, d) over ``k``, ``v`` (1, H_kv, S, d) plus ``bias``
    (G·T, S) with G = H / H_kv (the step's mask repeated per query head of a group, made once a step,
    in the scores' dtype; one token's (1, S) row broadcasts over the group as it is), scaled and added
    in the scores' matmul (``-inf`` masks a key), the softmax accumulated in fp32 (a low-precision
    dtype's kernel does so inside); returns (1, T, H, d). Three kernels: the scores, the softmax, the
    values.

    The graphed pieces' attention (``models/graphed.py``): SDPA picks its kernel by dtype, mask and
    head grouping (some of them fall back to its math path), while these matmuls are the same ops in
    every case, and the H200 captured them in fp32 with grouped-query heads for every policy
    (``tests/gpu``). A decode step's attention over a cache of a few hundred positions is a few small
    matmuls anyway. A query head ``i`` reads key head ``i // G``, as transformers' ``repeat_kv``
    arranges, without repeating the keys."""
    _, heads, tokens, dim = q.shape
    kv_heads = k.shape[1]
    rows = heads // kv_heads * tokens
    scores = torch.baddbmm(bias, q.reshape(kv_heads, rows, dim), k[0].transpose(-1, -2), alpha=scaling)
    out = torch.matmul(torch.softmax(scores, dim=-1), v[0])
    return out.view(1, heads, tokens, dim).transpose(1, 2)


def _experts_with_residual(
    experts: Any, flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual`` plus the routed experts' output: summed in the experts' own weighted sum where
    Specter runs them (its runners take a residual), else added after. ``rows``: one token's pair rows
    (``_Fused.moe_input``), for a runner that takes them."""
    runner = experts.__dict__.get("_specter_runner")
    if runner is None:
        return residual + experts(flat, ids, weights)  # type: ignore[no-any-return]
    given = {} if rows is None else {"rows": rows}  # only a runner that ``takes_rows`` is given them
    return runner.forward(experts, experts.__dict__["_specter_layer"], flat, ids, weights,  # type: ignore[no-any-return]
                          residual=residual, **given)
