"""One request's bookkeeping: what it asked for (checked before any work), what it has committed, what
its rounds tallied, and the ``RequestStats`` made from them at its end (``Engine`` runs the request);
``BatchRequest``, the same for a request decoded among others (``specter/batching.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specter.bound import Trace, lower_bound
from specter.config import SamplingConfig
from specter.models.graphed import StaticKV
from specter.protocol import PlanDelta
from specter.stats import RequestStats
from specter.target import OffloadedTarget
from specter.timing.costs import CostModel

OnTokens = Callable[[list[int]], None]  # the tokens a step or round committed, as it commits them
Cancelled = Callable[[], bool]  # asked before each round: end the request now


@dataclass
class Tally:
    """Per-request accumulators the round updates."""

    accepted: list[int] = field(default_factory=list)
    drafted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    predicted_used: int = 0  # experts the draft predicted that the verify pass used, summed over layers
    predicted: int = 0  # experts the draft predicted
    used: int = 0  # experts the verify pass used
    windows: list[int] = field(default_factory=list)  # every round's K (0: a plain decode step)
    last: tuple[float, float] = (0.0, 0.0)  # the latest round's drafting and verify seconds
    costs: tuple[float, float] = (0.0, 0.0)  # the same as the K chooser learns them (``Engine._round``)
    carried: float = 0.0  # seconds the latest verify pass spent drafting the next round, which stands
    fresh_draft_s: float = 0.0  # draft compute charged to rounds drafted once the round before was judged


@dataclass
class Request:
    """A request's state as it decodes after its prompt: what it asked for and what it committed."""

    seq: list[int]  # the prompt, then the tokens committed so far
    prompt_len: int
    max_new_tokens: int
    eos: int | None
    sampling: SamplingConfig
    gen: torch.Generator
    cache: DynamicCache | StaticKV
    commits: list[float]  # when each committed token committed
    on_tokens: OnTokens | None
    cancelled: Cancelled | None
    tally: Tally

    @property
    def made(self) -> int:
        """New tokens committed so far."""
        return len(self.seq) - self.prompt_len

    def finished(self) -> bool:
        return self.made >= self.max_new_tokens or self.seq[-1] == self.eos

    def stop_asked(self) -> bool:
        return self.cancelled is not None and self.cancelled()

    def commit(self, token: int, now: float) -> None:
        """One token commits at ``now`` (a plain step's: each goes to ``on_tokens`` on its own)."""
        self.seq.append(token)
        self.commits.append(now)
        if self.on_tokens is not None:
            self.on_tokens([token])


def request_stats(
    target: OffloadedTarget, clock: str, policy: str, window: int, before: Any, prompt_len: int, t0: float,
    commits: list[float], tally: Tally,
) -> RequestStats:
    """A request's figures from its counters before it (``before``: the offload's counters, the link's), its
    start ``t0``, each committed token's time and what its rounds tallied."""
    counters = target.offload.counters.since(before[0])
    moved, busy, transfers = (a - b for a, b in zip(link_state(target), before[1], strict=True))
    decode_s = commits[-1] - commits[0]
    total = commits[-1] - t0
    hist = [tally.accepted.count(i) for i in range(window + 1)] if window else []
    return RequestStats(
        prompt_tokens=prompt_len,
        new_tokens=len(commits),
        prefill_s=commits[0] - t0,
        decode_s=decode_s,
        # TPOT as the published evaluation defines it: (last commit - first commit) / (N - 1).
        tpot_s=decode_s / (len(commits) - 1) if len(commits) > 1 else commits[0] - t0,
        hits=counters.hits,
        inflight=counters.inflight,
        misses=counters.misses,
        hit_rate=counters.hit_rate,
        wait_s=counters.wait_s,
        bytes_moved=int(moved),
        link_busy_s=float(busy),
        link_busy_fraction=float(busy) / total if total > 0 else 0.0,
        transfers=int(transfers),
        extra={
            "clock": clock,
            "policy": policy,
            "window": window,
            "rounds": len(tally.accepted),
            "drafted": tally.drafted,
            "accepted_hist": hist,
            "mean_accepted": sum(tally.accepted) / len(tally.accepted) if tally.accepted else 0.0,
            "mean_window": sum(tally.windows) / len(tally.windows) if tally.windows else 0.0,
            "plain_rounds": tally.windows.count(0),
            "window_hist": {str(k): tally.windows.count(k) for k in sorted(set(tally.windows))},
            "recall": tally.predicted_used / tally.used if tally.used else 0.0,
            "precision": tally.predicted_used / tally.predicted if tally.predicted else 0.0,
            "draft_s": tally.draft_s,
            "verify_s": tally.verify_s,
        },
    )


@dataclass(eq=False)
class BatchRequest:
    """One request and, once done, its ``tokens`` and ``stats`` (or the ``error`` that ended it)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_id: int | None = None
    on_tokens: OnTokens | None = None
    cancelled: Cancelled | None = None
    on_done: Callable[[BatchRequest], None] | None = None  # called once it ends (``result`` no longer waits)
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # while it runs
    cache: Any = None
    generator: torch.Generator | None = None
    arrived_s: float = 0.0
    commits: list[float] = field(default_factory=list)
    fed: int = 0  # prompt tokens in the cache
    proposer: Any = None  # its draft (speculative rounds)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per round
    ks: list[int] = field(default_factory=list)  # its K per drafting round
    batch_sizes: list[int] = field(default_factory=list)
    before: tuple[Any, ...] = ()

    def result(self, timeout: float | None = None) -> tuple[list[int], RequestStats]:
        """Wait for it; its tokens and stats, or its error raised."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request not finished within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.stats is not None
        return self.tokens, self.stats


def add_predicted(predicted: dict[int, set[int]], deltas: list[PlanDelta]) -> None:
    """The experts ``deltas`` predict, added per layer to ``predicted``."""
    for delta in deltas:
        for layer, ids in zip(delta.layers, delta.experts, strict=True):
            predicted.setdefault(layer, set()).update(ids)


def score_prediction(tally: Tally, predicted: dict[int, set[int]], true: dict[int, set[int]]) -> None:
    """A round's predicted experts against those its verify pass used, into the recall and precision counts."""
    for layer, want in true.items():
        got = predicted.get(layer, set())
        tally.predicted_used += len(got & want)
        tally.used += len(want)
        tally.predicted += len(got)


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """``tokens`` up to and with the first ``eos``."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def host_state(target: OffloadedTarget) -> tuple[int, float, float]:
    """(experts computed on the host, their host time, time layers waited for the host)."""
    host = target.offload.host
    return host.snapshot() if host is not None else (0, 0.0, 0.0)


def check_request(target: OffloadedTarget, prompt_ids: list[int], max_new_tokens: int, window: int = 0) -> None:
    """Reject a request the model cannot serve, naming the field, before any work."""
    config = target.model.config
    check_prompt(prompt_ids, max_new_tokens, window, config.vocab_size, getattr(config, "max_position_embeddings", None))


def check_prompt(prompt_ids: list[int], max_new_tokens: int, window: int, vocab_size: int, context: int | None) -> None:
    """``check_request`` on the model config's figures (``vocab_size``, ``max_position_embeddings``):
    what the command line checks before it loads a model or launches a replica.

    Raises:
        ValueError: naming the field (``prompt``, ``max_new_tokens``) and what it must be.
    """
    if not prompt_ids:
        raise ValueError("prompt: must hold at least one token")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
    # The verify pass may run up to K positions past the last committed token.
    need = len(prompt_ids) + max_new_tokens + window
    if context is not None and need > context:
        raise ValueError(
            f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"+ window ({window}) = {need} exceeds the model's context of {context} positions"
        )


def trace_bound(target: OffloadedTarget, trace: Trace, costs: CostModel) -> float:
    """The lower bound in seconds on the passes ``trace`` recorded on ``target`` (``specter/bound.py``):
    its link's time per transfer, its host's expert times (if it computes on the host)."""
    offload = target.offload
    host = offload.host.expert_s if offload.host is not None else None
    transfer = target.link.estimate_s(offload.store.shape.nbytes)
    return lower_bound(trace, costs.expert_s, transfer, host).decode_s


def link_state(target: OffloadedTarget) -> tuple[int, float, int]:
    """The target's link counters: bytes moved, busy seconds, transfers (one snapshot: ``Link.counts``)."""
    return target.link.counts()
