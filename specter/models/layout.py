"""Where a checkpoint's routed experts are, read from its tensor names and shapes alone.

The transfer process needs the experts' layout (which layers have routed experts, how many per
layer, their shape) to size the host store and the slots, and nothing else of the model: this reads
it from the safetensors headers and ``config.json`` without transformers (whose import and meta
model cost a Ray worker ~3.5 s of CPU at start-up). The verifier builds the same facts through
transformers' model (``loader.build_dense``) and compares both when it connects
(``ExpertLayout.facts``), so a checkpoint whose expert tensors disagree with its config fails there
with both layouts named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specter.experts.store import ExpertShape
from specter.models.checkpoint import Checkpoint, CheckpointError
from specter.models.families import Family, family_for


@dataclass(frozen=True)
class ExpertLayout:
    """The routed experts of a checkpoint: what the host store and the slots are sized by."""

    checkpoint: Checkpoint
    family: Family
    moe_layers: list[int]
    num_experts: int
    top_k: int
    shape: ExpertShape

    def facts(self) -> dict[str, Any]:
        """The layout as plain values (what two processes compare)."""
        return layout_facts(self.moe_layers, self.num_experts, self.top_k, self.shape)


def layout_facts(moe_layers: list[int], num_experts: int, top_k: int, shape: ExpertShape) -> dict[str, Any]:
    """Plain values of a layout, from an ``ExpertLayout`` or a ``LoadedModel``'s fields."""
    return {"moe_layers": list(moe_layers), "num_experts": num_experts, "top_k": top_k, "hidden": shape.hidden,
            "intermediate": shape.intermediate, "dtype": str(shape.dtype).removeprefix("torch.")}


def read_layout(model_dir: str | Path, dtype: torch.dtype | None = None,
                checkpoint: Checkpoint | None = None) -> ExpertLayout:
    """The layout of ``model_dir``'s routed experts; ``dtype`` None: the checkpoint's (as ``build_dense``).

    Raises:
        CheckpointError: no routed experts on disk, layers with different expert counts or shapes,
            or no ``num_experts_per_tok`` in config.json.
        UnsupportedArchitectureError: a ``model_type`` Specter does not know.
    """
    checkpoint = checkpoint or Checkpoint(model_dir)
    family = family_for(checkpoint.config.get("model_type"))
    projections = "|".join(family.proj_names)
    pattern = re.compile(rf"^model\.layers\.(\d+)\.{family.disk_moe}\.experts\."  # per expert, or fused
                         rf"(?:(\d+)\.({projections})\.weight|(gate_up_proj))$")
    depth = checkpoint.config.get("num_hidden_layers")
    experts: dict[int, set[int]] = {}
    shapes: dict[int, tuple[int, int]] = {}  # layer -> (hidden, intermediate)
    for key, entry in checkpoint.entries.items():
        found = pattern.match(key)
        if found is None:
            continue
        layer = int(found[1])
        if isinstance(depth, int) and layer >= depth:  # not the model's (DeepSeek-V3's MTP layer 61 on disk)
            continue
        if found[4]:  # fused: (E, 2I, H)
            if len(entry.shape) != 3:
                raise CheckpointError(f"tensor {key!r} in {entry.path} has shape {entry.shape}, expected (E, 2I, H)")
            experts.setdefault(layer, set()).update(range(entry.shape[0]))
            shapes[layer] = (entry.shape[2], entry.shape[1] // 2)
        else:
            experts.setdefault(layer, set()).add(int(found[2]))
            if found[3] == family.proj_names[0] and len(entry.shape) == 2:  # gate: (I, H)
                shapes[layer] = (entry.shape[1], entry.shape[0])
    if not experts:
        raise CheckpointError(f"{checkpoint.dir}: no routed expert tensors of a {family.model_type} model "
                              f"(model.layers.N.{family.disk_moe}.experts…)")
    layers = sorted(experts)
    counts = {layer: max(experts[layer]) + 1 for layer in layers}
    if len(set(counts.values())) != 1:
        raise CheckpointError(f"{checkpoint.dir}: MoE layers hold different expert counts {counts}")
    if len(set(shapes.values())) != 1 or set(shapes) != set(layers):
        raise CheckpointError(f"{checkpoint.dir}: the experts' (hidden, intermediate) differ between layers or "
                              f"a layer has no gate projection: {shapes}")
    top_k = checkpoint.config.get("num_experts_per_tok")
    if not isinstance(top_k, int) or top_k < 1:
        raise CheckpointError(f"{checkpoint.dir}/config.json: num_experts_per_tok must be a positive integer, "
                              f"got {top_k!r}")
    hidden, intermediate = shapes[layers[0]]
    shape = ExpertShape(hidden, intermediate, dtype or config_dtype(checkpoint.config))
    return ExpertLayout(checkpoint, family, layers, counts[layers[0]], top_k, shape)


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    """The checkpoint's dtype as config.json names it (``dtype`` or the older ``torch_dtype``); fp32 if none."""
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
