"""Acceptance: which draft tokens the target keeps, and the token it adds.

Greedy: the longest prefix where the target's argmax equals the draft token, plus the target's
own argmax after it (the bonus/correction token). Sampling: standard speculative rejection
sampling (Leviathan et al. 2023; Chen et al. 2023), which leaves the output distributed exactly
as the target's own sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specter.timing.dispatch import host_read


def accept_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> tuple[int, int]:
    """``target_logits`` (K+1, V) at positions before each draft token and after the last.

    Returns (number of draft tokens accepted, the next token the target chooses).
    """
    choices = host_read(torch.argmax(target_logits, dim=-1))  # the pass's one read of its tokens
    n = 0
    while n < len(draft_tokens) and choices[n] == draft_tokens[n]:
        n += 1
    return n, int(choices[n])


def accept_sampled(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: list[int], generator: torch.Generator,
    bonus_draw: Callable[[torch.Tensor], int] | None = None,
) -> tuple[int, int]:
    """Speculative rejection sampling.

    Args:
        target_probs: (K+1, V) warped target distributions, one per draft position plus one.
        draft_probs: (K, V) the warped draft distributions each draft token was sampled from.
        draft_tokens: the K draft tokens.
        generator: the request's random generator (CPU).
        bonus_draw: draws the token after a fully accepted window from the target's last
            distribution (``sampling.coupled_draw``, so that it agrees with the draft's guess as
            often as it can); None: from ``generator``. Either is an exact sample of that
            distribution, drawn with randomness the acceptance tests do not use.

    Returns (number accepted, next token): the next token is resampled from the residual at the
    first rejection, or drawn from the target's last distribution when all are accepted.
    """
    p_all, q_all = target_probs.cpu().double(), draft_probs.cpu().double()
    for i, token in enumerate(draft_tokens):
        p, q = p_all[i, token], q_all[i, token]
        # Accept with probability min(1, p/q); u < p/q written without dividing by a tiny q.
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u * q < p:
            continue
        # Rejected: resample from the normalized residual max(p - q, 0).
        residual = torch.clamp(p_all[i] - q_all[i], min=0.0)
        total = residual.sum()
        dist = residual / total if total > 0 else p_all[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    last = p_all[len(draft_tokens)]
    if bonus_draw is not None:
        return len(draft_tokens), bonus_draw(last)
    return len(draft_tokens), int(torch.multinomial(last, 1, generator=generator))
