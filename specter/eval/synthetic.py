"""Synthetic checkpoints at real models' expert shapes: random weights, a few layers, a knob for how
often a draft agrees.

A real MoE cannot be downloaded here and does not fit a lent device's carry, so the GPU bench and
the as-built clock's validation build their models: Qwen1.5-MoE-A2.7B's or Mixtral-8x7B's layer
shapes (hidden size, routed and shared experts, top-k, heads) with ``layers`` layers and a small
vocabulary, initialized as transformers initializes them (normal, std 0.02), and saved as a
Hugging Face checkpoint that the engine loads like any other.

How often an int4 draft of such a model agrees with it is set by ``gain``, which scales every
weight of the decoder layers (not the embeddings, the norms or the head). At small gains the
residual stream is led by the token embedding — the layers add little to it — so the routers and
the head see mostly the current token, and a draft whose experts are a little off routes and
predicts as the target does; at larger gains the experts drive the stream and the draft's
rounding decides more tokens. Measured on CPU copies shrunk 8× (Qwen) and 16× (Mixtral), an RTN
draft, K 8, budget 25 %: Qwen gain 3 accepts ~90 % of a window, 4 ~55 %, 20 ~12 %; Mixtral gain
10 ~3 % (``scripts/validate_dispatch.py`` uses these to match the acceptance of the H200 runs;
the bench reports acceptance next to every figure). ``shrink`` divides the hidden and
intermediate sizes (heads keep their count) for a CPU: routing statistics depend on the expert
count and top-k, not on the sizes.

This module imports only torch and transformers: ``scripts/validate_dispatch.py`` loads it by path
into an older checkout of the project.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The real models' shapes (their config.json on the Hub; num_hidden_layers set by the caller).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen1.5-moe": dict(model_type="qwen2_moe", hidden_size=2048, moe_intermediate_size=1408,
                        shared_expert_intermediate_size=5632, intermediate_size=5632, num_experts=60,
                        num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=16,
                        norm_topk_prob=False, qkv_bias=True),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                         num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8),
}
_SIZES = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size")


def synthetic_config(shape: str, layers: int, vocab: int = 4096, shrink: int = 1) -> Any:
    """The transformers config of ``shape`` with ``layers`` layers (sizes divided by ``shrink``)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")
    if layers < 1 or vocab < 2 or shrink < 1:
        raise ValueError(f"layers, vocab, shrink: expected >= 1, >= 2, >= 1, got {layers}, {vocab}, {shrink}")
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    heads = fields["num_attention_heads"]
    for name in _SIZES:
        if name in fields:
            fields[name] //= shrink
    if fields["hidden_size"] % heads:
        raise ValueError(f"shrink: hidden size {fields['hidden_size']} must stay a multiple of {heads} heads")
    extra: dict[str, Any] = {"mlp_only_layers": []} if model_type == "qwen2_moe" else {}
    return AutoConfig.for_model(model_type, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False,
                                max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                                pad_token_id=None, **extra, **fields)


def build_synthetic(
    shape: str, folder: str | Path, layers: int = 4, gain: float = 1.0, vocab: int = 4096, shrink: int = 1,
    seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
) -> Path:
    """Build and save a synthetic checkpoint of ``shape`` in ``folder`` (see the module's docstring)."""
    from transformers import AutoModelForCausalLM

    if not gain > 0:
        raise ValueError(f"gain: expected a positive scale of the layers' weights, got {gain}")
    config = synthetic_config(shape, layers, vocab, shrink)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.model.layers.named_parameters():
            if "norm" not in name:
                param.mul_(gain)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def build_held_out(folder: str | Path, layers: int = 4) -> Path:
    """The held-out model the dispatch counts are taken on (``scripts/dispatch_count.py``, the tests):
    a seeded Qwen2-MoE of 4 MoE layers x 32 experts, top-4, with a shared expert, used to tune
    nothing; its weights wide enough that routing margins are clear (as ``tests/tiny_models.py``'s).
    ``layers``: the same model that many layers deep (how a count grows with depth)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=32, num_experts_per_tok=4, mlp_only_layers=[],
                            max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2 if "experts" in name or "gate" in name else 0.08)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder
