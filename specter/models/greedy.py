"""A model's own greedy continuation: the reference that calibration and the fidelity measures share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def greedy_continuation(model: Any, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """The target's own greedy continuation of ``prompt`` (exactly ``new_tokens`` tokens, EOS ignored)."""
    out = model.generate(
        torch.tensor([list(prompt)], device=model.device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt):].tolist()]
