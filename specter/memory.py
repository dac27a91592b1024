"""The device memory plan: dense parts, the draft, KV caches and buffers first; slots get the rest."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from specter.models.loader import LoadedModel

_MARGIN = 0.05  # allocator slack and fragmentation


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per use of the device; ``slots`` is how many expert blobs fit in what is left."""

    device: int
    dense: int
    draft: int
    kv: int
    buffers: int
    margin: int
    expert: int
    slots: int

    @property
    def slot_bytes(self) -> int:
        return self.slots * self.expert

    def describe(self) -> str:
        rows = [("target dense parts", self.dense), ("draft", self.draft), ("KV caches", self.kv),
                ("working buffers", self.buffers), ("margin", self.margin),
                (f"expert slots ({self.slots} x {self.expert / 2**20:.2f} MiB)", self.slot_bytes)]
        lines = [f"memory plan for {human_bytes(self.device)} of device memory:"]
        lines += [f"  {name:<40s} {size / 2**20:10.1f} MiB" for name, size in rows]
        return "\n".join(lines)


def human_bytes(n: int) -> str:
    """1536 → '1.5 KiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def kv_bytes_per_token(config: PretrainedConfig, itemsize: int) -> int:
    """Key + value bytes one position costs across all layers (MLA caches its latent)."""
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):  # DeepSeek MLA: transformers caches the compressed latent
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_layer = 2 * heads * head_dim
    return layers * per_layer * itemsize


def plan_memory(
    device_bytes: int, loaded: LoadedModel, draft_bytes: int = 0, max_context: int = 2048, window: int = 0,
    top_k: int | None = None,
) -> MemoryPlan:
    """Place everything but the slots, then size the slot pool with what is left.

    Raises:
        ValueError: when the fixed parts (or the minimum of one layer's top-k slots) do not fit,
            saying by how much.
    """
    config = loaded.config
    itemsize = loaded.shape.dtype.itemsize
    kv = kv_bytes_per_token(config, itemsize) * max_context * (2 if draft_bytes else 1)
    positions = window + 1
    buffers = positions * (config.vocab_size * 4 + 8 * config.hidden_size * itemsize) * 2
    margin = int(device_bytes * _MARGIN)
    fixed = loaded.dense_bytes + draft_bytes + kv + buffers + margin
    need = top_k or loaded.top_k
    slots = (device_bytes - fixed) // loaded.shape.nbytes
    if slots < need:
        short = fixed + need * loaded.shape.nbytes - device_bytes
        raise ValueError(
            f"device-memory: {human_bytes(device_bytes)} does not fit the target's dense parts, the draft, "
            f"the KV caches and {need} expert slots; short by {human_bytes(short)}"
        )
    slots = min(slots, len(loaded.moe_layers) * loaded.num_experts)
    return MemoryPlan(device_bytes, loaded.dense_bytes, draft_bytes, kv, buffers, margin, loaded.shape.nbytes, slots)
