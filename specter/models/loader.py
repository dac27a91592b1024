"""Build a target from a Hugging Face MoE checkpoint without ever holding its experts twice.

Dense parts (embeddings, attention, norms, routers, shared experts, lm_head) go through the
transformers model class: the model is built with empty (meta) parameters, then each dense
tensor is read from disk and assigned. The fused ``experts.gate_up_proj``/``down_proj``
parameters are dropped unmaterialized; routed experts are streamed one at a time into an
``ExpertStore``, and transformers' ``ExpertsInterface`` hook sends every MoE layer to Specter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations.moe import ExpertsInterface

from specter.experts.store import ExpertShape, ExpertStore
from specter.models.checkpoint import Checkpoint, CheckpointError, read_config_dict, resolve_model_dir
from specter.models.families import Family, family_for
from specter.models.layout import config_dtype

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATION = "specter"


def _specter_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``ExpertsInterface`` entry point: hand the layer to the target's offloaded experts."""
    runner = self.__dict__.get("_specter_runner")
    if runner is None:
        raise RuntimeError("a Specter experts module was called before its target was attached")
    return runner.forward(self, self.__dict__["_specter_layer"], hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _specter_experts_forward)


@dataclass
class LoadedModel:
    """A dense-loaded transformers model plus where its routed experts are."""

    model: PreTrainedModel
    config: PretrainedConfig
    family: Family
    checkpoint: Checkpoint
    moe_layers: list[int]
    experts_modules: dict[int, torch.nn.Module]
    num_experts: int
    top_k: int
    shape: ExpertShape
    dense_bytes: int


def load_config(
    model_dir: str | Path, checkpoint: Checkpoint | None = None
) -> tuple[Checkpoint, PretrainedConfig, Family]:
    """Open the checkpoint (unless given, already open) and its config, rejecting unsupported
    architectures up front."""
    model_dir = resolve_model_dir(model_dir)
    family = family_for(read_config_dict(model_dir).get("model_type"))
    checkpoint = checkpoint or Checkpoint(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(checkpoint.dir))
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise CheckpointError(f"{checkpoint.dir}/config.json cannot be read as a {family.model_type} config: {exc}") from exc
    return checkpoint, config, family


def build_dense(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    replace: dict[str, torch.Tensor] | None = None,
    skip: frozenset[str] = frozenset(),
    checkpoint: Checkpoint | None = None,
) -> LoadedModel:
    """The transformers model with every dense tensor loaded and no routed expert materialized.

    ``replace``: disk key → tensor read instead of the checkpoint (a quantized checkpoint's dense
    modules, dequantized: ``<module>.weight``); ``skip``: disk keys not to read (their packed parts);
    ``checkpoint``: ``model_dir``'s checkpoint when the caller has it open already. (The experts' layout
    alone, without transformers: ``specter/models/layout.py``.)
    """
    checkpoint, config, family = load_config(model_dir, checkpoint)
    dtype = dtype or config_dtype(checkpoint.config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=EXPERTS_IMPLEMENTATION)
    experts = _experts_modules(model)
    if not experts:
        raise CheckpointError(f"{checkpoint.dir}: the {family.model_type} model built from it has no MoE layers")
    first: Any = next(iter(experts.values()))
    num_experts, two_i, hidden = first.gate_up_proj.shape
    shape = ExpertShape(hidden=hidden, intermediate=two_i // 2, dtype=dtype)
    for module in experts.values():
        _drop_fused(module)
    dense_bytes = _load_dense(model, checkpoint, family, replace or {}, skip)
    model.eval()
    top_k = int(config.num_experts_per_tok)
    return LoadedModel(
        model, config, family, checkpoint, sorted(experts), experts, num_experts, top_k, shape, dense_bytes
    )


def load_store(
    loaded: LoadedModel, pin: bool = False, progress: bool = False, arena: torch.Tensor | None = None
) -> ExpertStore:
    """Stream every routed expert of the checkpoint into a new host store (in ``arena`` if given)."""
    store = ExpertStore(loaded.moe_layers, loaded.num_experts, loaded.shape, pin=pin, arena=arena)
    store.load(loaded.checkpoint, loaded.family, progress=progress)
    return store


def _experts_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index → the layer's routed-experts module (only MoE layers have one)."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[-1] == "experts" and hasattr(module, "gate_up_proj") and "layers" in parts:
            layer = int(parts[parts.index("layers") + 1])
            module.__dict__["_specter_layer"] = layer
            found[layer] = module
    return found


def _drop_fused(module: torch.nn.Module) -> None:
    """Remove the never-materialized fused expert parameters; Specter's slots replace them."""
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if name in module._parameters:
            del module._parameters[name]


def _load_dense(
    model: PreTrainedModel,
    checkpoint: Checkpoint,
    family: Family,
    replace: dict[str, torch.Tensor],
    skip: frozenset[str],
) -> int:
    """Read every dense tensor into the model; error on any missing one or one of the wrong shape, and
    warn once about those the model has no parameter for."""
    expected: dict[str, torch.Tensor] = dict(model.named_parameters())
    expected.update({n: b for n, b in model.named_buffers() if n in model.state_dict()})
    state: dict[str, torch.Tensor] = {}
    ignored: list[str] = []  # on disk, not in the model (DeepSeek-V3's multi-token-prediction layer)
    nbytes = 0
    for key in sorted(set(checkpoint.entries) - skip | set(replace)):
        if family.is_expert_key(key):
            continue
        name = family.memory_name(key)
        if name not in expected:
            ignored.append(key)
            continue
        tensor = replace[key] if key in replace else checkpoint.read(key)
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}"
            )
        state[name] = tensor.to(expected[name].dtype)
        nbytes += state[name].numel() * state[name].element_size()
    if ignored:
        log.warning("ignoring %d tensor(s) of the checkpoint the model has no parameter for: %s%s", len(ignored),
                    ", ".join(ignored[:3]), ", …" if len(ignored) > 3 else "")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    still_empty = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_empty:
        raise CheckpointError(f"tensor(s) missing from the checkpoint in {checkpoint.dir}: {still_empty[:5]}")
    return nbytes
