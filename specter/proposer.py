"""Who proposes the draft tokens of a round: a draft in this process, or one behind a socket.

The engine asks a ``Proposer`` for K tokens per round. ``LocalProposer`` runs a draft model here
(the in-process engine); ``specter.remote.proposer.RemoteProposer`` asks the draft actor over
ZeroMQ. Both hand each draft step's routing to ``on_plan`` the moment the step finishes, so that
transfers start while the draft is still drafting. ``IdleProposer`` drafts the next round in the
verify pass's waits. Several requests' drafting batched together: ``specter/batch_draft.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from specter.config import SamplingConfig
from specter.models.routing import DraftCompute, Routing
from specter.protocol import PlanDelta
from specter.target import crop_cache
from specter.timing.clock import WallClock
from specter.timing.dispatch import host_read
from specter.verify.sampling import coupled_draw, probabilities

OnPlan = Callable[[PlanDelta], None]
OnPlans = Callable[[list[PlanDelta]], None]  # several plan deltas at once (a round drafted ahead)
_SEED_MIX = 0x5851F42D4C957F2D  # draft sampling uses its own generator, seeded apart from the verifier's


class Draft(Protocol):
    """What the engine needs of a draft model."""

    @property
    def last_routing(self) -> Routing: ...

    @property
    def last_compute(self) -> DraftCompute: ...

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
    """A draft step's routing (top-k ids and router weights per MoE layer) as a plan delta: its last
    position's, the one the verify pass runs. A step that feeds several tokens (a round's first,
    catching up on what the last round or the plain steps before it committed) routes the earlier
    ones too, but the target has run those already: predicting their experts would move experts no
    pass needs, into the slots of ones it does."""
    layers = sorted(routing)  # host tensors (the draft read them once): numpy, no device read here
    experts = [_last_row(routing[layer][0]) for layer in layers]
    probs = [_last_row(routing[layer][1]) for layer in layers]
    return PlanDelta(round_id, step, layers, experts, probs)


def _last_row(values: torch.Tensor) -> list:
    """The last position's row of a (positions, top-k) routing tensor, as a list."""
    return values.reshape(-1, values.shape[-1])[-1].numpy().tolist()


class LocalProposer:
    """A draft model in this process, with its KV cache and its own sampling generator.

    Args:
        draft: the draft model.
        clock: the run's clock; a virtual one is charged each draft forward (``specter/timing/costs.py``).
        batched: one of several proposers over the same draft whose forwards
            ``specter.batch_draft.propose_together`` batches (its cache is one of several, never a graphed step's single static one).
    """

    def __init__(self, draft: Draft, clock: WallClock | None = None, batched: bool = False):
        self.draft = draft
        self.clock = clock or WallClock()
        self.batched = batched and bool(getattr(draft, "batches", False))
        self.cache: DynamicCache | None = None
        self.cached = 0  # positions the draft's cache holds
        self.sampling = SamplingConfig()
        self.gen = torch.Generator()
        self.last_logits: torch.Tensor | None = None  # the last position's logits of the latest forward

    @property
    def cold(self) -> int:
        """The draft's steps so far that ran a token count first or captured its graphs (``GraphedStep.cold``)."""
        graphed = getattr(self.draft, "graphed", None)
        return graphed.cold if graphed is not None else 0

    def prefill(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """Draft cache over the prompt; seeds the draft's generator from the request's seed."""
        self.cache = self.draft.new_cache(batched=True) if self.batched else self.draft.new_cache()  # type: ignore[call-arg]
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
            token = self.choose_token(logits, qs)
            drafts.append(token)
            pending = [token]
        if route_last and drafts:
            self._forward(pending)
            on_plan(plan_delta(round_id, k, self.draft.last_routing))
        return drafts, qs

    def choose_token(self, logits: torch.Tensor, qs: list[torch.Tensor]) -> int:
        """The draft token from a step's logits (greedy, or drawn from the draft's generator with
        its distribution appended to ``qs``)."""
        if self.sampling.greedy:
            token = getattr(self.draft, "last_token", None)  # read with the step's routing, if the draft does
            return token if token is not None else int(host_read(torch.argmax(logits)))
        q = probabilities(logits, self.sampling)
        qs.append(q.cpu())
        return int(torch.multinomial(q.cpu(), 1, generator=self.gen))

    def guess(self, drafts: list[int], routed_last: bool) -> tuple[int, list[int]]:
        """The draft's own guess of the target's next token after a round that drafted ``drafts``
        (pipelined drafting assumes it), and the tokens the next round then feeds.

        With ``routed_last`` the cache holds the last draft token already and its logits give the
        guess. Otherwise one forward over that token gives them and is rolled back: the next round
        feeds the token together with the guess, exactly as a round after a fully accepted one
        feeds it with the target's token — the same forwards, so the same numbers. A sampled guess
        is drawn with noise of its own (``sampling.coupled_draw``: seeded by the request and the
        position), so that the draft's generator draws what it would without pipelining; the
        target's token after a fully accepted round is drawn with the same noise, so the guess is
        right whenever the two distributions allow.
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
            bonus = int(host_read(torch.argmax(logits)))
        else:  # the target's token after a fully accepted round is drawn with the same noise
            bonus = coupled_draw(probabilities(logits, self.sampling), self.sampling.seed, position)
        return bonus, [bonus] if routed_last else [drafts[-1], bonus]

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """One draft forward over ``tokens`` after the cached positions, charged to the clock."""
        assert self.cache is not None, "prefill() first"
        logits = self.draft.forward(torch.tensor([tokens]), self.cache)
        self.clock.charge_draft(self.draft.last_routing, len(tokens), self.cached, self.draft.last_compute)
        self.cached += len(tokens)
        self.last_logits = logits[0, -1]
        return logits

    def rollback(self, length: int) -> None:
        """Crop the draft cache to the accepted prefix."""
        self.cached = min(self.cached, length)
        if self.cache is not None:
            crop_cache(self.cache, self.cached)

    def restore(self, cached: int, gen_state: torch.Tensor) -> None:
        """Back to where a round drafted ahead started: the cache cropped to ``cached`` positions,
        the generator at ``gen_state`` (the round's draws undone)."""
        self.rollback(cached)
        self.gen.set_state(gen_state)


@dataclass
class _Ahead:
    """The next round, drafted optimistically while this one is verified."""

    round: int
    k: int
    after: list[int]  # the drafts of the round it follows (its guess comes from their last)
    cached: int  # the draft cache's length before it (to undo it)
    gen_state: torch.Tensor  # the draft generator's state before it
    bonus: int | None = None  # the draft's guess of the target's next token (once guessed)
    pending: list[int] = field(default_factory=list)  # what its next step feeds
    drafts: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    deltas: list[PlanDelta] = field(default_factory=list)  # held until the round stands
    spent: float = 0.0  # clock seconds its steps took in the verify pass's waits


class IdleProposer(LocalProposer):
    """A ``LocalProposer`` that drafts the next round in the verify pass's idle time.

    One device, one thread: while the verify pass waits for a transfer or for the host
    (``OffloadedExperts.on_idle``), the draft drafts round r+1 as if every draft token of round r
    were accepted and the target's next token were the draft's own guess — the actors' pipelined
    drafting (``specter/remote/draft_server.py``), in the gaps of the verify pass instead of in
    another process. A step runs when the wait ahead covers the part of it lost in expectation
    (``idle``). The round stands when all of round r was
    accepted and the guess was right; its plan deltas reach the policy only then, and the steps
    the gaps did not cover are drafted when it is taken. A round that does not stand is undone
    (cache and generator), so output is exactly the unpipelined engine's (greedy and sampled:
    the draft's generator draws what it would have).
    """

    pipelined = True

    def __init__(self, draft: Draft, clock: WallClock | None = None):
        super().__init__(draft, clock)
        self._open: _Ahead | None = None
        self._keep: int | None = None  # a rollback asked for while a round was open
        self.step_s: float | None = None  # a draft step's clock seconds, EMA
        self.stand_rate = 0.5  # how often a round drafted ahead (and begun) stood, EMA
        self.stood_s = 0.0  # the clock seconds the latest round judged to stand took in the waits
        self.depth: float | None = None  # steps a begun round had drafted in the waits when judged, EMA
        # rounds opened ahead (a round no wait began is opened and never stands), of them stood,
        # plan deltas of thrown-away ones; draft steps taken in waits
        self.ahead_asked = self.ahead_kept = self.ahead_dropped = 0
        self.ahead_steps = 0
        self.thrown_s = 0.0  # clock seconds of rounds drafted ahead and thrown away (their steps are all drafting)

    def prefill(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        self._open, self._keep = None, None
        self.ahead_asked = self.ahead_kept = self.ahead_dropped = self.ahead_steps = 0
        self.thrown_s = 0.0
        super().prefill(prompt_ids, sampling)

    def propose(  # type: ignore[override]
        self, round_id: int, seq: list[int], k: int, on_plan: OnPlan, route_last: bool, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor]]:
        self._throw()
        t0 = self.clock.now()
        drafts, qs = super().propose(round_id, seq, k, on_plan, route_last)
        if drafts:
            self._time_step((self.clock.now() - t0) / len(drafts))
        self._open_next(round_id + 1, ahead, drafts, route_last)
        return drafts, qs

    def idle(self, seconds: float) -> None:
        """The verify pass is about to wait ``seconds``: draft ahead while a step pays.

        One device, so a step that outlasts the wait delays the pass by the difference; it saves a
        step later only if the round stands. So a step runs when the wait covers at least the part
        of it that is lost in expectation: ``seconds >= cost - P(stand) × saved`` (in steps), with
        P(stand) measured over the rounds drafted ahead so far (prior one half). A later step costs
        one forward and saves one. A round's first also guesses the target's next token (a forward
        of its own, which a round drafted as usual does not run), so it costs two; it begins the
        round, so it saves every step the waits draft for it: as many as a begun round has had
        drafted ahead on average (prior: the whole round).
        """
        opened = self._open
        while opened is not None and len(opened.drafts) < opened.k and self.step_s is not None:
            first = opened.bonus is None  # it guesses first
            cost, saved = (2.0, opened.k if self.depth is None else self.depth) if first else (1.0, 1.0)
            if seconds < (cost - self.stand_rate * saved) * self.step_s:
                return
            t0 = self.clock.now()
            self._step(opened, hold=True)
            spent = self.clock.now() - t0
            opened.spent += spent
            self.ahead_steps += 1
            self._time_step(spent / cost)
            seconds -= spent

    def rollback(self, length: int) -> None:
        """As ``LocalProposer.rollback``; while a round drafted ahead is open, only once it is judged."""
        if self._open is not None:
            self._keep = length if self._keep is None else min(self._keep, length)
            return
        super().rollback(length)

    def ahead_stands(self, all_accepted: bool, token: int) -> bool:
        opened = self._open
        stands = opened is not None and opened.bonus is not None and all_accepted and token == opened.bonus
        self.stood_s = opened.spent if stands and opened is not None else 0.0
        if opened is not None and opened.bonus is not None:  # begun: it teaches how often one stands
            self.stand_rate = 0.2 * stands + 0.8 * self.stand_rate
            drafted = float(len(opened.drafts))
            self.depth = drafted if self.depth is None else 0.2 * drafted + 0.8 * self.depth
        if not stands:
            self._throw()
        keep, self._keep = self._keep, None
        if keep is not None and not stands:
            super().rollback(keep)
        return stands

    def take_ahead(
        self, round_id: int, seq: list[int], on_plans: OnPlans, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor]]:
        opened = self._open
        assert opened is not None and opened.round == round_id, "take_ahead() after ahead_stands()"
        self.ahead_kept += 1
        if opened.deltas:
            on_plans(opened.deltas)
        t0, steps = self.clock.now(), len(opened.drafts)
        while len(opened.drafts) < opened.k:  # the steps no gap covered, each streamed at once
            on_plans([self._step(opened, hold=False)])
        if len(opened.drafts) > steps:
            self._time_step((self.clock.now() - t0) / (len(opened.drafts) - steps))
        self._open = None
        self._open_next(round_id + 1, ahead, opened.drafts, False)
        return opened.drafts, opened.qs

    def _open_next(self, round_id: int, k: int, after: list[int], route_last: bool) -> None:
        if k and after and not route_last:  # route_last rounds are not drafted ahead
            self._open = _Ahead(round_id, k, after, self.cached, self.gen.get_state())
            self.ahead_asked += 1

    def _step(self, opened: _Ahead, hold: bool) -> PlanDelta:
        if opened.bonus is None:  # guess() rolls its own forward back: not a rollback to defer
            self._open = None
            try:
                opened.bonus, opened.pending = self.guess(opened.after, False)
            finally:
                self._open = opened
        logits = self._forward(opened.pending)[0, -1]
        delta = plan_delta(opened.round, len(opened.drafts), self.draft.last_routing)
        token = self.choose_token(logits, opened.qs)
        opened.drafts.append(token)
        opened.pending = [token]
        if hold:
            opened.deltas.append(delta)
        return delta

    def _throw(self) -> None:
        """Undo the open round: its cache positions and its generator draws."""
        opened, self._open = self._open, None
        if opened is None:
            return
        self.ahead_dropped += len(opened.deltas)
        self.thrown_s += opened.spent
        self.restore(opened.cached, opened.gen_state)  # no round is open now: rollback acts at once

    def _time_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.25 * seconds + 0.75 * self.step_s
