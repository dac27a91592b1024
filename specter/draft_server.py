"""The draft side of the plan plane: a ``LocalProposer`` served over a channel.

``StartRequest`` prefills the prompt and seeds the draft's generator; ``ProposeRequest`` crops the
cache to ``keep``, feeds the new tokens and runs K steps, sending each step's ``PlanDelta`` at once
and then the ``DraftTokens`` (with q rows as ``SparseProbs`` when sampling). A failure is answered
with an ``Error`` and never stops the loop; ``Shutdown`` does.
"""

from __future__ import annotations

import logging
import threading

from specter.actor_channel import ActorChannel
from specter.actor_messages import ProposeRequest
from specter.config import SamplingConfig
from specter.proposer import Draft, LocalProposer
from specter.protocol import DraftTokens, Error, PlanDelta, Shutdown, SparseProbs, StartRequest

log = logging.getLogger(__name__)


class DraftServer:
    """Serves draft rounds to the verifier.

    Args:
        draft: the draft model (its KV cache lives in the proposer).
        channel: a pair channel to the verifier.
    """

    def __init__(self, draft: Draft, channel: ActorChannel):
        self.proposer = LocalProposer(draft)
        self.channel = channel
        self.rounds = 0

    def handle(self, msg: object) -> bool:
        """Act on one message; False when it says to stop."""
        if isinstance(msg, Shutdown):
            return False
        try:
            if isinstance(msg, StartRequest):
                sampling = SamplingConfig(msg.temperature, msg.top_p, msg.top_k, msg.seed)
                self.proposer.prefill(list(msg.prompt_ids), sampling)
            elif isinstance(msg, ProposeRequest):
                self._propose(msg)
            else:
                log.warning("draft: ignoring a %s message", type(msg).__name__)
        except Exception as exc:  # reported to the verifier, never kills the loop
            log.exception("draft: %s failed", type(msg).__name__)
            self.channel.send(Error("draft", f"{type(msg).__name__}: {exc}"[:4096]))
        return True

    def serve(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Handle messages until ``stop`` is set or a ``Shutdown`` arrives."""
        while not stop.is_set():
            msg = self.channel.recv(poll_s)
            if msg is not None and not self.handle(msg):
                return

    def _propose(self, msg: ProposeRequest) -> None:
        if self.proposer.cache is None:
            raise RuntimeError("no request started (StartRequest first)")
        self.proposer.rollback(msg.keep)
        if self.proposer.done != msg.keep:
            raise RuntimeError(f"the draft cache holds {self.proposer.done} positions, asked to keep {msg.keep}")

        def send_plan(delta: PlanDelta) -> None:
            self.channel.send(delta)

        drafts, qs = self.proposer.extend(msg.round, list(msg.tokens), msg.k, send_plan, msg.route_last)
        rows = [SparseProbs.from_dense(q.numpy()) for q in qs]
        vocab = int(qs[0].shape[-1]) if qs else 0
        self.channel.send(DraftTokens(msg.round, drafts, rows, vocab))
        self.rounds += 1
