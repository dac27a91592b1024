"""The draft at run time: the target's dense parts plus every routed expert resident in int4.

``DraftModel.load`` builds the transformers model with Specter's loader (dense tensors from the
draft folder, fused expert parameters never materialized), reads every packed expert, and hands
each MoE layer to ``DraftExperts`` through the loader's ``specter`` experts hook. Forward hooks on
the routers record, per step and MoE layer, the top-k expert ids and their router
probabilities: that routing is the draft's prediction of what the target will need.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from specter.draft.format.published import Scheme, UnsupportedDraftFormat, quantized_modules, scheme_for
from specter.draft.kernels import ExpertKernels, ExpertWeights, Int4Layer, choose_mode
from specter.experts.grouped import resident_experts
from specter.models.checkpoint import Checkpoint, CheckpointError, read_config_dict, resolve_model_dir
from specter.models.decode import LeanStep
from specter.models.families import family_for
from specter.models.graphed import GraphedStep, StaticKV, resolve_step
from specter.models.loader import LoadedModel, build_dense
from specter.models.routing import DraftCompute, Routing, read_routing, read_routing_rows, router_modules
from specter.timing.dispatch import host_read, once_per_step

log = logging.getLogger(__name__)


@dataclass
class DraftStep:
    """One draft forward: fp32 logits ``(1, T, V)`` and per MoE layer ``(ids (T, k), probs (T, k))``."""

    logits: torch.Tensor
    routing: Routing


class DraftExperts:
    """The experts runner of every draft MoE layer: all experts resident.

    Where a layer's experts are stacked (``dequant-cache``: ``ExpertKernels.stacked``) the layer is
    grouped calls over them with the pairs sorted on the device (``experts/grouped.py:
    resident_experts``): no read of device data, the same ops whatever the routing. In
    ``int4-kernel`` a step of a few tokens gathers its pairs' experts by their device-side ids
    (``ExpertKernels.gathered``: ``kernels.py: Int4Layer``), also without a read. Otherwise (the
    packed mode, a prompt in ``int4-kernel``) the routing is read once and each expert runs on a
    contiguous slice of rows, summed in ascending id order as transformers' loop does.
    """

    takes_rows = True  # ``forward`` takes one token's pair rows made by the caller (``_Fused.moe_input``)

    def __init__(self, kernels: ExpertKernels, grouped: bool = True):
        self.kernels = kernels
        self.grouped = grouped  # False: always the per-expert loop (bit for bit transformers' sums)

    def forward(
        self,
        module: Any,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        residual: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's k experts with the draft's quantized weights, weighted and summed (plus
        ``residual`` when given). ``rows``: one token's pair rows, made already (used by the stacked
        experts' grouped calls: ``grouped.resident_experts``)."""
        path = self.path(layer, top_k_index.numel())
        if path == "bf16-grouped":
            gate_up, down = self.kernels.stacked[layer]
            return resident_experts(hidden, top_k_index, top_k_weights, gate_up, down, module.act_fn, residual,
                                    rows=rows)
        if path == "int4-gathered":  # a step: no read
            return self.kernels.gathered[layer](hidden, top_k_index, top_k_weights, module.act_fn, residual)
        final = self._loop(module, layer, hidden, top_k_index, top_k_weights)
        return final if residual is None else residual + final

    def path(self, layer: int, pairs: int) -> str:
        """How ``layer``'s experts run for ``pairs`` routed (token, expert) pairs: ``bf16-grouped`` (the
        stacked dequantized experts), ``int4-gathered`` (``Int4Layer``), or the per-expert loop
        (``loop``)."""
        if self.grouped and layer in self.kernels.stacked:
            return "bf16-grouped"
        if self.grouped and layer in self.kernels.gathered and pairs <= Int4Layer.max_pairs:
            return "int4-gathered"
        return "loop"

    def compute(self, layer: int, pairs: int) -> str:
        """What the clock charges for that path (``timing/profiles.py: DRAFT_EXPERT_READS``): the loop
        computes each distinct expert once as the mode holds it."""
        path = self.path(layer, pairs)
        if path != "loop":
            return "bf16" if path == "bf16-grouped" else path
        return {"int4-kernel": "int4", "dequant-on-the-fly": "dequant"}.get(self.kernels.mode, "bf16")

    def _loop(
        self, module: Any, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        flat = top_k_index.T.flatten()  # (top-k position, token) order
        order = torch.argsort(flat, stable=True)
        rows = order % tokens
        ids = host_read(flat[order])  # the one read: which experts to call (sorted)
        runs = [(expert, len(list(run))) for expert, run in itertools.groupby(ids)]
        experts, sizes = [e for e, _ in runs], [n for _, n in runs]
        final = torch.zeros_like(hidden)
        for expert, part, at, weight in zip(
            experts, hidden[rows].split(sizes), rows.split(sizes),
            top_k_weights.T.flatten()[order, None].split(sizes), strict=True,
        ):  # one index_add_ per expert: bf16 sums round after each expert, as transformers' do
            final.index_add_(0, at, (self._expert(module, layer, expert, part) * weight).to(hidden.dtype))
        return final

    def _expert(self, module: Any, layer: int, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = self.kernels.gate_up((layer, expert), rows).chunk(2, dim=-1)
        return self.kernels.down((layer, expert), module.act_fn(gate) * up)


class DraftModel:
    """The AWQ draft: ``forward(input_ids, cache) -> logits`` and ``last_routing``.

    Attributes:
        model: the transformers model (dense parts on ``device``).
        kernels: the resident experts and their compute mode.
        mode: the compute mode in use (``int4-kernel`` | ``dequant-cache`` | ``dequant-on-the-fly``).
        timings: seconds per expert per mode measured by ``auto`` (empty when a mode was forced).
        packed_bytes: bytes of every expert in the packed format (what the device must hold).
        dense_bytes: bytes of the dense parts.
        last_routing: layer → (ids LongTensor (T, k), probs FloatTensor (T, k)) of the last forward, on
            the host: read from the device once per forward, all layers together.
        last_token: the argmax of the last forward's last position, read in the same read.
        last_compute: layer → how the last forward computed its experts (``DraftExperts.compute``:
            what the as-built clock charges).
    """

    def __init__(
        self, loaded: LoadedModel, kernels: ExpertKernels, device: torch.device, packed_bytes: int,
        lean: bool = True, fused: bool = True, grouped: bool = True, step: str = "auto",
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.kernels = kernels
        self.mode = kernels.mode
        self.device = device
        self.packed_bytes = packed_bytes
        self.dense_bytes = loaded.dense_bytes
        self.timings: dict[str, float] = {}
        self.last_routing: Routing = {}
        self.last_compute: DraftCompute = {}
        self._computes: dict[int, DraftCompute] = {}  # pairs per layer → ``last_compute`` (``_compute``)
        self.last_token: int | None = None  # the latest forward's last-position argmax, read with its routing
        self.last_tokens: list[int] | None = None  # a batched forward's: each sequence's
        self._routing: Routing = {}  # the forward running now's, on the device (the routers' hooks)
        self.runner = runner = DraftExperts(kernels, grouped)
        for module in loaded.experts_modules.values():
            module.__dict__["_specter_runner"] = runner
        self._hooks = [
            router.register_forward_hook(self._recorder(layer))
            for layer, router in router_modules(loaded.model).items()
        ]
        self.lean = LeanStep.for_model(loaded.model, loaded.family.model_type, fused) if lean else None
        no_read = kernels.mode == "dequant-cache" or (kernels.mode == "int4-kernel" and bool(kernels.gathered))
        static_ok = self.lean is not None and self.lean.fused is not None and no_read
        self.step_mode = resolve_step(step, device, None if static_ok else (
            f"the fused lean step of a supported family and its experts computed on the device without a read "
            f"(dequant-cache grouped, or int4-kernel gathered); this draft has mode "
            f"{kernels.mode!r}, lean step {'on' if self.lean else 'off'}"))
        self.graphed: GraphedStep | None = None
        if self.step_mode != "eager":
            assert self.lean is not None
            self.graphed = GraphedStep(self.lean, StaticKV.for_model(self.model), capture=self.step_mode == "graph")

    @classmethod
    def load(
        cls, draft_dir: str | Path, device: str | torch.device | None = None, mode: str = "auto",
        dtype: torch.dtype | None = None, lean: bool = True, fused: bool = True, grouped: bool = True,
        step: str = "auto",
    ) -> DraftModel:
        """Load a quantized draft: a folder written by ``specter quantize``, or a published int4
        checkpoint of the target (AutoAWQ GEMM, GPTQ, compressed-tensors; ``format.published``).

        Args:
            draft_dir: the draft folder (config.json with ``quantization_config``, safetensors).
            device: ``cpu``/``cuda``; default cuda when available.
            mode: ``auto`` | ``int4-kernel`` | ``dequant-cache`` | ``dequant-on-the-fly`` (``auto``: on a CPU
                the faster of the first two, timed; on a GPU the dequantized cache where it is small
                beside the free memory, else int4: ``kernels.device_mode``).
            dtype: compute dtype; default fp32 on a CPU, the checkpoint's on a GPU. The stored
                weights (int4 codes and their scales, bf16 dense parts) are the same either way,
                and fp32 holds each exactly; on a CPU bf16 matmuls cost more (a ``moe-fine-awq``
                decode step, one thread: 6.87 ms in bf16, 4.75 ms in fp32, ``docs/draft.md``).
            lean: take decode steps (not the prompt) through ``LeanStep`` (``models/decode.py``: the same
                operations without transformers' per-call machinery) where the family allows; False
                keeps transformers' forward for every step.
            fused: the lean step's fused projections (fewer ops, the same logits to rounding); False:
                bit for bit transformers' forward of the same experts runner.
            grouped: stacked experts in grouped calls (``DraftExperts``); False: one call per expert,
                summed as transformers' loop sums (bit for bit its, with ``fused=False``).
            step: how a step after the prompt runs (``models/graphed.py``): ``graph`` (a CUDA graph over
                a fixed-capacity KV cache), ``static`` (the same step eagerly: what a CPU can test),
                ``eager`` (the lean step over a ``DynamicCache``), ``auto`` (``graph`` on CUDA where
                the draft's experts are grouped and its step fused, else ``eager``).
        """
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None and device.type == "cpu":
            dtype = torch.float32
        config = read_config_dict(resolve_model_dir(draft_dir))
        qconfig = config.get("quantization_config")
        if not isinstance(qconfig, dict):
            raise CheckpointError(f"{draft_dir} is not a Specter draft: config.json has no quantization_config")
        try:
            scheme = scheme_for(qconfig)
        except UnsupportedDraftFormat as exc:
            raise CheckpointError(
                f"{draft_dir} cannot be read as a draft: {exc} (or use any full-precision checkpoint)"
            ) from None
        checkpoint = Checkpoint(draft_dir)
        family = family_for(config.get("model_type"))
        modules = quantized_modules(scheme, checkpoint.entries)
        dense = [m for m in modules if not family.is_expert_key(f"{m}.weight")]
        replace = {
            f"{m}.weight": scheme.read(m, checkpoint.read, checkpoint.entries.__contains__).dequantize()
            for m in dense
        }
        skip = frozenset(f"{m}.{part}" for m in modules for part in scheme.parts)
        loaded = build_dense(draft_dir, dtype, replace=replace, skip=skip, checkpoint=checkpoint)
        experts, packed_bytes = read_experts(loaded, scheme)
        timings: dict[str, float] = {}
        if mode == "auto":
            mode, timings = choose_mode(next(iter(experts.values())), loaded.shape.dtype, device, len(experts))
        kernels = ExpertKernels(experts, mode, loaded.shape.dtype, device)
        loaded.model.to(device)  # type: ignore[arg-type]  # transformers' stub types .to oddly
        draft = cls(loaded, kernels, device, packed_bytes, lean=lean, fused=fused, grouped=grouped, step=step)
        draft.timings = timings
        log.info(
            "draft %s: %s, experts %.2f MB packed, %.2f MB in compute form, dense %.2f MB",
            loaded.family.model_type,
            mode,
            packed_bytes / 1e6,
            kernels.nbytes / 1e6,
            draft.dense_bytes / 1e6,
        )
        return draft

    @property
    def device_bytes(self) -> int:
        """What the draft holds on its device: the dense parts and every expert in its compute form
        (``dequant-cache``: dequantized, several times the packed bytes; ``dequant-on-the-fly``: the
        packed words; ``int4-kernel``: the kernel's layout). The memory plan reserves this much."""
        return self.dense_bytes + self.kernels.nbytes

    def new_cache(self, batched: bool = False) -> DynamicCache | StaticKV:
        """An empty KV cache: the static one the graphed step writes (one sequence at a time), or a new
        ``DynamicCache`` (always when ``batched``: one of several sequences drafted together)."""
        if self.graphed is not None and not batched:
            self.graphed.cache.reset()
            return self.graphed.cache
        return DynamicCache(config=self.model.config)

    @staticmethod
    def crop(cache: DynamicCache | StaticKV, length: int) -> None:
        """Cut the KV cache back to its first ``length`` positions (a rejected draft suffix)."""
        extra = cache.get_seq_length() - length
        if extra < 0 or length < 0:
            raise ValueError(f"length: cannot crop a cache of {cache.get_seq_length()} positions to {length}")
        if extra:
            cache.crop(-extra)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache | StaticKV | None = None) -> torch.Tensor:
        """Logits (fp32, ``(1, T, V)``) for ``input_ids`` (1, T) continuing ``cache``; sets ``last_routing``."""
        self._routing = {}
        input_ids = input_ids.to(self.device)
        if isinstance(cache, StaticKV):
            logits = self._static_forward(input_ids, cache)
        elif self.lean is not None and self.lean.takes(input_ids, cache):
            logits = self.lean(input_ids, cache)  # type: ignore[arg-type]
            if self.lean.fused is not None:  # its routers ran inline, not through the hooks
                self._routing = self.lean.routing()
        else:
            logits = self.model(input_ids=input_ids, cache=cache, use_cache=cache is not None).logits
        with once_per_step:  # the routing and the last position's argmax (the greedy draft token) in one read
            self.last_routing, self.last_token = read_routing(self._routing, logits[0, -1])
            self.last_compute = self._compute()
            return logits.float()

    @property
    def batches(self) -> bool:
        """Whether ``forward_batch`` can run (the fused lean step of a supported family)."""
        return self.lean is not None and self.lean.fused is not None

    @torch.inference_mode()
    def forward_batch(self, inputs: list[list[int]], caches: list[DynamicCache]) -> list[torch.Tensor]:
        """Several sequences in one forward (``LeanStep.batch``): ``inputs[i]`` after ``caches[i]`` (each
        a ``new_cache(batched=True)`` holding that sequence's positions). Returns each one's logits
        (fp32, ``(1, T_i, V)``); ``last_routing`` holds every position's routing (the sequences' rows in
        order) and ``last_tokens`` each sequence's last-position argmax, all in one read."""
        if not self.batches:
            raise ValueError(f"draft {self.loaded.family.model_type}: a batched forward needs the fused lean step")
        if any(isinstance(cache, StaticKV) for cache in caches):
            raise ValueError("a batched draft forward takes new_cache(batched=True) caches, not the static one")
        assert self.lean is not None
        logits = self.lean.batch([torch.tensor([ids], device=self.device) for ids in inputs], caches)
        self._routing = self.lean.routing()
        self.last_routing, self.last_tokens = read_routing_rows(
            self._routing, torch.stack([row[0, -1] for row in logits]))
        self.last_token = None
        self.last_compute = self._compute()
        return [row.float() for row in logits]

    def _static_forward(self, input_ids: torch.Tensor, cache: StaticKV) -> torch.Tensor:
        """A forward over the static cache (``GraphedStep.forward``); a step's routing is the pieces'
        (the prompt's came through the routers' hooks)."""
        assert self.graphed is not None
        step = cache.length > 0
        logits = self.graphed.forward(input_ids, cache)
        if step:
            self._routing = self.graphed.routing
        return logits

    def _compute(self) -> DraftCompute:
        """How the forward just read computed each layer's experts: fixed for a loaded draft by its
        pairs (the routing's ids), so made once per pair count (a step's hot path looks it up)."""
        pairs = next(iter(self.last_routing.values()))[0].numel() if self.last_routing else 0
        if pairs not in self._computes:
            self._computes[pairs] = {layer: self.runner.compute(layer, pairs) for layer in self.last_routing}
        return self._computes[pairs]

    def step(self, input_ids: torch.Tensor, cache: DynamicCache | StaticKV | None = None) -> DraftStep:
        """One forward with its routing."""
        logits = self.forward(input_ids, cache)
        return DraftStep(logits, self.last_routing)

    def describe(self) -> str:
        return (
            f"draft {self.loaded.family.model_type} mode={self.mode} packed={self.packed_bytes / 1e6:.2f}MB "
            f"dense={self.dense_bytes / 1e6:.2f}MB"
        )

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _recorder(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            logits, _, indices = output
            ids = indices.reshape(-1, indices.shape[-1]).long()
            probs = torch.softmax(logits.reshape(ids.shape[0], -1).float(), dim=-1).gather(1, ids)
            self._routing[layer] = (ids, probs)

        return hook


def read_experts(
    loaded: LoadedModel, scheme: Scheme
) -> tuple[dict[tuple[int, int], ExpertWeights], int]:
    """Every quantized expert of the draft as quantized weights, and their packed byte count."""
    checkpoint: Checkpoint = loaded.checkpoint
    keys = checkpoint.entries
    experts: dict[tuple[int, int], ExpertWeights] = {}
    nbytes = 0
    for layer in loaded.moe_layers:
        for expert in range(loaded.num_experts):
            weights = []
            for key in loaded.family.expert_keys(layer, expert):
                module = key.removesuffix(".weight")
                if f"{module}.{scheme.main}" not in keys:
                    raise CheckpointError(
                        f"draft expert {module!r} is not quantized in {checkpoint.dir} (no {module}.{scheme.main}); "
                        f"a draft's routed experts are all quantized"
                    )
                weights.append(scheme.read(module, checkpoint.read, keys.__contains__))
                parts = (f"{module}.{suffix}" for suffix in scheme.parts)
                nbytes += sum(checkpoint.entries[k].nbytes for k in parts if k in keys)
            experts[(layer, expert)] = (weights[0], weights[1], weights[2])
    _check_shapes(loaded, experts)
    return experts, nbytes


def _check_shapes(loaded: LoadedModel, experts: dict[tuple[int, int], ExpertWeights]) -> None:
    hidden, inter = loaded.shape.hidden, loaded.shape.intermediate
    for key, (gate, up, down) in experts.items():
        if gate.shape != (inter, hidden) or up.shape != (inter, hidden) or down.shape != (hidden, inter):
            raise CheckpointError(
                f"draft expert {key} has shapes {gate.shape}, {up.shape}, {down.shape}; "
                f"the model expects ({inter}, {hidden}) and ({hidden}, {inter})"
            )
