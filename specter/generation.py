"""Plain autoregressive generation on the offloaded target (no speculation): one token a step.

A convenience over ``Engine(target)`` (a window of 0), which is where the decode loop and the
per-request statistics live.
"""

from __future__ import annotations

import torch

from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.engine import Engine
from specter.models.loader import build_dense
from specter.stats import RequestStats
from specter.target import OffloadedTarget


def generate(
    target: OffloadedTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | None = None,
) -> tuple[list[int], RequestStats]:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; returns the new ids and stats."""
    return Engine(target).generate(prompt_ids, max_new_tokens, sampling, eos_token_id)


def resident_step_s(model: str, prompt: list[int], tokens: int = 24) -> tuple[float, int]:
    """This machine's all-resident decode step time, and bytes one token's experts take if all miss."""
    target = OffloadedTarget.load(model, SlotConfig(fraction=1.0), LinkConfig(bandwidth=1e15, latency=0.0))
    try:
        Engine(target).generate_fresh(prompt, 4)  # warm-up
        _, stats = Engine(target).generate_fresh(prompt, tokens)
        loaded = target.loaded
        per_token = len(loaded.moe_layers) * loaded.top_k * loaded.shape.nbytes
    finally:
        target.close()
    return stats.tpot_s, per_token


def bytes_per_token(model: str) -> int:
    """Bytes one token's experts take if all miss, at the CPU compute dtype (fp32)."""
    loaded = build_dense(model, torch.float32)
    return len(loaded.moe_layers) * loaded.top_k * loaded.shape.nbytes
