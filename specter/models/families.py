"""The family table: how each supported MoE architecture names its routed experts on disk.

transformers 5 fuses every family's experts in memory (``mlp.experts.gate_up_proj`` of shape
``(E, 2I, H)`` and ``mlp.experts.down_proj`` of shape ``(E, H, I)``), but checkpoints on disk keep
one tensor per expert and projection (or, for some exporters, one 3D tensor per projection).
Specter never builds the fused tensors: it reads each expert straight into its own host blob,
so it needs to know the disk names, and the renames transformers applies to dense keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Disk naming facts of one model family.

    Attributes:
        model_type: the ``model_type`` in config.json.
        disk_moe: the MoE block's module name on disk (``mlp`` or ``block_sparse_moe``).
        proj_names: on-disk names of the (gate, up, down) projections of one expert.
        dense_renames: (regex, replacement) pairs turning dense disk keys into in-memory names.
    """

    model_type: str
    disk_moe: str
    proj_names: tuple[str, str, str]
    dense_renames: tuple[tuple[str, str], ...] = ()

    def expert_keys(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Per-expert disk keys of (gate, up, down) for one (layer, expert)."""
        base = f"model.layers.{layer}.{self.disk_moe}.experts.{expert}"
        return tuple(f"{base}.{name}.weight" for name in self.proj_names)  # type: ignore[return-value]

    def fused_keys(self, layer: int) -> tuple[str, str]:
        """Disk keys of the 3D (gate_up, down) tensors, for checkpoints that store experts fused."""
        base = f"model.layers.{layer}.{self.disk_moe}.experts"
        return f"{base}.gate_up_proj", f"{base}.down_proj"

    def is_expert_key(self, key: str) -> bool:
        """Whether a disk key belongs to a routed expert (per-expert or fused form)."""
        return bool(_EXPERT_KEY.search(key))

    def memory_name(self, key: str) -> str:
        """The in-memory parameter name of a dense disk key."""
        for pattern, replacement in self.dense_renames:
            key = re.sub(pattern, replacement, key)
        return key


_EXPERT_KEY = re.compile(r"\.experts\.(\d+\.|gate_up_proj$|down_proj$|gate_up_proj\.|down_proj\.)")

_PER_EXPERT_GUD = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT_W = ("w1", "w3", "w2")

FAMILIES: dict[str, Family] = {
    "mixtral": Family("mixtral", "block_sparse_moe", _PER_EXPERT_W, ((r"\.block_sparse_moe\.", ".mlp."),)),
    "phimoe": Family(
        "phimoe",
        "block_sparse_moe",
        _PER_EXPERT_W,
        ((r"\.block_sparse_moe\.", ".mlp."), (r"\.mlp\.gate\.weight$", ".mlp.router.weight")),
    ),
    "qwen2_moe": Family("qwen2_moe", "mlp", _PER_EXPERT_GUD),
    "qwen3_moe": Family("qwen3_moe", "mlp", _PER_EXPERT_GUD),
    "olmoe": Family("olmoe", "mlp", _PER_EXPERT_GUD),
    "deepseek_v2": Family("deepseek_v2", "mlp", _PER_EXPERT_GUD),
    "deepseek_v3": Family("deepseek_v3", "mlp", _PER_EXPERT_GUD),
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's model_type is not one Specter knows how to offload."""


def family_for(model_type: str | None) -> Family:
    """Look up a family, or raise an error naming the type and the supported list."""
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedArchitectureError(
            f"unsupported architecture model_type={model_type!r}; Specter supports: {supported}"
        )
    return FAMILIES[model_type]
