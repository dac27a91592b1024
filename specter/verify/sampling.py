"""Turning logits into a token distribution: temperature, then top-k, then top-p.

Speculative acceptance applies exactly the same warping to the target's and the draft's logits,
so both live here.
"""

from __future__ import annotations

import torch

from specter.config import SamplingConfig
from specter.timing.dispatch import host_read


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
        return int(host_read(torch.argmax(logits, dim=-1)))
    probs = probabilities(logits, sampling)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def coupled_draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """A sample from ``probs`` (V,) that a sample of another distribution at the same ``seed`` and
    ``position`` equals as often as the two distributions allow.

    Gumbel-max with noise that depends only on (seed, position): ``argmax(log p + g)`` is an exact
    sample from ``p`` for any ``p``, and two distributions drawn with the same ``g`` agree with
    probability at least ``(1 - TV) / (1 + TV)`` (TV their total variation distance) — always when
    they are equal. The draft's guess of the target's next token and the target's own token after a
    fully accepted round are drawn so (``accept_sampled``'s ``bonus_draw``, ``LocalProposer.guess``):
    a pipelined round drafted on the guess then stands whenever the two draws agree, where drawn
    independently they agree only by chance.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) & (2**63 - 1))
    u = torch.rand(probs.shape[-1], generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(torch.log(probs.cpu().double()) + gumbel))
