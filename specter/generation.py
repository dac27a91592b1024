"""Plain autoregressive generation on the offloaded target (no speculation): one token a step.

A convenience over ``Engine(target)`` (a window of 0), which is where the decode loop and the
per-request statistics live.
"""

from __future__ import annotations

from specter.config import SamplingConfig
from specter.engine import Engine
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
