"""The draft side of the plan plane: a ``LocalProposer`` served over a channel.

``StartRequest`` prefills the prompt and seeds the draft's generator; ``ProposeRequest`` crops the
cache to ``keep``, feeds the new tokens and runs K steps, sending each step's ``PlanDelta`` at once
and then the ``DraftTokens`` (with q rows as ``SparseProbs`` when sampling). A request whose ids do
not fit the draft (a token outside the vocabulary, ``keep`` past what the cache holds, more
positions than the model has) is refused before anything is indexed, counted in ``rejections`` and
answered with an ``Error``; so is a failure. Nothing but ``Shutdown`` stops the loop.

Pipelined drafting (``ProposeRequest.ahead``): once a round's tokens are sent, the draft guesses the
target's next token, says so (``AheadStart``) and drafts the next round at once, as if the verifier
had accepted everything — while the verifier verifies. Between its steps it reads the socket: an
``AheadKeep`` for that round lets it go on (and, once done, draft the round after it the same way);
anything else means the round is thrown away — the draft stops, rolls its cache and its generator
back to where they were before the round, and handles the message. ``ahead_rounds``,
``ahead_thrown`` and ``ahead_steps_thrown`` count what it drafted that way and what was wasted.

With a ``plans`` channel (a push socket to the transfer actor, whose schedule runs on them) each
plan delta goes there as the step ends, and to the verifier too (its prediction-recall figures).

Several requests at once (the verifier's batcher, ``specter/batching.py``): a ``StartRequest`` with
``batched`` keeps a ``LocalProposer`` of its own under its request id (its cache and generator; the
draft's weights shared) until its ``EndRequest``; a ``ProposeBatch`` drafts a round for several of them
together — each step one draft forward over every request still drafting (``draft_together``), each
request's plan delta sent as its step ends — and answers one ``DraftTokens`` per request, in order.
At most ``MAX_HELD`` batched requests are held (a verifier that died without ending its requests
cannot grow the draft's memory without bound: the oldest is dropped).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from specter.batch_draft import draft_together
from specter.config import SamplingConfig
from specter.proposer import Draft, LocalProposer
from specter.protocol import (
    AheadKeep,
    AheadStart,
    DraftTokens,
    EndRequest,
    Error,
    PlanDelta,
    ProposeBatch,
    ProposeRequest,
    Shutdown,
    SparseProbs,
    StartRequest,
)
from specter.remote.channel import Channel, ChannelError, DropLog

OUT_OF_RANGE, UNEXPECTED, FAILED = "out_of_range", "unexpected", "failed"
MAX_HELD = 64  # batched requests held at once


class Refused(ValueError):
    """A request whose ids do not fit the draft (answered with an ``Error``, loop goes on)."""


class DraftServer:
    """Serves draft rounds to the verifier.

    Args:
        draft: the draft model (its KV cache lives in the proposer).
        channel: a pair channel to the verifier.
        vocab_size: token ids must be below this (default: the draft model's config).
        max_positions: positions the draft can hold (default: its ``max_position_embeddings``).
        plans: a push channel to the transfer actor for the plan deltas (set later as ``plans``).

    Attributes:
        rejections: refused messages per reason: ``out_of_range`` (ids that do not fit),
            ``unexpected`` (a message for another actor), ``failed`` (the draft raised).
        unsent: ``Error`` answers dropped because the peer was not reading.
    """

    def __init__(
        self, draft: Draft, channel: Channel, vocab_size: int | None = None, max_positions: int | None = None,
        plans: Channel | None = None,
    ):
        self.draft = draft
        self.proposer = LocalProposer(draft)
        self.batched: dict[str, LocalProposer] = {}  # the batched requests' drafts, oldest first
        self.channel = channel
        self.plans = plans
        self.rounds = 0
        config = getattr(getattr(draft, "model", None), "config", None)
        self.vocab_size = vocab_size or getattr(config, "vocab_size", None) or 2**31
        self.max_positions = max_positions or getattr(config, "max_position_embeddings", None) or 2**31
        self._refuse = DropLog("draft", (OUT_OF_RANGE, UNEXPECTED, FAILED))
        self.rejections: dict[str, int] = self._refuse.counts
        self.unsent = 0
        self.ahead_rounds = 0  # optimistic rounds started
        self.ahead_thrown = 0  # ... of which the verifier threw away
        self.ahead_steps_thrown = 0  # draft steps of the thrown-away ones
        self._next: object | None = None  # a message read while drafting ahead, handled next
        self._open: _Open | None = None  # a finished optimistic round the verifier has not judged yet

    def handle(self, msg: object) -> bool:
        """Act on one message; False when it says to stop."""
        if self._open is not None and not (isinstance(msg, AheadKeep) and msg.round == self._open.round):
            self._throw(self._open)  # the verifier did not keep the optimistic round
        if isinstance(msg, Shutdown):
            return False
        try:
            if isinstance(msg, StartRequest):
                self._start(msg)
            elif isinstance(msg, ProposeRequest):
                self._propose(msg)
            elif isinstance(msg, ProposeBatch):
                self._propose_batch(msg)
            elif isinstance(msg, EndRequest):
                self.batched.pop(msg.request_id, None)
            elif isinstance(msg, AheadKeep) and self._open is not None:
                done, self._open = self._open, None
                self._ahead(done.round + 1, done.drafts, done.route_last, msg.ahead)
            else:
                self._refuse(UNEXPECTED, f"a {type(msg).__name__} message is not for the draft")
        except Refused as exc:
            self._refuse(OUT_OF_RANGE, str(exc))
            self._answer(f"{type(msg).__name__}: {exc}")
        except Exception as exc:  # reported to the verifier, never kills the loop
            self._refuse(FAILED, f"{type(msg).__name__} failed: {exc!r}", exc_info=True)
            self._answer(f"{type(msg).__name__}: {exc}")
        return True

    def serve(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Handle messages until ``stop`` is set or a ``Shutdown`` arrives."""
        while not stop.is_set():
            msg, self._next = (self._next, None) if self._next is not None else (self.channel.recv(poll_s), None)
            if msg is not None and not self.handle(msg):
                return

    def _answer(self, text: str) -> None:
        """An ``Error`` to the peer, without waiting: a peer that does not read loses it."""
        try:
            self.channel.send(Error("draft", text[:4096]), timeout_s=0)
        except ChannelError:
            self.unsent += 1

    def _check_tokens(self, tokens: list[int], positions: int) -> None:
        if positions > self.max_positions:
            raise Refused(f"{positions} positions exceed the draft's {self.max_positions}")
        if max(tokens, default=0) >= self.vocab_size:
            raise Refused(f"a token id is >= the vocabulary size {self.vocab_size}")

    def _check_round(self, proposer: LocalProposer, keep: int, tokens: list[int], k: int, route_last: bool,
                     who: str = "") -> None:
        """Refuse a round whose ``keep`` is past what ``proposer``'s cache holds, or whose tokens or
        positions do not fit the draft: ``extend`` runs the tokens, K - 1 drafted ones, and the K-th
        with ``route_last``."""
        if keep > proposer.cached:
            raise Refused(f"{who}keep {keep}: the draft cache holds only {proposer.cached} positions")
        self._check_tokens(tokens, keep + len(tokens) + k - 1 + route_last)

    def _start(self, msg: StartRequest) -> None:
        self._check_tokens(list(msg.prompt_ids), len(msg.prompt_ids))
        sampling = SamplingConfig(msg.temperature, msg.top_p, msg.top_k, msg.seed)
        if not msg.batched:
            self.proposer.prefill(list(msg.prompt_ids), sampling)
            return
        proposer = LocalProposer(self.draft, batched=True)
        proposer.prefill(list(msg.prompt_ids), sampling)
        self.batched.pop(msg.request_id, None)
        self.batched[msg.request_id] = proposer
        while len(self.batched) > MAX_HELD:
            del self.batched[next(iter(self.batched))]

    def _propose_batch(self, msg: ProposeBatch) -> None:
        """A round for several batched requests, drafted together; one ``DraftTokens`` each, in order.
        Every item is checked before any cache is touched."""
        proposers = []
        for item in msg.items:
            proposer = self.batched.get(item.request_id)
            if proposer is None:
                raise Refused(f"request {item.request_id!r}: not started here (a batched StartRequest first)")
            self._check_round(proposer, item.keep, list(item.tokens), item.k, msg.route_last,
                              f"request {item.request_id!r}: ")
            proposers.append(proposer)
        for proposer, item in zip(proposers, msg.items, strict=True):
            proposer.rollback(item.keep)
        out = draft_together(msg.round, proposers, [list(item.tokens) for item in msg.items],
                             [item.k for item in msg.items], self._send_plan, msg.route_last)
        for item, (drafts, qs) in zip(msg.items, out, strict=True):
            self._send_tokens(msg.round, drafts, qs, item.request_id)

    def _propose(self, msg: ProposeRequest) -> None:
        if self.proposer.cache is None:
            raise Refused("no request started (StartRequest first)")
        self._check_round(self.proposer, msg.keep, list(msg.tokens), msg.k, msg.route_last)
        self.proposer.rollback(msg.keep)

        drafts, qs = self.proposer.extend(msg.round, list(msg.tokens), msg.k, self._send_plan, msg.route_last)
        self._send_tokens(msg.round, drafts, qs)
        if msg.ahead:
            self._ahead(msg.round + 1, drafts, msg.route_last, msg.ahead)

    def _send_plan(self, delta: PlanDelta) -> None:
        if self.plans is not None:
            self.plans.send(delta)
        self.channel.send(delta)

    def _send_tokens(self, round_id: int, drafts: list[int], qs: list[torch.Tensor], request_id: str = "") -> None:
        rows = [SparseProbs.from_dense(q.numpy()) for q in qs]
        vocab = int(qs[0].shape[-1]) if qs else 0
        self.channel.send(DraftTokens(round_id, drafts, rows, vocab, request_id, self.proposer.cold))
        self.rounds += 1

    def _ahead(self, round_id: int, drafts: list[int], route_last: bool, k: int) -> None:
        """Optimistic rounds from ``round_id`` on, each after the one before (while the verifier
        keeps them as they are drafted); stops at the first one it has not judged yet or threw away."""
        proposer = self.proposer
        while k:
            opened = _Open(round_id, proposer.cached, proposer.gen.get_state(), route_last)
            bonus, pending = proposer.guess(drafts, route_last)
            self._check_tokens(pending, proposer.cached + len(pending) + k - 1 + route_last)
            self.channel.send(AheadStart(round_id, bonus))
            self.ahead_rounds += 1
            verdict: list[AheadKeep] = []

            def interrupted(round_id: int = round_id, verdict: list[AheadKeep] = verdict) -> bool:
                msg = self.channel.recv(0)
                if msg is None:
                    return False
                if isinstance(msg, AheadKeep) and msg.round == round_id:
                    verdict.append(msg)
                    return False
                self._next = msg
                return True

            drafts, qs = proposer.extend(round_id, pending, k, self._send_plan, route_last, interrupted)
            opened.drafts = drafts
            if len(drafts) < k:  # a message that is not this round's keep came in
                self._throw(opened)
                return
            self._send_tokens(round_id, drafts, qs)
            if not verdict:  # judged later (``handle``)
                self._open = opened
                return
            round_id, k = round_id + 1, verdict[0].ahead

    def _throw(self, opened: _Open) -> None:
        """Undo an optimistic round: its cache positions and its generator draws."""
        self.ahead_thrown += 1
        self.ahead_steps_thrown += len(opened.drafts)
        self.proposer.restore(opened.cached, opened.gen_state)
        self._open = None


@dataclass
class _Open:
    """An optimistic round: where the draft stood before it (to undo it) and what it drafted."""

    round: int
    cached: int
    gen_state: torch.Tensor
    route_last: bool
    drafts: list[int] = field(default_factory=list)
