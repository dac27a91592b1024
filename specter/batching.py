"""Continuous batching: several requests decoded together on one target, sharing its slot pool.

Each request has its own KV cache, sampling and generator; every step takes the next token of every
running request in one target pass (``OffloadedTarget.forward_batch``): the dense parts and each MoE
layer run once over all their positions, so an expert that several requests need is fetched and
computed once for all of them, and the slot pool's residency (the policy's choices) serves them all.
A request that arrives joins at the next step, after its prompt's prefill — one prefill per step, so
the running requests wait at most one prompt's work. A finished or cancelled request leaves at once,
its cache dropped.

Plain decoding only: the draft-free policies (``demand-lru``, ``demand-host``, …). Speculative
rounds, whose windows differ per request, are not batched yet (``Engine`` runs them one request at a
time). Greedy output of each request equals that request decoded alone (``tests/test_batching.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.config import SamplingConfig
from specter.plan import drafts
from specter.stats import RequestStats
from specter.target import OffloadedTarget
from specter.timing.dispatch import flush_reads, host_read
from specter.verify.sampling import choose

OnTokens = Callable[[list[int]], None]
Cancelled = Callable[[], bool]


@dataclass(eq=False)
class BatchRequest:
    """One request and, once done, its ``tokens`` and ``stats`` (or the ``error`` that ended it)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_id: int | None = None
    on_tokens: OnTokens | None = None
    cancelled: Cancelled | None = None
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # while it runs
    cache: Any = None
    generator: torch.Generator | None = None
    arrived_s: float = 0.0
    commits: list[float] = field(default_factory=list)
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


class Batcher:
    """Steps every running request together; ``submit`` from any thread, ``step`` (or ``serve``) from one.

    Args:
        target: the offloaded target (its lean step: mixtral, qwen2_moe, qwen3_moe).
        max_batch: requests decoded together at most; more wait in arrival order.
    """

    def __init__(self, target: OffloadedTarget, max_batch: int = 8):
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if target.lean is None or target.lean.fused is None:
            raise ValueError(f"batching needs the lean step; this target is {target.loaded.family.model_type}")
        if drafts(target.offload.policy.name):
            raise ValueError(f"batching: plain decoding only; policy {target.offload.policy.name} drafts")
        self.target, self.max_batch = target, max_batch
        self.clock = target.clock
        self.policy = target.offload.policy
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []
        self.steps = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)

    def submit(self, request: BatchRequest) -> BatchRequest:
        """Queue ``request`` (checked first: a bad one raises here, nothing queued)."""
        _check(self.target, request)
        request.arrived_s = self.clock.now()
        with self._work:
            self.waiting.append(request)
            self._work.notify()
        return request

    def idle(self) -> bool:
        with self._lock:
            return not self.waiting and not self.running

    def step(self) -> bool:
        """Admit one waiting request (its prefill) while there is room, then one step of every running
        request; False when there was nothing to do."""
        with self._lock:
            request = self.waiting.popleft() if self.waiting and len(self.running) < self.max_batch else None
        if request is not None:
            self._admit(request)
        self._drop_cancelled()
        if not self.running:
            return request is not None
        self._step()
        return True

    def serve(self, stop: threading.Event, lock: Any = None) -> None:
        """Step until ``stop`` is set, sleeping while there is no work (the server's engine thread);
        each step holds ``lock`` (the target's, shared with whatever else runs on it)."""
        lock = lock or contextlib.nullcontext()
        while not stop.is_set():
            with self._work:
                while not self.waiting and not self.running and not stop.is_set():
                    self._work.wait(0.5)
            if not stop.is_set():
                with lock:
                    self.step()

    def abandon(self, error: BaseException) -> None:
        """End every waiting and running request with ``error`` (the batcher is going away)."""
        with self._lock:
            left = list(self.waiting) + self.running
            self.waiting.clear()
            self.running = []
        for request in left:
            self._finish(request, error)

    def stop(self) -> None:
        """Wake ``serve`` (set its ``stop`` event first)."""
        with self._work:
            self._work.notify_all()

    def run(self, requests: list[BatchRequest]) -> list[tuple[list[int], RequestStats]]:
        """Submit ``requests`` and step until all are done (benchmarks, tests)."""
        for request in requests:
            self.submit(request)
        while self.step():
            pass
        return [request.result(0) for request in requests]

    # -- the work ----------------------------------------------------------------------------------------
    def _admit(self, request: BatchRequest) -> None:
        """The prompt's prefill, alone; its first token commits and it joins the next step."""
        try:
            request.before = (self.target.offload.counters.snapshot(), _link_state(self.target))
            request.generator = torch.Generator().manual_seed(request.sampling.seed)
            request.cache = self.target.new_cache(batched=True)
            logits = self.target.forward(torch.tensor([request.prompt_ids]), request.cache)
            token = choose(logits[0, -1], request.sampling, request.generator)
            flush_reads()
        except BaseException as exc:
            self._finish(request, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._commit(request, token)
        if not self._finished(request):
            self.running.append(request)

    def _step(self) -> None:
        batch = list(self.running)
        self.policy.begin_round(self.steps)
        self.policy.begin_verify(self.steps, len(batch))
        try:
            logits = self.target.forward_batch([torch.tensor([[r.tokens[-1]]]) for r in batch],
                                               [r.cache for r in batch])
            rows = torch.cat([x[0, -1:] for x in logits])
            greedy = [r.sampling.greedy for r in batch]
            chosen = host_read(torch.argmax(rows, dim=-1)) if any(greedy) else [0] * len(batch)
            tokens = [int(chosen[i]) if greedy[i] else choose(rows[i], r.sampling, r.generator)
                      for i, r in enumerate(batch)]
            flush_reads()
        except BaseException as exc:  # the step failed: every request in it ends with the error
            for request in batch:
                self._finish(request, exc)
            self.running = []
            if not isinstance(exc, Exception):
                raise
            return
        true = {layer: set(ids) for layer, ids in self.target.offload.last_needed.items()}
        self.policy.end_round(self.steps, 0, true)
        self.steps += 1
        for request, token in zip(batch, tokens, strict=True):
            request.batch_sizes.append(len(batch))
            self._commit(request, token)
        self.running = [r for r in self.running if not self._finished(r)]

    def _commit(self, request: BatchRequest, token: int) -> None:
        request.tokens.append(token)
        request.commits.append(self.clock.now())
        if request.on_tokens is not None:
            request.on_tokens([token])

    def _finished(self, request: BatchRequest) -> bool:
        if len(request.tokens) >= request.max_new_tokens or request.tokens[-1] == request.eos_token_id:
            self._finish(request)
            return True
        return False

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.running if r.cancelled is not None and r.cancelled()]:
            self.running.remove(request)
            self._finish(request, cancelled=True)

    def _finish(self, request: BatchRequest, error: BaseException | None = None, cancelled: bool = False) -> None:
        request.cache = None  # its KV goes with it
        request.error = error
        if error is None:
            request.stats = self._stats(request, cancelled)
        request.done.set()

    def _stats(self, request: BatchRequest, cancelled: bool) -> RequestStats:
        """The request's figures; hits, misses and bytes are those of the steps it shared with others."""
        counters = self.target.offload.counters.since(request.before[0])
        moved, busy, transfers = (a - b for a, b in zip(_link_state(self.target), request.before[1], strict=True))
        commits = request.commits
        decode_s = commits[-1] - commits[0]
        total = commits[-1] - request.arrived_s
        sizes = request.batch_sizes
        return RequestStats(
            prompt_tokens=len(request.prompt_ids), new_tokens=len(commits), prefill_s=commits[0] - request.arrived_s,
            decode_s=decode_s, tpot_s=decode_s / (len(commits) - 1) if len(commits) > 1 else 0.0,
            hits=counters.hits, inflight=counters.inflight, misses=counters.misses, hit_rate=counters.hit_rate,
            wait_s=counters.wait_s, bytes_moved=int(moved), link_busy_s=float(busy),
            link_busy_fraction=float(busy) / total if total > 0 else 0.0, transfers=int(transfers),
            extra={"clock": self.clock.name, "policy": self.policy.name, "window": 0, "rounds": 0,
                   "mean_accepted": 0.0, "cancelled": cancelled, "ttft_s": commits[0] - request.arrived_s,
                   "mean_batch": sum(sizes) / len(sizes) if sizes else 1.0},
        )


def _check(target: OffloadedTarget, request: BatchRequest) -> None:
    """What ``Engine`` refuses, refused the same way (naming the field)."""
    config = target.model.config
    if not request.prompt_ids:
        raise ValueError("prompt: must hold at least one token")
    if any(not isinstance(t, int) or not 0 <= t < config.vocab_size for t in request.prompt_ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {config.vocab_size})")
    if not isinstance(request.max_new_tokens, int) or request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be an integer >= 1, got {request.max_new_tokens!r}")
    context = getattr(config, "max_position_embeddings", None)
    need = len(request.prompt_ids) + request.max_new_tokens
    if context is not None and need > context:
        raise ValueError(f"max_new_tokens: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                         f"({request.max_new_tokens}) = {need} exceeds the model's context of {context} positions")


def _link_state(target: OffloadedTarget) -> tuple[int, float, int]:
    link = target.link
    return link.bytes_moved, link.busy_s, link.transfers
