"""The verifier's stand-in for a local draft: asks the draft actor for each round's tokens.

Per round it sends one ``ProposeRequest`` (what to keep of the draft's cache, the tokens it has
not seen, K) and then reads the draft's ``PlanDelta``s as they arrive, handing each to the policy
at once, until the round's ``DraftTokens`` come. A rollback only updates the local mirror of the
draft's cache length; the draft crops when the next request says so. Messages of another round,
or not meant for the verifier, are counted in ``stale`` and logged at most once per second.
"""

from __future__ import annotations

import time

import torch

from specter.config import SamplingConfig
from specter.proposer import OnPlan
from specter.protocol import DraftTokens, Error, PlanDelta, ProposeRequest, StartRequest
from specter.remote.channel import Channel, DropLog


class DraftError(RuntimeError):
    """The draft actor failed, or did not answer in time."""


class RemoteProposer:
    """Draft tokens from the draft actor over a ``pair`` channel (handshake done).

    Args:
        channel: the pair channel to the draft actor.
        timeout_s: longest wait for the draft's next message.
    """

    def __init__(self, channel: Channel, timeout_s: float = 60.0):
        self.channel = channel
        self.timeout_s = timeout_s
        self.cached = 0  # positions the draft's cache holds (mirrored)
        self._requests = 0
        self._ignore = DropLog("verifier: from the draft", ("stale",))
        self.stale = self._ignore.counts

    def prefill(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """Start a request on the draft (it prefills while the verifier goes on)."""
        while (stale := self.channel.recv(0)) is not None:  # left over by a request that failed
            self._ignore("stale", f"a {type(stale).__name__} left over before this request")
        self._requests += 1
        self.channel.send(
            StartRequest(
                f"r{self._requests}", list(prompt_ids), 1, sampling.temperature, sampling.top_p, sampling.top_k,
                sampling.seed,
            )
        )
        self.cached = len(prompt_ids)

    def propose(
        self, round_id: int, seq: list[int], k: int, on_plan: OnPlan, route_last: bool
    ) -> tuple[list[int], list[torch.Tensor]]:
        """K draft tokens after ``seq``; plan deltas reach ``on_plan`` as the draft sends them."""
        self.channel.send(ProposeRequest(round_id, self.cached, list(seq[self.cached :]), k, route_last))
        tokens = self._collect(round_id, on_plan)
        if len(tokens.tokens) != k:
            raise DraftError(f"draft: round {round_id} returned {len(tokens.tokens)} tokens, asked for {k}")
        self.cached = len(seq) + k - 1 + (1 if route_last else 0)
        qs = [torch.from_numpy(row.to_dense(tokens.vocab_size)) for row in tokens.q]
        return list(tokens.tokens), qs

    def rollback(self, length: int) -> None:
        """The draft keeps only ``length`` positions (sent with the next request)."""
        self.cached = min(self.cached, length)

    def _collect(self, round_id: int, on_plan: OnPlan) -> DraftTokens:
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self.channel.recv(max(deadline - time.monotonic(), 0.0))
            if msg is None:
                raise DraftError(f"draft: no answer for round {round_id} within {self.timeout_s:.1f}s")
            if isinstance(msg, PlanDelta) and msg.round == round_id:
                on_plan(msg)
            elif isinstance(msg, DraftTokens) and msg.round == round_id:
                return msg
            elif isinstance(msg, Error):
                raise DraftError(f"draft: {msg.where}: {msg.message}")
            else:
                self._ignore("stale", f"a {type(msg).__name__} that is not for round {round_id}")
