"""Decode steps with static shapes: a fixed-capacity KV cache, the dense parts replayed as CUDA graphs.

On a GPU a small model's decode step is launch-bound: the H200 ran the draft's eager step (some 45
kernels per MoE layer, each issued from Python) at about the target's cost, whatever int4 saved
(shared NOTES, "First run on a GPU"), and the target's step spent 1.5 ms a layer issuing ~45 kernels
where its arithmetic needs ~0.05 ms (docs/benchmark.md). A CUDA graph launches a captured sequence of kernels at
once, but only over buffers whose shapes and addresses never change. So:

* ``StaticKV`` holds each layer's keys and values in buffers of a fixed capacity, the length on the
  host and the next position on the device (moved on by each step inside its graph, set from the host
  only after a crop or a prompt). A step writes its tokens at the device-side positions and
  attends over the whole capacity with the slots past them masked (``models/decode.py:
  masked_attention``). ``crop`` only moves the length (slots past it are masked until rewritten).
  When a sequence outgrows the capacity the buffers double, and a capture over the old ones is
  dropped.
* ``GraphedStep`` runs the fused lean step (``models/decode.py``) over one ``StaticKV`` in pieces cut
  at each layer whose experts must run outside a graph (the target's: its executor reads the routing
  and fetches misses); the draft's experts are resident and grouped, so its step is one piece. On
  CUDA each piece is captured once per token count (and again when the cache's buffers move) and
  replayed. Between pieces the host reads the layer's routing and fetches what is missing; the
  experts in slots are computed by the layer's *slot graph* (captured with the pieces), replayed
  over a plan the host copies in (which pairs, from which slots: ``PairOutputs.plan``) for the ready
  experts and again for each group that lands, into pair outputs the next piece weights and sums;
  what the host computes itself goes there too. With ``capture=False`` (a CPU) the same pieces and
  slot graphs run eagerly, so the tests run the code a GPU captures.
* While every split layer's experts sit ready in slots (all resident: nothing to fetch, no routing
  the host must read first), the target's step is not cut: it runs whole, each layer's experts from
  their slots inside it (``OffloadedExperts.resident_experts``, over a device copy of the slot map),
  one graph per token count (captured anew when the slot layout differs from the one it holds); the
  layers' bookkeeping (dense time, slots marked read, the routing's counters when the next read
  brings it) follows the step on the host. While an expert is away (evicted, or still loading) the
  step is cut again.

The prompt still takes transformers' forward (into a ``DynamicCache``, then copied in): it runs once
per request, and its shapes differ every time.
"""

from __future__ import annotations

import logging
import traceback
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from specter.experts.executor import slot_map
from specter.experts.grouped import plan_of, weighted_sum
from specter.models.decode import _experts_with_residual, _rms
from specter.models.routing import Routing
from specter.timing.dispatch import once_per_step, replay

log = logging.getLogger(__name__)
STEP_MODES = ("auto", "graph", "static", "eager")  # how a model's steps after the prompt run (see load())
CAPTURE_AFTER = 2  # a token count's pieces are captured on its second step (a count seen once runs eagerly)


def window_counts(window: int, draft: bool = False) -> range:
    """The token counts the steps of rounds with windows up to ``window`` run: the target's 1 to
    window + 1 (a plain step, a verify pass of K + 1), a draft's 1 to window + 2 (a round's first step
    feeds what the last round committed): what ``GraphedStep.prepare`` makes ready before a request."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: expected a window of 0 or more draft tokens, got {window!r}")
    return range(1, window + (3 if draft else 2))


def resolve_step(step: str, device: torch.device, unsupported: str | None) -> str:
    """The mode a model's steps after the prompt run in: ``auto`` is ``graph`` on CUDA where the model
    can take it (``unsupported`` None; else it says what is missing) and ``eager`` otherwise; a mode
    the model or the device cannot take is refused by name."""
    if step not in STEP_MODES:
        raise ValueError(f"step: expected one of {', '.join(STEP_MODES)}, got {step!r}")
    if step == "auto":
        return "graph" if unsupported is None and device.type == "cuda" else "eager"
    if step != "eager" and unsupported is not None:
        raise ValueError(f"step: {step!r} needs {unsupported}")
    if step == "graph" and device.type != "cuda":
        raise ValueError(f"step: 'graph' needs a CUDA device; this model is on {device}")
    return step


class StaticKV:
    """A KV cache of fixed capacity (doubling when outgrown) for ``GraphedStep``'s pieces.

    Each layer's keys and values are one buffer ``(1, 2·H_kv, capacity, d)``, the keys' heads first, so
    a step whose new keys and values come out side by side writes both in one copy (``write``).

    Attributes:
        length: positions held (host).
        position: ``(1,)`` the position the static step writes next (device). A step moves it on by its
            tokens at its end, inside its graph, so the next step sets it from the host only where the host
            moved the length otherwise (a crop, a prompt, a warm-up): ``on_device`` says what it holds.
        slots: ``(capacity,)`` 0, 1, …: the static step's mask is ``slots <= position``.
        version: bumped when the buffers move (a graph captured over the old ones is stale).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"capacity: expected at least 1 position, got {capacity}")
        self.shape = (1, 2 * kv_heads, capacity, head_dim)
        self.kv_heads = kv_heads
        self.dtype, self.device = dtype, torch.device(device)
        self.buffers = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(layers)]
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.slots = torch.arange(capacity, device=device)
        self.length = 0
        self.on_device: int | None = None  # what ``position`` holds once the steps issued have run (None: unknown)
        self.version = 0
        self.write_at = self.position  # the positions a step writes (set by GraphedStep for its pieces)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int = 256) -> StaticKV:
        """A cache shaped for ``model``'s attention layers, on its device and in its dtype."""
        config: Any = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = model.get_input_embeddings().weight  # type: ignore[operator]
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, weight.dtype, weight.device,
                   capacity)

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reset(self) -> None:
        """Empty (a new request); the buffers and any capture over them stay."""
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (a negative count, as ``DynamicCache.crop`` takes)."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.length:
            raise ValueError(f"tokens_to_remove: expected a negative count of at most {self.length} positions "
                             f"to drop, got {tokens_to_remove}")
        self.length += tokens_to_remove

    def reserve(self, length: int) -> None:
        """Room for ``length`` positions: double the capacity until it fits, keeping what is held."""
        if length <= self.capacity:
            return
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        self.shape = (*self.shape[:2], capacity, self.shape[3])
        for i, old in enumerate(self.buffers):
            self.buffers[i] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.buffers[i][:, :, : self.length] = old[:, :, : self.length]
        self.slots = torch.arange(capacity, device=self.device)
        self.version += 1

    def write(self, keys_values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values side by side ``(1, 2·H_kv, T, d)`` at ``write_at`` (one copy);
        return the whole capacity's keys and values."""
        self.buffers[layer_idx].index_copy_(2, self.write_at, keys_values)
        return self.keys_values(layer_idx)

    def keys_values(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values ``(1, H_kv, capacity, d)`` each: views of its buffer."""
        held = self.buffers[layer_idx]
        return held[:, : self.kv_heads], held[:, self.kv_heads :]

    def absorb(self, cache: DynamicCache) -> None:
        """Take a ``DynamicCache``'s positions (the prompt's, from transformers' forward)."""
        length = cache.get_seq_length()
        if len(cache.layers) != len(self.buffers):
            raise ValueError(f"cache: {len(cache.layers)} layers, this static cache has {len(self.buffers)}")
        self.length = 0
        self.reserve(length)
        for i, layer in enumerate(cache.layers):
            held: Any = layer  # a full-attention layer (DynamicLayer): keys and values tensors
            keys, values = self.keys_values(i)
            keys[:, :, :length] = held.keys
            values[:, :, :length] = held.values
        self.length = length


class _Pieces:
    """One token count's pieces: static inputs, what each piece leaves for the next, their graphs."""

    def __init__(self, tokens: int, device: torch.device, slots: tuple[tuple[int, ...], ...] | None = None,
                 blob_bytes: int = 0):
        self.slots = slots  # a whole step's: each split layer's expert → slot (None: the pieces are cut there)
        self.maps = [slot_map(list(s), device, blob_bytes) for s in slots or ()]  # the same as the graph takes them
        # cut pieces whose split layers' experts in slots are computed by graphs too (``GraphedStep.slot_graphs``),
        # per split: the plan the graph reads (``PairOutputs.plan``, padded), the pair outputs, the graph
        self.inside = False
        self.plans: list[torch.Tensor] = []
        self.pairs: list[torch.Tensor] = []
        self.slot_graphs: list[Any] = []
        self.ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
        self.steps = torch.arange(tokens, device=device)
        self.moe: list[torch.Tensor] = []  # per split: the experts' output (residual in it), copied in
        # per split: rows, ids, weights, residual, projection, pair rows (``_Fused.moe_input``; None for several tokens)
        self.routes: list[tuple[Any, ...]] = []
        self.positions = self.mask = self.turn = self.logits = torch.empty(0)
        self.table: Any = None  # the rotation table the step's ``turn`` is gathered from
        self.graphs: list[Any] = []
        self.routing: list[Any] = []  # each fused layer's routing tensors as the graphs left them
        self.version = -1
        self.calls = 0


class GraphedStep:
    """``step(tokens (1, T)) -> logits (1, T, V)`` (fp32) at ``cache.length``, then T positions more.

    The step is cut into pieces at each layer whose experts run outside the graph (``split``: the
    target's, whose executor reads the routing and fetches the misses) unless every such layer's
    experts are all in slots (then it runs whole: ``whole``); the draft's experts are all resident
    and grouped (no read), so its step is one piece. Each piece is captured once per token
    count (and again when the cache's buffers move) and replayed. Between pieces the host reads the
    split layer's routing and fetches what is missing; the experts in slots are computed by a graph
    of their own (``slot_graphs``: one per split layer and token count, replayed for the ready
    experts and again for each group that lands, over the plan of those pairs copied in first),
    the host's own eagerly, all into the pair outputs the next piece sums. Without it the experts
    run eagerly and their output is copied into the next piece's input buffer.

    Args:
        lean: a fused ``LeanStep`` of the model (every routed layer's projections fused).
        cache: the static cache every step of this model writes (its buffers are the graphs').
        capture: replay CUDA graphs; False runs the same pieces eagerly (a CPU).
        split: run each routed layer's experts between pieces (the target) rather than inside them.
    """

    def __init__(self, lean: Any, cache: StaticKV, capture: bool, split: bool = False):
        if lean.fused is None:
            raise ValueError("lean: a graphed step needs a fused LeanStep (its routers run inline)")
        if split and any(f.routed and f.projection is None for f in lean.fused):
            raise ValueError("lean: a split graphed step needs every routed layer's projections fused (no biases)")
        self.lean, self.cache, self.capture = lean, cache, capture
        self.stands_in = not capture  # runs eagerly what a GPU would replay (dispatch counts one op a piece)
        self.splits = [i for i, f in enumerate(lean.fused) if split and f.routed]
        self.groups = lean.fused[0].q_heads // lean.fused[0].kv_heads  # query heads per key head
        self.pieces: dict[int, _Pieces] = {}
        self.whole: dict[int, _Pieces] = {}  # per token count: the step in one piece, experts inside (``_resident``)
        self.runs_whole = split  # False: the step stays cut even when all is resident (the GPU bench's ``engine-cut``)
        self.slot_graphs = split  # False: a cut step's experts run as eager ops between pieces (the runner's forward)
        self._bound: list[tuple[Any, int, Any]] = []  # ``_runners``, once found
        self._resident_at: tuple[tuple[int, ...], Any] | None = None  # ``_resident``'s last answer, by slot pool version
        self.captures = 0
        self.cold = 0  # steps that did not replay: a token count's first (eager) and the one that captured
        self.failure: str | None = None  # why capturing failed (the step then runs eagerly)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # ``_bias_values``

    @property
    def routing(self) -> Routing:
        return dict(self.lean.routing())

    def forward(self, input_ids: torch.Tensor, cache: StaticKV) -> torch.Tensor:
        """Logits (fp32) for ``input_ids`` after ``cache`` (this step's own cache): the prompt through the
        model's transformers forward (its shapes differ every time; copied into the cache after), the
        steps after it through the pieces."""
        if cache is not self.cache:
            raise ValueError("cache: a static cache of another model (take it from this model's new_cache())")
        if cache.length:
            return self(input_ids)
        prompt = DynamicCache(config=self.lean.model.config)
        logits = self.lean.model(input_ids=input_ids, cache=prompt, use_cache=True).logits
        cache.absorb(prompt)
        return logits.float()  # type: ignore[no-any-return]

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        cache, tokens = self.cache, input_ids.shape[1]
        with once_per_step:
            cache.reserve(cache.length + tokens)
            pieces = self._pieces(tokens, self._resident())
            pieces.ids.copy_(input_ids, non_blocking=True)
        pieces.calls += 1
        graphed = self.capture and pieces.calls >= CAPTURE_AFTER
        stale = graphed and pieces.version != cache.version  # no capture over these buffers yet
        if pieces.calls < CAPTURE_AFTER or stale:
            self.cold += 1  # a one-off cost: what a step of this count costs from now on is not this
        if stale:
            graphed = self._try_capture(pieces)
        with once_per_step:
            if cache.on_device != cache.length:  # a crop, a prompt, a warm-up: the device's position is not this step's
                cache.position.fill_(cache.length)
        cache.on_device = None  # until this step's last piece has run (it moves the position on by T)
        if pieces.slots is not None:
            self._whole_step(pieces, graphed)
        for i in range(len(self.splits) + 1 if pieces.slots is None else 0):
            if graphed:
                pieces.graphs[i].replay()
            elif self.stands_in and pieces.calls >= CAPTURE_AFTER:  # a CPU: what a GPU replays, counted so
                with replay(per_step=i == 0):  # L + 1 launches for L split layers: one is the step's own
                    self._piece(pieces, i)
            else:
                self._piece(pieces, i)
            if i < len(self.splits):
                self._experts(pieces, i, graphed)
        if graphed:  # the routers' outputs are the graphs'
            for fused, routing in zip(self.lean.fused, pieces.routing, strict=True):
                fused.routing = routing
        cache.length += tokens
        cache.on_device = cache.length
        with once_per_step:
            logits = pieces.logits
            if logits.dtype != torch.float32:  # the callers' fp32, and a tensor the next replay does not overwrite
                return logits.float()
            return logits.clone() if graphed else logits  # the next replay overwrites the graph's

    def _pieces(self, tokens: int, slots: tuple[tuple[int, ...], ...] | None) -> _Pieces:
        """The token count's pieces: cut at the split layers, or (``slots``: every split layer's experts
        ready in those slots) the whole step in one, made anew when the slots are not the ones it holds."""
        if slots is None:
            runners = self._runners() if self.slot_graphs else []
            inside = bool(runners)
            pieces = self.pieces.get(tokens)
            if pieces is None or pieces.inside != inside:  # a token count's buffers, made once
                pieces = self.pieces[tokens] = _Pieces(tokens, self.cache.device)
                if inside:
                    self._inside(pieces, tokens, runners)
            return pieces
        pieces = self.whole.get(tokens)
        if pieces is None or pieces.slots != slots:
            blob = self._runners()[0][0].pool.shape.nbytes
            pieces = self.whole[tokens] = _Pieces(tokens, self.cache.device, slots, blob)
        return pieces

    def _inside(self, p: _Pieces, tokens: int, runners: list[tuple[Any, int, Any]]) -> None:
        """``p``'s buffers for the slot graphs: per split, a plan that computes nothing (every pair token
        0's in the last slot's group, into the scratch row) and the pair outputs (a row per token and top-k
        position, and the scratch row)."""
        p.inside = True
        hidden = self.lean.inner.embed_tokens.weight
        for (runner, _, _), j in zip(runners, self.splits, strict=True):
            pairs = tokens * self.lean.fused[j].top_k
            none = np.zeros(0, dtype=np.int64)
            p.plans.append(torch.from_numpy(plan_of(none, none, np.zeros(runner.pool.num_slots, dtype=np.int64),
                                                    pairs)).to(hidden.device))
            p.pairs.append(hidden.new_zeros(pairs + 1, hidden.shape[1]))

    def _runners(self) -> list[tuple[Any, int, Any]]:
        """Per split layer: its experts' runner (``experts/executor.py``), the layer's index there and the
        experts module; empty where a split layer's experts have no runner (nothing can be resident)."""
        if self._bound:
            return self._bound
        found = []
        for j in self.splits:
            experts = self.lean.layers[j].mlp.experts
            runner = experts.__dict__.get("_specter_runner")
            if runner is None or not hasattr(runner, "resident_map"):
                return []
            found.append((runner, experts.__dict__["_specter_layer"], experts))
        self._bound = found
        return found

    def _resident(self) -> tuple[tuple[int, ...], ...] | None:
        """Each split layer's expert → slot when every split layer's experts are all ready in slots (the
        whole step then runs as one piece, its experts inside: nothing to fetch, nothing to read);
        None otherwise (some layer must read its routing and fetch)."""
        runners = self._runners() if self.splits and self.runs_whole else []
        versions = tuple(runner.pool.version for runner, _, _ in runners)
        if self._resident_at is not None and self._resident_at[0] == versions:
            return self._resident_at[1]  # no slot changed since the last step: the same answer
        slots: list[tuple[int, ...]] = []
        for runner, layer, _ in runners:
            found = runner.resident_map(layer)
            if found is None:
                slots = []
                break
            slots.append(tuple(found[1]))
        self._resident_at = (versions, tuple(slots) if slots else None)
        return self._resident_at[1]

    def _whole_step(self, p: _Pieces, graphed: bool) -> None:
        """The step in one piece (replayed, stood in for, or run), then what its resident layers leave
        to the host: their dense time, their slots marked read, their routing's bookkeeping."""
        if graphed:
            p.graphs[0].replay()
        elif self.stands_in and p.calls >= CAPTURE_AFTER:
            with replay(per_step=True):  # one launch a step, whatever its layers
                self._whole_pass(p)
        else:
            self._whole_pass(p)
        event = None
        if self.cache.device.type == "cuda":  # one event for every layer's slots: a later copy waits for it
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.cache.device))
        for (runner, layer, _), route, slots in zip(self._runners(), p.routes, p.slots or (), strict=True):
            runner.resident_done(layer, route[0], route[1], slots, event)

    def _whole_pass(self, p: _Pieces) -> None:
        """Every piece, each split layer's experts computed from their slots in between (no read)."""
        runners = self._runners()
        for i in range(len(self.splits) + 1):
            self._piece(p, i)
            if i < len(self.splits):
                runner, _, experts = runners[i]
                flat, ids, weights, residual, _, rows = p.routes[i]
                out = runner.resident_experts(experts, flat, ids, weights, residual, p.maps[i], rows)
                if len(p.moe) > i:
                    p.moe[i] = out
                else:
                    p.moe.append(out)

    @torch.inference_mode()
    def prepare(self, counts: Any) -> int:
        """Make the steps of each token count in ``counts`` ready before a request runs one, so none
        pays the one-off a count's first two steps pay otherwise (``cold``): on CUDA each count's
        pieces are captured now; elsewhere they run once (the warm-up a capture starts with), and a
        CPU's static pieces count as replays from a count's first step, as a GPU's are. The warm-up
        writes keys and values only past the cache's length (masked until a step rewrites them) and
        runs no experts. Returns how many counts were made ready (a count already ready is left)."""
        counts = sorted(set(int(c) for c in counts))
        if counts and counts[0] < 1:
            raise ValueError(f"counts: expected token counts of at least 1, got {counts[0]}")
        if not counts:
            return 0
        cache = self.cache
        cache.reserve(cache.length + counts[-1])  # before any capture: a reserve that moves the buffers stales them
        cache.position.fill_(cache.length)
        ready = 0
        slots = self._resident()
        for tokens in counts:
            pieces = self._pieces(tokens, slots)
            if pieces.version == cache.version if self.capture else pieces.calls >= CAPTURE_AFTER - 1:
                continue  # captured over these buffers (a GPU), or run once (elsewhere): its next step is no one-off
            if not self.capture:
                self._warm(pieces)
            elif not self._try_capture(pieces):
                return ready
            pieces.calls = CAPTURE_AFTER - 1  # the next step of this count replays (or stands in for a replay)
            ready += 1
        return ready

    def _try_capture(self, p: _Pieces) -> bool:
        """``_capture``; an op that cannot be captured here leaves this step's pieces eager from now on
        (logged, ``failure``). Whether ``p`` is captured."""
        try:
            self._capture(p)
        except RuntimeError as exc:
            log.warning("CUDA graph capture failed (%s); the step runs its pieces eagerly", exc, exc_info=True)
            self.capture, self.failure = False, traceback.format_exc()
            return False
        return True

    def _warm(self, p: _Pieces) -> None:
        """Every piece once, in order, on the current stream (their experts' input zeros, unused; a
        whole step's experts run from their slots, their output unused)."""
        self.cache.position.fill_(self.cache.length)  # from the length, whatever warm-ups ran before
        self.cache.on_device = None  # the pieces move the position on: the next step sets it
        if p.slots is not None:
            self._whole_pass(p)
            return
        hidden = self.lean.inner.embed_tokens.weight
        if not p.inside:
            p.moe = [hidden.new_zeros(p.ids.shape[1], hidden.shape[1]) for _ in self.splits]
        for i in range(len(self.splits) + 1):
            self._piece(p, i)
            if p.inside and i < len(self.splits):  # from whatever plan it held: the sum takes zeros
                self._slot_pass(p, i)
                p.pairs[i].zero_()

    def _piece(self, p: _Pieces, i: int) -> None:
        """Piece ``i``: from the experts' output of split ``i - 1`` (or the token embedding) through the
        attention and router of split ``i``'s layer (or to the logits)."""
        lean = self.lean
        if i == 0:
            with once_per_step:
                # one token's position is the cache's own (moved on only at the step's end, after every write);
                # several tokens' are it plus 0, 1, …
                p.positions = self.cache.position if p.ids.shape[1] == 1 else self.cache.position + p.steps
                ahead = self.cache.slots[None, :] > p.positions[:, None]  # keys not yet written (or dropped)
                hidden = lean.inner.embed_tokens(p.ids)
                bias = torch.where(ahead, *self._bias_values(hidden))  # -inf where a key is ahead, else 0
                # a row per (query head of a key head's group, token); one token's row broadcasts over them
                p.mask = bias if ahead.shape[0] == 1 else bias.repeat(self.groups, 1)
                p.turn = lean.turn_at(p.positions, self.cache.capacity, hidden)
                p.table = lean.turn_table()  # the rows' table, alive as long as a graph that reads it
            start = 0
        else:
            layer = self.splits[i - 1]
            if p.inside:  # the split layer's pair outputs, weighted and summed over top-k, the residual in
                _, ids, weights, residual, *_ = p.routes[i - 1]
                moe = weighted_sum(p.pairs[i - 1][:-1].view(*ids.shape, -1), weights, residual)
            else:
                moe = p.moe[i - 1]
            out = lean.fused[layer].combine(lean.layers[layer].mlp, moe, p.routes[i - 1][4])
            hidden, start = out.view(1, *out.shape), layer + 1
        self.cache.write_at = p.positions
        for j in range(start, len(lean.layers)):
            layer, fused = lean.layers[j], lean.fused[j]
            x = _rms(layer.input_layernorm, hidden)
            hidden = fused.static_attention(layer.self_attn, x, p.turn, p.mask, self.cache, hidden)
            x, rows = fused.moe_input(layer.mlp, layer.post_attention_layernorm, hidden)
            if j in self.splits:
                flat, ids, weights, projected = fused.route(x)
                route = (flat, ids, weights, hidden.view(flat.shape), projected, rows)
                if len(p.routes) > i:
                    p.routes[i] = route
                else:
                    p.routes.append(route)
                return
            hidden = fused.mlp(layer.mlp, x, hidden, rows)
        with once_per_step:
            p.logits = lean.model.lm_head(_rms(lean.inner.norm, hidden))
            self.cache.position.add_(p.ids.shape[1])  # the next step's, unless the host moves it (``on_device``)

    def _bias_values(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-inf and 0 in ``like``'s dtype on its device, made once (outside any capture: a warm-up makes them)."""
        if self._bias is None or self._bias[0].dtype != like.dtype or self._bias[0].device != like.device:
            self._bias = (torch.full((), float("-inf"), dtype=like.dtype, device=like.device),
                          torch.zeros((), dtype=like.dtype, device=like.device))
        return self._bias

    def _experts(self, p: _Pieces, i: int, graphed: bool) -> None:
        """Split ``i``'s routed experts, eagerly (reads, fetches), into piece ``i + 1``'s input: with slot
        graphs, into the pair outputs it sums, those in slots by replays of the split's slot graph."""
        flat, ids, weights, residual, *_ = p.routes[i]
        if p.inside:
            runner, layer, experts = self._runners()[i]
            from_slots = partial(self._from_slots, p, i, graphed=graphed)
            runner.finish_layer(experts, layer, flat, ids, weights, p.pairs[i][:-1], from_slots)
            return
        out = _experts_with_residual(self.lean.layers[self.splits[i]].mlp.experts, flat, ids, weights, residual)
        if graphed:  # into the buffer the next piece's graph reads
            p.moe[i].copy_(out)
        elif len(p.moe) > i:
            p.moe[i] = out
        else:
            p.moe.append(out)

    def _from_slots(self, p: _Pieces, i: int, plan: np.ndarray, graphed: bool) -> None:
        """Split ``i``'s pairs that ``plan`` names (a padded ``PairOutputs.plan``) into its pair outputs:
        the plan copied into the buffer the slot graph reads (one host-to-device copy, no sync), then
        the graph replayed (stood in for, or run)."""
        host = torch.from_numpy(plan)
        p.plans[i].copy_(host.pin_memory() if p.plans[i].is_cuda else host, non_blocking=True)
        if graphed:
            p.slot_graphs[i].replay()
        elif self.stands_in and p.calls >= CAPTURE_AFTER:
            with replay():
                self._slot_pass(p, i)
        else:
            self._slot_pass(p, i)

    def _slot_pass(self, p: _Pieces, i: int) -> None:
        """Split ``i``'s slot graph: the pairs its plan names, from their slots."""
        runner, _, experts = self._runners()[i]
        runner.planned_pairs(experts, p.routes[i][0], p.plans[i], p.pairs[i])

    def _capture(self, p: _Pieces) -> None:
        """Warm up on a side stream (kernel choices, workspaces, lazily made buffers), then capture
        every piece into one memory pool, in the order they replay.

        The warm-up writes keys and values at the positions the step writes anyway, so nothing held
        is touched; its experts' inputs are whatever the buffers hold (their output is not used).
        Capturing is thread-local: the link's thread goes on copying meanwhile. ``torch.cuda.graph``'s
        own entry (a device sync, a garbage collection, emptying the cache) is skipped: a capture
        per token count would cost more than the steps it saves."""
        p.graphs, p.slot_graphs = [], []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(side):
            self._warm(p)
            for i in range(len(self.splits) + 1 if p.slots is None else 1):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self._whole_pass(p) if p.slots is not None else self._piece(p, i)
                finally:
                    graph.capture_end()
                p.graphs.append(graph)
                if p.inside and i < len(self.splits):  # the split's slot graph replays between pieces
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        self._slot_pass(p, i)
                    finally:
                        graph.capture_end()
                    p.slot_graphs.append(graph)
        torch.cuda.current_stream().wait_stream(side)
        p.routing = [f.routing for f in self.lean.fused]
        p.version = self.cache.version
        self.captures += 1
        log.info("%d tokens' step captured as %d CUDA graphs (cache capacity %d)", p.ids.shape[1], len(p.graphs),
                 self.cache.capacity)
