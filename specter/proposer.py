"""Who proposes the draft tokens of a round: a draft in this process, or one behind a socket.

The engine asks a ``Proposer`` for K tokens per round. ``LocalProposer`` runs a draft model here
(the in-process engine); ``specter.remote.proposer.RemoteProposer`` asks the draft actor over
ZeroMQ. Both hand each draft step's routing to ``on_plan`` the moment the step finishes, so that
transfers start while the draft is still drafting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from transformers import DynamicCache

from specter.config import SamplingConfig
from specter.models.routing import Routing
from specter.protocol import PlanDelta
from specter.target import crop_cache
from specter.timing.clock import WallClock
from specter.verify.sampling import probabilities

OnPlan = Callable[[PlanDelta], None]
OnPlans = Callable[[list[PlanDelta]], None]  # several plan deltas at once (a round drafted ahead)
_SEED_MIX = 0x5851F42D4C957F2D  # draft sampling uses its own generator, seeded apart from the verifier's


class Draft(Protocol):
    """What the engine needs of a draft model."""

    @property
    def last_routing(self) -> Routing: ...

    def new_cache(self) -> DynamicCache: ...

    def forward(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor: ...


class Proposer(Protocol):
    """Draft tokens for the engine's rounds."""

    def prefill(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """A request starts: process the prompt and seed the draft's sampling."""

    def propose(
        self, round_id: int, seq: list[int], k: int, on_plan: OnPlan, route_last: bool
    ) -> tuple[list[int], list[torch.Tensor]]:
        """K draft tokens after ``seq`` and, when sampling, the (V,) distribution of each."""

    def rollback(self, length: int) -> None:
        """Only the first ``length`` positions of the sequence stand (the rest was rejected)."""


class PipelinedProposer(Proposer, Protocol):
    """A proposer whose draft can draft the next round while this one is verified (the actors')."""

    pipelined: bool

    def propose(  # type: ignore[override]
        self, round_id: int, seq: list[int], k: int, on_plan: OnPlan, route_last: bool, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor]]:
        """As ``Proposer.propose``; with ``ahead``, round ``round_id + 1`` is drafted right after."""

    def ahead_stands(self, all_accepted: bool, token: int) -> bool:
        """Whether the round drafted ahead stands, given the verify pass's outcome."""

    def take_ahead(
        self, round_id: int, seq: list[int], on_plans: OnPlans, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The round drafted ahead as round ``round_id``'s draft."""


def draft_seed(seed: int) -> int:
    """The seed of the draft's own generator for a request seeded ``seed``."""
    return (seed ^ _SEED_MIX) & (2**63 - 1)


def plan_delta(round_id: int, step: int, routing: Routing) -> PlanDelta:
    """A draft step's routing (top-k ids and router weights per MoE layer) as a plan delta."""
    layers = sorted(routing)
    experts = [routing[layer][0].flatten().tolist() for layer in layers]
    probs = [routing[layer][1].flatten().tolist() for layer in layers]
    return PlanDelta(round_id, step, layers, experts, probs)


class LocalProposer:
    """A draft model in this process, with its KV cache and its own sampling generator.

    Args:
        draft: the draft model.
        clock: the run's clock; a virtual one is charged each draft forward (``specter/timing/costs.py``).
    """

    def __init__(self, draft: Draft, clock: WallClock | None = None):
        self.draft = draft
        self.clock = clock or WallClock()
        self.cache: DynamicCache | None = None
        self.cached = 0  # positions the draft's cache holds
        self.sampling = SamplingConfig()
        self.gen = torch.Generator()
        self.last_logits: torch.Tensor | None = None  # the last position's logits of the latest forward

    def prefill(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """Draft cache over the prompt; seeds the draft's generator from the request's seed."""
        self.cache = self.draft.new_cache()
        self.cached = 0
        self._forward(prompt_ids)
        self.sampling = sampling
        self.gen.manual_seed(draft_seed(sampling.seed))

    def propose(
        self, round_id: int, seq: list[int], k: int, on_plan: OnPlan, route_last: bool
    ) -> tuple[list[int], list[torch.Tensor]]:
        """K draft steps after ``seq``; see :meth:`extend`."""
        return self.extend(round_id, seq[self.cached :], k, on_plan, route_last)

    def extend(
        self, round_id: int, pending: list[int], k: int, on_plan: OnPlan, route_last: bool,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Feed ``pending`` (the tokens the cache lacks), then K draft steps.

        After each step its routing goes to ``on_plan`` at once. With ``route_last`` one more
        forward routes the last draft token's position too, so the plan covers all K+1
        positions the verify pass will run (its logits are not needed). ``stop`` is asked before
        each step; when it says so the round ends there, with fewer than K tokens.
        """
        assert self.cache is not None, "prefill() first"
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        for step in range(k):
            if stop is not None and stop():
                return drafts, qs
            logits = self._forward(pending)[0, -1]
            on_plan(plan_delta(round_id, step, self.draft.last_routing))
            if self.sampling.greedy:
                token = int(torch.argmax(logits))
            else:
                q = probabilities(logits, self.sampling)
                token = int(torch.multinomial(q.cpu(), 1, generator=self.gen))
                qs.append(q.cpu())
            drafts.append(token)
            pending = [token]
        if route_last and drafts:
            self._forward(pending)
            on_plan(plan_delta(round_id, k, self.draft.last_routing))
        return drafts, qs

    def guess(self, drafts: list[int], routed_last: bool) -> tuple[int, list[int]]:
        """The draft's own guess of the target's next token after a round that drafted ``drafts``
        (pipelined drafting assumes it), and the tokens the next round then feeds.

        With ``routed_last`` the cache holds the last draft token already and its logits give the
        guess. Otherwise one forward over that token gives them and is rolled back: the next round
        feeds the token together with the guess, exactly as a round after a fully accepted one
        feeds it with the target's token — the same forwards, so the same numbers. A sampled guess
        is drawn from a generator of its own (seeded by the request and the position), so that
        the draft's generator draws what it would without pipelining.
        """
        assert drafts, "guess() after a round that drafted"
        if routed_last:
            assert self.last_logits is not None
            logits, position = self.last_logits, self.cached
        else:
            logits = self._forward([drafts[-1]])[0, -1]
            self.rollback(self.cached - 1)
            position = self.cached + 1
        if self.sampling.greedy:
            bonus = int(torch.argmax(logits))
        else:
            gen = torch.Generator().manual_seed((draft_seed(self.sampling.seed) + 1 + position) & (2**63 - 1))
            bonus = int(torch.multinomial(probabilities(logits, self.sampling).cpu(), 1, generator=gen))
        return bonus, [bonus] if routed_last else [drafts[-1], bonus]

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """One draft forward over ``tokens`` after the cached positions, charged to the clock."""
        assert self.cache is not None, "prefill() first"
        logits = self.draft.forward(torch.tensor([tokens]), self.cache)
        self.clock.charge_draft(self.draft.last_routing, len(tokens), self.cached)
        self.cached += len(tokens)
        self.last_logits = logits[0, -1]
        return logits

    def rollback(self, length: int) -> None:
        """Crop the draft cache to the accepted prefix."""
        self.cached = min(self.cached, length)
        if self.cache is not None:
            crop_cache(self.cache, self.cached)
