"""The offloaded target: a transformers model whose routed experts live in a host store and
reach the device through a limited pool of slots."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase

from specter.config import LinkConfig, SlotConfig
from specter.experts.executor import OffloadedExperts
from specter.experts.link import CudaLink, Link, SimulatedLink
from specter.experts.slots import SlotPool
from specter.experts.virtual_link import VirtualLink
from specter.memory import MemoryPlan, plan_memory
from specter.models.decode import LEAN_FAMILIES, LeanStep
from specter.models.graphed import GraphedStep, StaticKV, resolve_step
from specter.models.loader import LoadedModel, build_dense, load_store
from specter.plan import make_policy
from specter.plan.base import Policy
from specter.timing.clock import VirtualClock, WallClock
from specter.timing.dispatch import drop_deferred

log = logging.getLogger(__name__)


class OffloadedTarget:
    """The target model: dense parts on the device, routed experts behind the slot pool."""

    def __init__(self, loaded: LoadedModel, offload: OffloadedExperts, device: torch.device, step: str = "auto"):
        self.loaded = loaded
        self.model = loaded.model
        self.offload = offload
        self.device = device
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.memory_plan: MemoryPlan | None = None
        # Decode steps and verify passes after the prompt: fewer ops, same arithmetic (models/decode.py).
        self.lean = LeanStep.for_model(self.model, loaded.family.model_type, fused=True)
        for module in loaded.experts_modules.values():
            module.__dict__["_specter_runner"] = offload
        offload.policy.attach_model(self.model)
        fused = self.lean.fused if self.lean is not None else None
        static_ok = fused is not None and all(f.projection is not None for f in fused if f.routed)
        self.step_mode = resolve_step(step, device, None if static_ok else (
            f"the fused lean step of a supported family without router biases; this target is "
            f"{loaded.family.model_type}"))
        self.graphed: GraphedStep | None = None
        if self.step_mode != "eager":
            self.graphed = GraphedStep(self.lean, StaticKV.for_model(self.model), self.step_mode == "graph", split=True)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        budget: SlotConfig | None,
        link: LinkConfig | Link,
        policy: str | Policy = "demand-lru",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        timeout: float = 60.0,
        memory: MemoryRequest | None = None,
        clock: WallClock | None = None,
        step: str = "auto",
    ) -> OffloadedTarget:
        """Load a checkpoint folder into an offloaded target.

        Args:
            model_dir: a Hugging Face checkpoint folder (or HF cache folder).
            budget: the device's expert budget; None to size it from ``memory``.
            link: how experts move (a config, or a ready link to share).
            policy: a policy name or instance.
            device: ``cuda``/``cpu``; default cuda when available.
            dtype: compute dtype; default fp32 on a CPU (see below), the checkpoint's on a GPU.
            timeout: seconds before a transfer that never lands is an error.
            memory: device memory to plan (used when ``budget`` is None).
            clock: the run's clock (``specter/timing/clock.py``); a virtual one gets a virtual link.
            step: how steps after the prompt run (``models/graphed.py``): ``graph`` (the dense parts
                between expert calls as CUDA graphs over a fixed-capacity KV cache), ``static`` (the
                same pieces eagerly), ``eager`` (the lean step over a ``DynamicCache``), ``auto``
                (``graph`` on CUDA where the family allows, else ``eager``).
        """
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        policy = make_policy(policy) if isinstance(policy, str) else policy
        if dtype is None and device.type == "cpu":
            # In bf16 the one-pass verify of K+1 positions and one-token decoding round differently,
            # and near-tied argmaxes flip; in fp32 they agree, so speculation stays token-identical.
            dtype = torch.float32
        loaded = build_dense(model_dir, dtype)
        plan = None
        if budget is None:
            plan = _plan(memory or MemoryRequest(), loaded, device)
            budget = SlotConfig(experts=plan.slots)
        groups = slot_groups(budget, loaded)
        pin = device.type == "cuda"
        store = load_store(loaded, pin=pin)
        loaded.model.to(device)  # type: ignore[arg-type]  # transformers' stub types .to oddly
        pool = SlotPool(loaded.shape, groups, device)
        clock = clock or WallClock()
        if isinstance(link, LinkConfig):
            link = _make_link(link, device, clock)
        offload = OffloadedExperts(store, pool, link, policy, timeout=timeout, clock=clock)
        offload.prefill_slots()
        target = cls(loaded, offload, device, step)
        target.memory_plan = plan
        target.tokenizer = load_tokenizer(loaded.checkpoint.dir)
        log.info(
            "target %s: %d MoE layers x %d experts (%.1f MB each), %d slots (%s), link %s",
            loaded.family.model_type, len(loaded.moe_layers), loaded.num_experts, loaded.shape.nbytes / 1e6,
            pool.num_slots, budget.describe(), getattr(link, "describe", lambda: link.name)(),
        )
        return target

    @property
    def link(self) -> Link:
        return self.offload.link

    @property
    def clock(self) -> WallClock:
        return self.offload.clock

    def new_cache(self, batched: bool = False) -> DynamicCache | StaticKV:
        """An empty KV cache: the static one the graphed step writes (one sequence at a time), or a new
        ``DynamicCache`` (always when ``batched``: one of several sequences stepped together)."""
        if self.graphed is not None and not batched:
            self.graphed.cache.reset()
            return self.graphed.cache
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache | StaticKV) -> torch.Tensor:
        """Logits (fp32) for ``input_ids`` (1, T) continuing ``cache``."""
        self.offload.context = cache.get_seq_length()
        input_ids = input_ids.to(self.device)
        if isinstance(cache, StaticKV):
            if self.graphed is None:
                raise ValueError("cache: a static cache, but this target's steps are eager (new_cache() gives its own)")
            return self.graphed.forward(input_ids, cache).float()
        if self.lean is not None and self.lean.takes(input_ids, cache):
            return self.lean(input_ids, cache).float()
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True)
        return out.logits.float()

    @torch.inference_mode()
    def forward_batch(self, inputs: list[torch.Tensor], caches: list[DynamicCache]) -> list[torch.Tensor]:
        """Logits (fp32) of several sequences in one step (``LeanStep.batch``): ``inputs[i]`` (1, T_i)
        continuing ``caches[i]`` (a ``DynamicCache`` each, past its prompt). The MoE layers run once
        over all their positions (the union of their experts), attention per sequence."""
        if self.lean is None or self.lean.fused is None:
            raise ValueError(f"a batched step needs the lean step of {', '.join(sorted(LEAN_FAMILIES))}; this "
                             f"target is {self.loaded.family.model_type}")
        if any(isinstance(cache, StaticKV) for cache in caches):
            raise ValueError("caches: a batched step takes a DynamicCache per sequence (new_cache(batched=True))")
        self.offload.context = sum(cache.get_seq_length() for cache in caches)  # the KV the step reads
        logits = self.lean.batch([ids.to(self.device) for ids in inputs], caches)
        return [x.float() for x in logits]

    def close(self) -> None:
        drop_deferred()  # a resident layer's routing not read yet: nobody waits for it now
        self.offload.link.close()


def crop_cache(cache: DynamicCache | StaticKV, length: int) -> None:
    """Cut the KV cache back to its first ``length`` positions (speculation rolls back with it)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if extra:
        cache.crop(-extra)


@dataclass(frozen=True)
class MemoryRequest:
    """What to plan device memory for: its size (None: the GPU's free memory, measured with the draft
    of ``draft_bytes`` loaded already) and the rest."""

    device_bytes: int | None = None
    draft_bytes: int = 0
    max_context: int = 2048
    window: int = 0


def _plan(request: MemoryRequest, loaded: LoadedModel, device: torch.device) -> MemoryPlan:
    size = request.device_bytes
    if size is None:
        if device.type != "cuda":
            raise ValueError("device-memory: give --budget or --device-memory on a CPU (no GPU to measure)")
        # the draft is on the device already (loaded first): its bytes are gone from the free memory
        size = torch.cuda.mem_get_info(device)[0] + request.draft_bytes
    return plan_memory(size, loaded, request.draft_bytes, request.max_context, request.window)


def slot_groups(budget: SlotConfig, loaded: LoadedModel) -> dict[int, int]:
    """``budget``'s slot groups for ``loaded``'s experts (``SlotConfig.groups``)."""
    return budget.groups(loaded.moe_layers, loaded.num_experts, loaded.shape.nbytes, loaded.top_k)


def _make_link(config: LinkConfig, device: torch.device, clock: WallClock) -> Link:
    if config.kind == "cuda":
        if isinstance(clock, VirtualClock):
            raise ValueError("clock: a virtual clock runs a simulated link, not 'cuda'")
        if device.type != "cuda":
            raise ValueError("link: 'cuda' needs a CUDA device; use sim:GBPS on a CPU")
        return CudaLink(device)
    if isinstance(clock, VirtualClock):
        return VirtualLink(clock, config.bandwidth, config.latency)
    return SimulatedLink(config.bandwidth, config.latency)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
