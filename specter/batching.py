"""Continuous batching: several requests decoded together on one target, sharing its slot pool.

Each request has its own KV cache, sampling and generator; every step takes the next token of every
running request in one target pass (``OffloadedTarget.forward_batch``): the dense parts and each MoE
layer run once over all their positions, so an expert that several requests need is fetched and
computed once for all of them, and the slot pool's residency (the policy's choices) serves them all.
A request that arrives joins at the next step and feeds its prompt ``prefill_chunk`` tokens a step,
batched with the others' tokens (chunked prefill), so a long prompt never stalls the running requests
for more than a few tokens' worth of work a step — on an offloaded model a prompt's tokens route to
most experts, and a whole prompt in one pass would hold the link for many steps. A step feeds at most
``prefill_chunk`` prompt tokens in all: several waiting requests join the same step while their whole
prompts fit in that (short prompts need not queue a step each), a longer one only when no other
prompt is being fed. Where the rounds draft more tokens than ``prefill_chunk``, the chunk is as many:
a step feeds a prompt as many tokens as its rounds draft, and waiting prompts join while they fit in
the draft tokens of the step before. A round of K drafted by n requests already verifies n·(K + 1)
positions, and with the K a server's choosers settle on where the draft leads (~20) requests finish
in a few rounds: at 16 prompt tokens a step, one prompt joining at a time, the next prompts queued
behind one another and the batch emptied (``docs/serving.md``, "A server's steady state"). A finished
or cancelled request leaves at once, its cache dropped.

With a draft (a drafting policy such as ``specter``), each step is a speculative round for every
decoding request: each request's own draft (a ``LocalProposer``: its own draft cache and generator,
the draft model's weights shared) proposes up to K tokens, their routing going to the policy as plans
as the engine's rounds do, so the schedule sees what every running request will need; then one
target pass verifies every request's window together, and each request accepts (greedy: the target's
argmax, one read for the whole batch; sampled: exact rejection sampling, per request) and rolls back
its own caches. An adaptive policy (``specter``) chooses each round's K with the engine's chooser
(``specter/plan/window.py``), one per number of drafting requests — a round's drafting and verify
times grow with how many requests draft in it, so what K pays is learnt per count — from the round's
times and every request's acceptance; each request drafts that K or what its last tokens leave.
Otherwise K is fixed (the policy's or the caller's). Each draft step is one draft forward over every
request still drafting (``propose_together``), in this process (``LocalDrafter``) or in the draft
process (``specter.remote.proposer.RemoteDrafter``: the server's streams). Pipelined drafting of
``Engine`` is not used here.
Greedy output of each request equals that request decoded alone, and transformers' ``generate``
(``tests/test_batching.py``).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections import deque
from typing import Any

import torch

from specter.batch_draft import BatchDrafter, LocalDrafter
from specter.plan import drafts
from specter.plan.window import WindowChooser
from specter.request import BatchRequest, check_request, link_state
from specter.stats import RequestStats
from specter.target import OffloadedTarget, crop_cache
from specter.timing.dispatch import flush_reads, host_read
from specter.verify.accept import accept_sampled
from specter.verify.sampling import choose, coupled_draw, probabilities

PREFILL_CHUNK = 16  # a joining prompt's tokens per step: about a step's worth of extra work for the others


class Batcher:
    """Steps every running request together; ``submit`` from any thread, ``step`` (or ``serve``) from one.

    Args:
        target: the offloaded target (its lean step: mixtral, qwen2_moe, qwen3_moe).
        max_batch: requests decoded together at most; more wait in arrival order.
        prefill_chunk: prompt tokens a step feeds at most, over every joining request (or, where the
            rounds draft more tokens, as many as they draft).
        draft: the draft model (``DraftModel``) for a drafting policy's speculative rounds.
        drafter: instead of ``draft``, what drafts them (``BatchDrafter``: the draft process's).
        window: K, draft tokens per round (default: the policy's); an adaptive policy's per-round
            choice is capped by it (``specter+fixed`` drafts K every round).
        choosers: an adaptive policy's K choosers to go on from (``chooser_states``' of an earlier
            batcher: a server kept between runs), by the number of requests drafting together.

    Raises:
        ValueError: a bad argument, or a kept chooser state that is no chooser of this policy's kind.
    """

    def __init__(self, target: OffloadedTarget, max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK,
                 draft: Any = None, window: int | None = None, drafter: BatchDrafter | None = None,
                 choosers: dict[int, dict[str, Any]] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if target.lean is None or target.lean.fused is None:
            raise ValueError(f"batching needs the lean step; this target is {target.loaded.family.model_type}")
        policy = target.offload.policy
        if draft is not None and drafter is not None:
            raise ValueError("batching: give the draft model (draft=) or a drafter (drafter=), not both")
        if draft is not None:
            drafter = LocalDrafter(draft, target.clock)
        if drafts(policy.name) and drafter is None:
            raise ValueError(f"batching: policy {policy.name} drafts; give the draft model (draft=)")
        self.drafter = drafter
        # an adaptive policy (``specter``) chooses K per round, ``window`` its cap as in ``Engine``: one
        # chooser per number of drafting requests, since what a K costs grows with how many draft it together
        self.choosers: dict[int, WindowChooser] | None = (
            {} if drafter is not None and policy.adaptive_window else None)
        if self.choosers is not None and choosers:
            self.choosers = {n: policy.window_chooser_from(state) for n, state in choosers.items()}
        if window is None:  # the policy's K (an adaptive policy's: its chooser's cap)
            window = policy.default_window
        self.window = 0 if drafter is None else window
        if drafter is not None and not 1 <= self.window <= 64:
            raise ValueError(f"window: K must lie in 1..64 for speculative rounds, got {self.window}")
        policy.window = self.window
        self.target, self.max_batch = target, max_batch
        self.clock = target.clock
        self.policy = target.offload.policy
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []
        self.steps = 0
        self._drafted = 0  # draft tokens of the last step (what a joining prompt keeps pace with)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)

    def submit(self, request: BatchRequest) -> BatchRequest:
        """Queue ``request`` (checked first: a bad one raises here, nothing queued)."""
        check_request(self.target, request.prompt_ids, request.max_new_tokens, self.window)
        request.arrived_s = self.clock.now()
        with self._work:
            self.waiting.append(request)
            self._work.notify()
        return request

    def idle(self) -> bool:
        with self._lock:
            return not self.waiting and not self.running

    def step(self) -> bool:
        """Admit waiting requests while there is room (``_joining``), then one step of every running
        request; False when there was nothing to do."""
        with self._lock:
            joining = self._joining()
        for request in joining:
            self._admit(request)
        self._drop_cancelled()
        if not self.running:
            return bool(joining)
        self._step()
        return True

    def _joining(self) -> list[BatchRequest]:
        """The waiting requests that join this step, in arrival order (the lock held): while there is
        room, and the step's prompt tokens stay within a chunk (``prefill_chunk``, or the last step's draft
        tokens where more) — the first one when no prompt is being fed (a long one fed a chunk a step),
        more while their whole prompts fit in what is left."""
        chunk = max(self.prefill_chunk, self._drafted)
        budget = chunk - sum(min(len(r.prompt_ids) - r.fed, chunk) for r in self.running if r.fed < len(r.prompt_ids))
        joining: list[BatchRequest] = []
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            prompt = len(self.waiting[0].prompt_ids)
            if prompt > budget and (joining or budget < chunk):
                break
            joining.append(self.waiting.popleft())
            budget -= min(prompt, chunk)
        return joining

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
        """A new request joins the running ones; its prompt is fed ``prefill_chunk`` tokens a step."""
        request.before = (self.target.offload.counters.snapshot(), link_state(self.target))
        request.generator = torch.Generator().manual_seed(request.sampling.seed)
        request.cache = self.target.new_cache(batched=True)
        if self.drafter is not None:
            request.proposer = self.drafter.start(request.prompt_ids, request.sampling)
        self.running.append(request)

    def _k(self, request: BatchRequest, cap: int) -> int:
        """Draft tokens ``request`` makes this step, at most ``cap``: 0 while its prompt is fed or
        without a draft, and never past its last token."""
        if request.fed < len(request.prompt_ids) or request.proposer is None:
            return 0
        return max(0, min(cap, request.max_new_tokens - len(request.tokens) - 1))

    def chooser_states(self) -> dict[int, dict[str, Any]]:
        """The states of the K choosers that have measured a round (or were kept), by the number of
        requests drafting together (``WindowChooser.state``'s; ``choosers=`` takes them back). Call it
        between steps (the server's engine lock held)."""
        return {n: c.state() for n, c in sorted((self.choosers or {}).items()) if c.verify_s}

    def _choose(self, batch: list[BatchRequest]) -> tuple[int, WindowChooser | None]:
        """This round's K and the chooser that chose it: with choosers, the one for the number of
        requests that can draft (set as the policy's, so that its round sees the K), else the window."""
        room = [k for k in (self._k(r, self.window) for r in batch) if k > 0]
        if self.choosers is None or not room:
            return self.window, None
        chooser = self.choosers.get(len(room))
        if chooser is None:
            chooser = self.choosers[len(room)] = self.policy.new_window_chooser()
        self.policy.use_window_chooser(chooser)
        return chooser.choose(max(room)), chooser

    def _rows(self, batch: list[BatchRequest], ks: list[int]) -> list[tuple[list[int], list[int], list[Any]]]:
        """What each request puts in this step — its prompt's next chunk (``prefill_chunk`` tokens, or as
        many as the round's draft tokens where more), or its last token and the ``ks[i]`` draft tokens
        of this round — and those drafts with their distributions (sampled). The
        drafting requests draft together, one batched draft forward per step (the drafter's ``propose``)."""
        drafting = [i for i, k in enumerate(ks) if k > 0]
        assert self.drafter is not None or not drafting
        proposals = dict(zip(drafting, self.drafter.propose(  # type: ignore[union-attr]
            self.steps, [batch[i].proposer for i in drafting],
            [batch[i].prompt_ids + batch[i].tokens for i in drafting], [ks[i] for i in drafting],
            self.policy.on_plan, self.policy.route_last_draft), strict=True)) if drafting else {}
        rows: list[tuple[list[int], list[int], list[Any]]] = []
        chunk = max(self.prefill_chunk, sum(ks))  # a prompt keeps pace with the round's draft tokens
        self._drafted = sum(ks)
        for i, request in enumerate(batch):
            if request.fed < len(request.prompt_ids):
                rows.append((request.prompt_ids[request.fed:request.fed + chunk], [], []))
            elif i in proposals:
                drafted, qs = proposals[i]
                rows.append((request.tokens[-1:] + drafted, drafted, qs))
            else:
                rows.append((request.tokens[-1:], [], []))
        return rows

    def _step(self) -> None:
        batch = list(self.running)
        cap, chooser = self._choose(batch)
        ks = [self._k(r, cap) for r in batch]
        started = self.clock.now()
        # the round's plan deltas are every drafting request's, all before the one verify pass: the
        # policy's deadlines count them all (a routed last token is one more delta each; the policy
        # adds one for the round itself)
        extra = sum(1 for k in ks if k > 0) - 1 if self.policy.route_last_draft else 0
        self.policy.round_drafts = sum(ks) + max(0, extra)
        if self.drafter is not None:
            self.drafter.begin_round(self.steps)
        self.target.offload.settle_landed()
        self.policy.begin_round(self.steps)
        try:
            rows = self._rows(batch, ks)
            drafted = self.clock.now()
            self.policy.begin_verify(self.steps, sum(len(x) for x, _, _ in rows))
            logits = self.target.forward_batch([torch.tensor([x]) for x, _, _ in rows], [r.cache for r in batch])
            verified = self.clock.now()
            for request, (x, _, _) in zip(batch, rows, strict=True):
                if request.fed < len(request.prompt_ids):
                    request.fed += len(x)
            new = self._accept(batch, rows, logits)
            flush_reads()
        except BaseException as exc:  # the step failed: every request in it ends with the error
            self.policy.round_drafts = None
            for request in batch:
                self._finish(request, exc)
            self.running = []
            if not isinstance(exc, Exception):
                raise
            return
        true = {layer: set(ids) for layer, ids in self.target.offload.last_needed.items()}
        accepted = [len(tokens) - 1 for tokens in new.values() if tokens]
        self.policy.end_round(self.steps, round(statistics.fmean(accepted)) if accepted else 0, true)
        self.policy.round_drafts = None
        if chooser is not None:  # acceptance per request, the round's times once
            for i, tokens in new.items():
                if ks[i] > 0:
                    chooser.observe(ks[i], len(tokens) - 1)
            chooser.record(cap, drafted - started, verified - drafted, None)
        self.steps += 1
        for i, tokens in new.items():
            request = batch[i]
            if request.tokens:  # a decode step (the first token comes out of the prompt's last chunk)
                request.batch_sizes.append(len(batch))
                if rows[i][1]:
                    request.accepted.append(len(tokens) - 1)
                    request.ks.append(len(rows[i][1]))
            room = request.max_new_tokens - len(request.tokens)
            committed = tokens[:room]
            if request.eos_token_id is not None and request.eos_token_id in committed:
                committed = committed[:committed.index(request.eos_token_id) + 1]
            self._commit(request, committed)
        self.running = [r for r in self.running if not (r.tokens and self._finished(r))]

    def _accept(self, batch: list[BatchRequest], rows: list[tuple[list[int], list[int], list[Any]]],
                logits: list[torch.Tensor]) -> dict[int, list[int]]:
        """Per request that makes tokens this step: what it commits (accepted drafts, then the target's
        token), its caches rolled back to them. Greedy choices come in one read for the whole batch."""
        deciding = [i for i, r in enumerate(batch) if r.fed >= len(r.prompt_ids)]
        greedy = [i for i in deciding if batch[i].sampling.greedy]
        choices: dict[int, list[int]] = {}
        if greedy:
            spans = [len(rows[i][1]) + 1 for i in greedy]  # a prompt's last chunk: its last row only
            flat = host_read(torch.argmax(torch.cat([logits[i][0, -n:] for i, n in zip(greedy, spans,
                                                                                         strict=True)]), dim=-1))
            start = 0
            for i, n in zip(greedy, spans, strict=True):
                choices[i], start = [int(t) for t in flat[start:start + n]], start + n
        new: dict[int, list[int]] = {}
        for i in deciding:
            request, (_, drafted, qs) = batch[i], rows[i]
            if i in choices:
                n = 0
                while n < len(drafted) and choices[i][n] == drafted[n]:
                    n += 1
                token = choices[i][n]
            elif drafted:
                assert request.generator is not None
                position = len(request.prompt_ids) + len(request.tokens) + len(drafted)  # as the engine's round

                def bonus(p: torch.Tensor, seed: int = request.sampling.seed, at: int = position) -> int:
                    return coupled_draw(p, seed, at)

                n, token = accept_sampled(probabilities(logits[i][0], request.sampling), torch.stack(qs), drafted,
                                          request.generator, bonus)
            else:
                n, token = 0, choose(logits[i][0, -1], request.sampling, request.generator)
            if drafted:
                keep = len(request.prompt_ids) + len(request.tokens) + n
                crop_cache(request.cache, keep)
                request.proposer.rollback(keep)
            new[i] = drafted[:n] + [token]
        return new

    def _commit(self, request: BatchRequest, tokens: list[int]) -> None:
        request.tokens += tokens
        request.commits += [self.clock.now()] * len(tokens)
        if request.on_tokens is not None:
            request.on_tokens(list(tokens))

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
        request.cache = None  # its KV goes with it, and its draft cache
        if request.proposer is not None and self.drafter is not None:
            self.drafter.end(request.proposer)
            request.proposer = None
        request.error = error
        if error is None:
            request.stats = self._stats(request, cancelled)
        request.done.set()
        if request.on_done is not None:
            request.on_done(request)

    def _stats(self, request: BatchRequest, cancelled: bool) -> RequestStats:
        """The request's figures; hits, misses and bytes are those of the steps it shared with others."""
        counters = self.target.offload.counters.since(request.before[0])
        moved, busy, transfers = (a - b for a, b in zip(link_state(self.target), request.before[1], strict=True))
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
            extra={"clock": self.clock.name, "policy": self.policy.name,
                   "window": statistics.fmean(request.ks) if self.choosers is not None and request.ks else self.window,
                   "rounds": len(request.accepted), "cancelled": cancelled,
                   "mean_accepted": statistics.fmean(request.accepted) if request.accepted else 0.0, "ttft_s": commits[0] - request.arrived_s,
                   "mean_batch": sum(sizes) / len(sizes) if sizes else 1.0},
        )
