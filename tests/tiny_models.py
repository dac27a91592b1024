"""Tiny seeded models of every supported family, built from configs and saved as real checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

_COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_hidden_layers=3, eos_token_id=None,
               bos_token_id=None, pad_token_id=None, max_position_embeddings=256)
_DEEPSEEK = dict(intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)

CONFIGS: dict[str, PretrainedConfig] = {
    "mixtral": MixtralConfig(**_COMMON, intermediate_size=48, num_key_value_heads=2, num_local_experts=8,
                             num_experts_per_tok=2),
    "phimoe": PhimoeConfig(**_COMMON, intermediate_size=48, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2),
    "qwen2_moe": Qwen2MoeConfig(**_COMMON, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=2,
                                shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                mlp_only_layers=[0]),
    "qwen3_moe": Qwen3MoeConfig(**_COMMON, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=2,
                                num_experts=8, num_experts_per_tok=2, head_dim=8),
    "olmoe": OlmoeConfig(**_COMMON, intermediate_size=16, num_key_value_heads=2, num_experts=8,
                         num_experts_per_tok=2),
    "deepseek_v2": DeepseekV2Config(**_COMMON, **_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy"),
    "deepseek_v3": DeepseekV3Config(**_COMMON, **_DEEPSEEK, q_lora_rank=24),
}
FAMILIES = sorted(CONFIGS)


def save_tiny(family: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **save_kwargs) -> Path:
    """Build ``family``'s tiny model with ``seed`` and save it as a checkpoint in ``folder``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family], dtype=dtype)
    # Wider random weights give routers clear margins, so greedy paths are not decided by rounding.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and param.dim() >= 1:
                param.normal_(0.0, 0.2 if "experts" in name or "gate" in name else 0.08)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def noisy_copy(folder: Path, dst: Path, scale: float = 0.15, seed: int = 1) -> Path:
    """A draft that mostly agrees with the target: its weights with relative noise added."""
    shutil.copytree(folder, dst)
    torch.manual_seed(seed)
    tensors = load_file(str(dst / "model.safetensors"))
    noisy = {k: v + scale * v.std() * torch.randn_like(v) if v.dim() == 2 else v for k, v in tensors.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
