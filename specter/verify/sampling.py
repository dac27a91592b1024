"""Turning logits into a token distribution: temperature, then top-k, then top-p.

Speculative acceptance applies exactly the same warping to the target's and the draft's logits,
so both live here.
"""

from __future__ import annotations

import torch

from specter.config import SamplingConfig


def probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Warped probabilities over the vocabulary for each row of ``logits`` (fp32)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """The next token from one row of logits: argmax when greedy, else a sample."""
    if sampling.greedy:
        return int(torch.argmax(logits, dim=-1))
    probs = probabilities(logits, sampling)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
