"""The draft side of the plan plane: a ``LocalProposer`` served over a channel.

``StartRequest`` prefills the prompt and seeds the draft's generator; ``ProposeRequest`` crops the
cache to ``keep``, feeds the new tokens and runs K steps, sending each step's ``PlanDelta`` at once
and then the ``DraftTokens`` (with q rows as ``SparseProbs`` when sampling). A request whose ids do
not fit the draft (a token outside the vocabulary, ``keep`` past what the cache holds, more
positions than the model has) is refused before anything is indexed, counted in ``rejections`` and
answered with an ``Error``; so is a failure. Nothing but ``Shutdown`` stops the loop.
"""

from __future__ import annotations

import threading

from specter.config import SamplingConfig
from specter.proposer import Draft, LocalProposer
from specter.protocol import (
    DraftTokens,
    Error,
    PlanDelta,
    ProposeRequest,
    Shutdown,
    SparseProbs,
    StartRequest,
)
from specter.remote.channel import Channel, ChannelError, DropLog

OUT_OF_RANGE, UNEXPECTED, FAILED = "out_of_range", "unexpected", "failed"


class Refused(ValueError):
    """A request whose ids do not fit the draft (answered with an ``Error``, loop goes on)."""


class DraftServer:
    """Serves draft rounds to the verifier.

    Args:
        draft: the draft model (its KV cache lives in the proposer).
        channel: a pair channel to the verifier.
        vocab_size: token ids must be below this (default: the draft model's config).
        max_positions: positions the draft can hold (default: its ``max_position_embeddings``).

    Attributes:
        rejections: refused messages per reason: ``out_of_range`` (ids that do not fit),
            ``unexpected`` (a message for another actor), ``failed`` (the draft raised).
        unsent: ``Error`` answers dropped because the peer was not reading.
    """

    def __init__(
        self, draft: Draft, channel: Channel, vocab_size: int | None = None, max_positions: int | None = None
    ):
        self.proposer = LocalProposer(draft)
        self.channel = channel
        self.rounds = 0
        config = getattr(getattr(draft, "model", None), "config", None)
        self.vocab_size = vocab_size or getattr(config, "vocab_size", None) or 2**31
        self.max_positions = max_positions or getattr(config, "max_position_embeddings", None) or 2**31
        self._refuse = DropLog("draft", (OUT_OF_RANGE, UNEXPECTED, FAILED))
        self.rejections: dict[str, int] = self._refuse.counts
        self.unsent = 0

    def handle(self, msg: object) -> bool:
        """Act on one message; False when it says to stop."""
        if isinstance(msg, Shutdown):
            return False
        try:
            if isinstance(msg, StartRequest):
                self._start(msg)
            elif isinstance(msg, ProposeRequest):
                self._propose(msg)
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
            msg = self.channel.recv(poll_s)
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

    def _start(self, msg: StartRequest) -> None:
        self._check_tokens(list(msg.prompt_ids), len(msg.prompt_ids))
        sampling = SamplingConfig(msg.temperature, msg.top_p, msg.top_k, msg.seed)
        self.proposer.prefill(list(msg.prompt_ids), sampling)

    def _propose(self, msg: ProposeRequest) -> None:
        if self.proposer.cache is None:
            raise Refused("no request started (StartRequest first)")
        if msg.keep > self.proposer.cached:
            raise Refused(f"keep {msg.keep}: the draft cache holds only {self.proposer.cached} positions")
        # extend() runs the pending tokens, K - 1 drafted ones, and the K-th with route_last
        self._check_tokens(list(msg.tokens), msg.keep + len(msg.tokens) + msg.k - 1 + msg.route_last)
        self.proposer.rollback(msg.keep)

        def send_plan(delta: PlanDelta) -> None:
            self.channel.send(delta)

        drafts, qs = self.proposer.extend(msg.round, list(msg.tokens), msg.k, send_plan, msg.route_last)
        rows = [SparseProbs.from_dense(q.numpy()) for q in qs]
        vocab = int(qs[0].shape[-1]) if qs else 0
        self.channel.send(DraftTokens(msg.round, drafts, rows, vocab))
        self.rounds += 1
