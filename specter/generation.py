"""Plain autoregressive generation on the offloaded target (no speculation): one token a step."""

from __future__ import annotations

import time

import torch

from specter.config import SamplingConfig
from specter.stats import RequestStats
from specter.target import OffloadedTarget
from specter.verify.sampling import choose


def generate(
    target: OffloadedTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | None = None,
) -> tuple[list[int], RequestStats]:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; returns the new ids and stats."""
    sampling = sampling or SamplingConfig()
    if not prompt_ids:
        raise ValueError("prompt: must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    generator = torch.Generator().manual_seed(sampling.seed)
    counters0, link0 = target.offload.counters.snapshot(), _link_state(target)
    cache = target.new_cache()
    t0 = time.perf_counter()
    logits = target.forward(torch.tensor([prompt_ids]), cache)
    tokens = [choose(logits[0, -1], sampling, generator)]
    commits = [time.perf_counter()]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        logits = target.forward(torch.tensor([[tokens[-1]]]), cache)
        tokens.append(choose(logits[0, -1], sampling, generator))
        commits.append(time.perf_counter())
    stats = _stats(target, counters0, link0, len(prompt_ids), t0, commits)
    return tokens, stats


def _link_state(target: OffloadedTarget) -> tuple[int, float, int]:
    link = target.link
    return link.bytes_moved, link.busy_s, link.transfers


def _stats(
    target: OffloadedTarget, counters0, link0: tuple[int, float, int], prompt_len: int, t0: float,
    commits: list[float],
) -> RequestStats:
    counters = target.offload.counters.since(counters0)
    moved, busy, transfers = (a - b for a, b in zip(_link_state(target), link0, strict=True))
    decode_s = commits[-1] - commits[0]
    # TPOT as the published evaluation defines it: (last commit - first commit) / (N - 1).
    tpot = decode_s / (len(commits) - 1) if len(commits) > 1 else commits[0] - t0
    total = commits[-1] - t0
    return RequestStats(
        prompt_tokens=prompt_len,
        new_tokens=len(commits),
        prefill_s=commits[0] - t0,
        decode_s=decode_s,
        tpot_s=tpot,
        hits=counters.hits,
        inflight=counters.inflight,
        misses=counters.misses,
        hit_rate=counters.hit_rate,
        wait_s=counters.wait_s,
        bytes_moved=int(moved),
        link_busy_s=float(busy),
        link_busy_fraction=float(busy) / total if total > 0 else 0.0,
        transfers=int(transfers),
    )
