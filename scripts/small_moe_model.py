"""The small MoE models themselves: each shipped model's recipe, its transformers config (Mixtral or
Qwen2-MoE) for a tokenizer, a fresh model from it, and the bf16 checkpoint saved next to the tokenizer.

Used by ``scripts/train_small_moe.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from small_moe_corpus import EOT
from transformers import (
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)


@dataclass(frozen=True)
class Recipe:
    """Architecture and optimisation settings of one shipped model."""

    name: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    balance_coef: float
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


RECIPES: dict[str, Recipe] = {
    "coarse": Recipe(
        name="coarse", steps=800, batch_size=4, seq_len=256, lr=3e-3, warmup=50, balance_coef=0.05
    ),
    "fine": Recipe(name="fine", steps=900, batch_size=4, seq_len=256, lr=3e-3, warmup=50, balance_coef=0.2),
}


def build_config(kind: str, tok: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model config of ``kind`` ("coarse" or "fine") for this tokenizer."""
    eot = tok.convert_tokens_to_ids(EOT)
    common = {
        "vocab_size": len(tok),
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "output_router_logits": False,  # the balance loss is added by this script, per layer
    }
    if kind == "coarse":
        return MixtralConfig(
            num_hidden_layers=4,
            intermediate_size=512,
            num_local_experts=8,
            num_experts_per_tok=2,
            **common,
        )
    if kind == "fine":
        return Qwen2MoeConfig(
            num_hidden_layers=4,
            intermediate_size=512,  # unused: every layer is sparse (decoder_sparse_step=1)
            moe_intermediate_size=64,
            shared_expert_intermediate_size=256,
            num_experts=64,
            num_experts_per_tok=4,
            norm_topk_prob=True,  # top-k weights sum to 1 (as Qwen3-MoE); with raw probs experts learn ~E/k x slower
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    raise ValueError(f"unknown model kind {kind!r}; expected 'coarse' or 'fine'")


def build_model(config: PretrainedConfig) -> PreTrainedModel:
    """A freshly initialised fp32 model for ``config`` (seed set by the caller)."""
    cls = MixtralForCausalLM if config.model_type == "mixtral" else Qwen2MoeForCausalLM
    model = cls(config)
    model.config.use_cache = False
    return model.float()


def moe_shape(config: PretrainedConfig) -> tuple[int, int]:
    """(number of routed experts, top-k) for a Mixtral or Qwen2-MoE config."""
    experts = config.num_local_experts if config.model_type == "mixtral" else config.num_experts
    return int(experts), int(config.num_experts_per_tok)


def save_model(model: PreTrainedModel, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Cast to bf16 and save weights, config, generation config and tokenizer into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.use_cache = True
    eot = tok.convert_tokens_to_ids(EOT)
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False, max_new_tokens=128
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for path in out.iterdir():  # safetensors writes 0600; the files ship inside the package
        if path.is_file():
            path.chmod(0o644)
