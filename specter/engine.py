"""The speculative round, in one process: draft K tokens, verify K+1 positions, accept, roll back.

With no draft (or K = 0) a round is one plain decode step of the target, which is how the
``demand-lru`` and ``gate-prefetch`` baselines run. Greedy with no draft, each step's token stays on
the device as the next step's input and comes back with that step's first read (``Engine._plain``):
a step makes no read for its token, and the host learns each token one step after it is made.

``pipelined`` (a draft in its own process, the actors' ``RemoteProposer``, or in this one drafting
in the verify pass's waits, ``IdleProposer``; the policy option ``+pipe`` turns it on): each round
also asks the draft to draft the next round while this one is verified, as if every draft token
were accepted and the target's next token were the draft's own guess. When that is what happened
the next round's draft is ready (or nearly) as its round starts; otherwise it is thrown away and
drafted as usual. The K of a round drafted ahead is chosen one round early (a round after one
thrown away has its K chosen then). Tokens are the same either
way: a round that stands is exactly the draft the round would have drafted (``LocalProposer.guess``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import DynamicCache

from specter.bound import Trace
from specter.config import SamplingConfig
from specter.draft.loading import check_draft_matches
from specter.models.graphed import StaticKV, window_counts
from specter.models.routing import Routing
from specter.proposer import Draft, IdleProposer, LocalProposer, PipelinedProposer, Proposer
from specter.protocol import PlanDelta
from specter.request import (
    Cancelled,
    OnTokens,
    Request,
    Tally,
    add_predicted,
    check_request,
    host_state,
    link_state,
    request_stats,
    score_prediction,
    trace_bound,
    until_eos,
)
from specter.stats import RequestStats
from specter.target import OffloadedTarget, crop_cache
from specter.timing.costs import CostModel
from specter.timing.dispatch import READS, defer_read, drop_deferred, flush_reads, host_read, once_per_step
from specter.verify.accept import accept_greedy, accept_sampled
from specter.verify.sampling import choose, coupled_draw, probabilities

__all__ = ["Cancelled", "Draft", "Engine", "OnTokens", "Routing"]

class Engine:
    """Generates with an offloaded target and, optionally, a draft proposing ``window`` tokens.

    ``proposer`` stands in for ``draft`` when the draft runs elsewhere (the draft actor).
    """

    def __init__(
        self, target: OffloadedTarget, draft: Draft | None = None, window: int = 0, untimed_prefill: bool = False,
        proposer: Proposer | None = None, pipelined: bool | None = None,
    ):
        if window < 0 or window > 64:
            raise ValueError(f"window: K must be in [0, 64], got {window}")
        if window > 0 and draft is None and proposer is None:
            raise ValueError("window: K > 0 needs a draft model")
        if draft is not None and hasattr(draft, "model"):
            check_draft_matches(draft.model.config.to_dict(), target.model.config.to_dict())
        self.target = target
        self.draft = draft if window > 0 else None
        asked = pipelined  # None: the policy's own (``specter`` pipelines, ``+pipe``/``+nopipe`` say)
        pipelined = target.offload.policy.pipelined if pipelined is None else pipelined
        if window > 0 and proposer is None:
            assert draft is not None
            proposer = IdleProposer(draft, target.clock) if pipelined else LocalProposer(draft, target.clock)
        self.proposer = proposer if window > 0 else None
        can = getattr(self.proposer, "pipelined", False)
        if asked is None and not can:  # the policy's default, but this proposer cannot: drafted as usual
            pipelined = False
        if pipelined and self.proposer is not None and not can:
            raise ValueError("pipelined: drafting a round ahead needs a proposer that can (the actors', or "
                             f"specter.proposer.IdleProposer in process); {type(self.proposer).__name__} cannot")
        self.pipelined = pipelined and self.proposer is not None
        # In process, the draft drafts ahead in the verify pass's waits (IdleProposer.idle).
        target.offload.on_idle = getattr(self.proposer, "idle", None) if self.pipelined else None
        self.window = window
        self.clock = target.clock
        self.policy = target.offload.policy
        self.policy.window = window
        # Benchmarks may run the prompt's prefill over an unthrottled simulated link: TPOT starts
        # at the first token, so this changes no reported figure and saves the wall time.
        self.untimed_prefill = untimed_prefill
        self.active = False  # a request is running (read from other threads: progress reports)
        self.committed = 0  # tokens the running (or last) request has committed so far

    def prepare_steps(self) -> int:
        """Make ready now the step shapes this engine's rounds use — the target's 1 to window + 1 tokens
        (a plain step, a verify pass of K + 1), an in-process draft's 1 to window + 2 (a round's first
        step feeds what the last round committed) — so no request pays their first runs and CUDA graph
        captures (``GraphedStep.prepare``; on a GPU some milliseconds each). Where steps are eager
        there is nothing to do. Returns how many token counts were made ready."""
        ready = 0
        for model, draft in ((self.target, False), (self.draft, True)):
            graphed = getattr(model, "graphed", None)
            if graphed is not None:
                ready += graphed.prepare(window_counts(self.window, draft))
        return ready

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
        eos_token_id: int | None = None, on_tokens: OnTokens | None = None, cancelled: Cancelled | None = None,
    ) -> tuple[list[int], RequestStats]:
        """Up to ``max_new_tokens`` new token ids after ``prompt_ids``, and the request's stats.

        ``on_tokens`` gets the tokens each step or round commits, as it commits them (a stream's
        chunks: together they are the returned tokens; greedy with no draft, each token on its own,
        the step after the one that made it). ``cancelled`` is asked before each round; when it says
        so the request ends there with what it committed (``stats.extra["cancelled"]``).
        """
        sampling = sampling or SamplingConfig()
        check_request(self.target, prompt_ids, max_new_tokens, self.window)
        self.active, self.committed = True, 0
        try:
            with self.clock.counting():  # the as-built clock charges the ops and reads the request issues
                return self._generate(prompt_ids, max_new_tokens, sampling, eos_token_id, on_tokens, cancelled)
        except BaseException:
            drop_deferred()  # reads a failed request deferred: nobody waits for them
            raise
        finally:
            self.active = False

    def _generate(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, eos_token_id: int | None,
        on_tokens: OnTokens | None, cancelled: Cancelled | None,
    ) -> tuple[list[int], RequestStats]:
        gen = torch.Generator().manual_seed(sampling.seed)
        before = (self.target.offload.counters.snapshot(), link_state(self.target), host_state(self.target))
        self.policy.begin_request()
        tally = Tally()
        cold_mark = self.cold_steps()
        t0 = self.clock.now()
        tcache = self.target.new_cache()
        link = self.target.link
        timed = getattr(link, "timed", None)
        if self.untimed_prefill and timed is not None:
            link.timed = False  # type: ignore[attr-defined]
        try:
            logits = self.target.forward(torch.tensor([prompt_ids]), tcache)
        finally:
            if timed is not None:
                link.timed = timed  # type: ignore[attr-defined]
        seq = list(prompt_ids) + [choose(logits[0, -1], sampling, gen)]
        flush_reads()  # the prompt's resident layers settle before the first token commits
        if self.proposer is not None:  # the draft's pass over the prompt is prefill too (time to first token)
            self.proposer.prefill(prompt_ids, sampling)
        commits = [self.clock.now()]
        self.committed = 1
        if on_tokens is not None:
            on_tokens(seq[-1:])
        after_prefill = self.target.offload.counters.snapshot()
        dispatch_mark = (READS.count, getattr(self.clock, "dispatch_s", 0.0))
        costs = getattr(self.clock, "costs", None)  # the bound needs the cost model: virtual clock only
        trace = self.target.offload.start_trace() if costs is not None else None
        draft_mark = getattr(self.clock, "draft_charged", 0.0)
        request = Request(seq, len(prompt_ids), max_new_tokens, eos_token_id, sampling, gen, tcache, commits,
                           on_tokens, cancelled, tally)
        stopped = self._plain(request) if self.proposer is None and sampling.greedy else self._rounds(request)
        tokens = seq[len(prompt_ids):]
        stats = request_stats(self.target, self.clock.name, self.policy.name, self.window, before, len(prompt_ids), t0,
                              commits, tally)
        if trace is not None and costs is not None:
            self.target.offload.trace = None
            # Pipelined, a round drafted in the verify pass's waits still takes the device (one
            # clock), so the bound adds it up like any draft; one thrown away is not part of the
            # rounds the run committed, and leaving it out keeps the bound below any schedule of them.
            thrown = getattr(self.proposer, "thrown_s", 0.0)
            trace.draft_s = self.clock.draft_charged - draft_mark - thrown  # type: ignore[attr-defined]
            trace.ahead_s = max(0.0, trace.draft_s - tally.fresh_draft_s) if self.pipelined else 0.0  # rounds that stood
            stats.bound_tpot_s = self._bound(trace, costs) / max(1, len(commits) - 1)
        stats.extra["decode_misses"] = self.target.offload.counters.since(after_prefill).misses
        stats.extra["cancelled"] = stopped
        # reads of device data the decode made (a sync each on a GPU), and the as-built clock's dispatch
        stats.extra["host_reads"] = READS.count - dispatch_mark[0]
        if self.clock.name == "as-built":
            stats.extra["dispatch_s"] = getattr(self.clock, "dispatch_s", 0.0) - dispatch_mark[1]
        if self._graphed():
            stats.extra["cold_steps"] = self.cold_steps() - cold_mark  # steps that ran a count first or captured
        chooser = self.policy.window_chooser() if self.proposer is not None else None
        if chooser is not None:  # rounds whose costs the K chooser has learnt from, this request's included
            stats.extra["chooser_rounds"] = sum(chooser.samples.values())
            stats.extra["chooser"] = chooser.summary()  # what it had learnt as the request ended
        if self.pipelined:
            proposer = self.proposer
            stats.extra["pipelined"] = True
            for name in ("ahead_asked", "ahead_kept", "ahead_dropped"):
                stats.extra[name] = getattr(proposer, name)
        host = (a - b for a, b in zip(host_state(self.target), before[2], strict=True))
        stats.extra["host_experts"], stats.extra["host_s"], stats.extra["host_wait_s"] = host
        return tokens, stats

    def _bound(self, trace: Trace, costs: CostModel) -> float:
        """The decode's lower bound in seconds (``specter/bound.py``)."""
        return trace_bound(self.target, trace, costs)

    def generate_fresh(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
        eos_token_id: int | None = None, on_tokens: OnTokens | None = None, cancelled: Cancelled | None = None,
    ) -> tuple[list[int], RequestStats]:
        """``generate`` from the initial slot residency; the oracle first records its trace."""
        offload = self.target.offload
        replay = getattr(self.policy, "replay", None)
        if replay is not None:
            offload.reset_residency()
            self.generate(prompt_ids, max_new_tokens, sampling, eos_token_id)
            replay()
        offload.reset_residency()
        return self.generate(prompt_ids, max_new_tokens, sampling, eos_token_id, on_tokens, cancelled)

    def _rounds(self, request: Request) -> bool:
        """Rounds until the request is done; whether ``cancelled`` ended it."""
        seq, tally = request.seq, request.tally
        round_id = 0
        chooser = self.policy.window_chooser() if self.proposer is not None else None
        if chooser is not None:
            chooser.begin_request()
        planned: int | None = None  # pipelined: this round's K, chosen by the round before
        standing = False  # pipelined: the round drafted ahead stands, its draft is this round's
        while not request.finished():
            if request.stop_asked():
                return True
            remaining = request.max_new_tokens - request.made
            limit = min(self.window, remaining - 1)
            if standing and planned is not None:  # drafted ahead at the K chosen a round early
                k = planned
                if chooser is not None:
                    chooser.play(k)
            else:  # chosen now, from every round measured so far (a K chosen early for a round
                k = chooser.choose(limit) if chooser is not None else limit  # thrown away is stale)
            ahead_limit = min(self.window, remaining - (k + 1) - 1) if self.pipelined and k else 0
            cold = self.cold_steps()
            new, planned, stands = self._round(round_id, seq, request.cache, k, request.sampling, request.gen, tally,
                                               standing, ahead_limit)
            if chooser is not None:  # a round that captured graphs (or ran a step shape first) measures no cost
                chooser.record(k, tally.costs[0], tally.costs[1], len(new) - 1, cold=self.cold_steps() != cold)
            committed = until_eos(new[:remaining], request.eos)
            seq += committed
            request.commits += [self.clock.now()] * len(committed)
            self.committed = request.made
            if request.on_tokens is not None and committed:
                request.on_tokens(committed)
            round_id += 2 if planned and not stands else 1  # a thrown-away round's id is not reused
            standing = stands
        return False

    def _graphed(self) -> bool:
        """Whether a step of this engine's target or draft runs graphed pieces (``models/graphed.py``)."""
        draft = getattr(self.proposer, "draft", None)  # an in-process draft (a draft process reports its own)
        return any(getattr(m, "graphed", None) is not None for m in (self.target, draft))

    def cold_steps(self) -> int:
        """Steps so far, target's and draft's, that ran a token count for the first time or captured
        its CUDA graphs (``GraphedStep.cold``): their time is a one-off, not what the count costs."""
        graphed = getattr(self.target, "graphed", None)
        return (graphed.cold if graphed is not None else 0) + int(getattr(self.proposer, "cold", 0))

    # -- plain greedy decoding -----------------------------------------------------------------
    def _plain(self, request: Request) -> bool:
        """Greedy steps with no draft until the request is done; whether ``cancelled`` ended it.

        Each step's token stays on the device and is the next step's input as it is. The host reads it
        with that next step's first read of device data (the routing of its first layer not all
        resident, or the read after the step that settles a resident layer's routing), so a token
        costs no read of its own. The host learns each token one step after it is made, and commits it
        then: a finish by EOS runs one step more, whose token is dropped (the request's KV cache is its
        own); the step that makes the last token the request allows reads it with its own reads, so no
        step runs past ``max_new_tokens``; a request cancelled between steps keeps the token made."""
        made: torch.Tensor | None = None  # the latest token, on the device, not read yet
        step = 0
        while not request.finished():
            if request.stop_asked():
                if made is not None:
                    self._commit(request, host_read(made.view(-1)))
                return True
            last = request.made + (made is not None) + 1 >= request.max_new_tokens
            read, made = self._plain_step(step, request, made, last)
            self._commit(request, read)
            step += 1
        return False

    def _plain_step(
        self, step: int, request: Request, made: torch.Tensor | None, last: bool
    ) -> tuple[list[int], torch.Tensor | None]:
        """One greedy step on ``made`` (the token the step before made, on the device; None: the request's
        latest token, known to the host). Returns the tokens read back (``made``, then this step's own when
        ``last``) and, unless ``last``, this step's token on the device."""
        read: list[int] = []

        def back(values: Any) -> None:  # a token read with the step's reads (``defer_read``)
            read.append(int(values.item()))

        self.target.offload.settle_landed()
        self.policy.begin_round(step)
        t0 = self.clock.now()
        self.policy.begin_verify(step, 1)
        if made is not None:
            defer_read(made, back)  # read with the step's first read of device data
        ids = made if made is not None else torch.tensor([[request.seq[-1]]])
        logits = self.target.forward(ids, request.cache)[0]
        with once_per_step:  # the step's own, not its layers' (the as-built clock)
            token = torch.argmax(logits, dim=-1).view(1, 1)
            if last:
                defer_read(token, back)
            flush_reads()  # what no read during the step brought: a fully resident step's routing and tokens
        true = {layer: set(experts) for layer, experts in self.target.offload.last_needed.items()}
        tally = request.tally
        tally.last = (0.0, self.clock.now() - t0)
        tally.verify_s += tally.last[1]
        tally.windows.append(0)
        self.policy.end_round(step, 0, true)
        return read, None if last else token

    def _commit(self, request: Request, tokens: list[int]) -> None:
        """Plain steps' tokens as the host learns them, up to the request's EOS."""
        for token in tokens:
            if request.finished():
                return
            request.commit(token, self.clock.now())
            self.committed = request.made

    # -- the round --------------------------------------------------------------------------
    def _round(
        self, round_id: int, seq: list[int], tcache: DynamicCache | StaticKV, k: int,
        sampling: SamplingConfig, gen: torch.Generator, tally: Tally, standing: bool = False, ahead_limit: int = 0,
    ) -> tuple[list[int], int | None, bool]:
        """One round: the tokens it commits (accepted drafts + the target's next token) and, when
        pipelined, the next round's K (drafted ahead, None when not chosen) and whether that
        round stands. ``standing``: this round's draft was drafted ahead."""
        self.target.offload.settle_landed()
        self.policy.begin_round(round_id)
        ahead = 0
        if ahead_limit > 0:  # after begin_round: the policy reads this round's K from the chooser
            chooser = self.policy.window_chooser()
            ahead = chooser.choose(ahead_limit, ahead=True) if chooser is not None else ahead_limit
        t0 = self.clock.now()
        if standing:
            drafts, qs, predicted = self._take(round_id, seq, ahead)
        else:
            charged = getattr(self.clock, "draft_charged", 0.0)
            drafts, qs, predicted = self._draft(round_id, seq, k, ahead) if k else ([], [], {})
            tally.fresh_draft_s += getattr(self.clock, "draft_charged", 0.0) - charged
        t1 = self.clock.now()
        self.policy.begin_verify(round_id, len(drafts) + 1)
        logits = self.target.forward(torch.tensor([[seq[-1]] + drafts]), tcache)[0]
        with once_per_step:  # the pass's own, not its layers' (the as-built clock)
            if sampling.greedy:
                n, nxt = accept_greedy(logits, drafts)
            elif drafts:
                position = len(seq) + len(drafts)  # of the token after the drafts, as the draft's guess names it
                n, nxt = accept_sampled(probabilities(logits, sampling), torch.stack(qs), drafts, gen,
                                        lambda p: coupled_draw(p, sampling.seed, position))
            else:
                n, nxt = 0, choose(logits[-1], sampling, gen)
            flush_reads()  # a fully resident layer's routing, if the acceptance's read did not bring it
        true = {layer: set(ids) for layer, ids in self.target.offload.last_needed.items()}
        tally.last = (t1 - t0, self.clock.now() - t1)
        tally.draft_s += tally.last[0]
        tally.verify_s += tally.last[1]
        tally.windows.append(k)
        crop_cache(tcache, len(seq) + n)  # the cache held seq[:-1]; keep seq[-1] and the accepted drafts
        if self.proposer is not None:
            self.proposer.rollback(len(seq) + n)
        self.policy.end_round(round_id, n, true)
        if k:
            tally.accepted.append(n)
            tally.drafted += len(drafts)
            score_prediction(tally, predicted, true)
        stands = bool(ahead) and cast(PipelinedProposer, self.proposer).ahead_stands(n == len(drafts), nxt)
        # What the K chooser learns: the steps this verify pass drafted for a round that stands are
        # that round's drafting, not this pass's verify time (in process they ran on this clock).
        moved = getattr(self.proposer, "stood_s", 0.0) if stands else 0.0
        tally.costs = (tally.last[0] + tally.carried, tally.last[1] - moved)
        tally.carried = moved
        return drafts[:n] + [nxt], (ahead if ahead_limit > 0 else None), stands

    def _draft(
        self, round_id: int, seq: list[int], k: int, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor], dict[int, set[int]]]:
        """K draft steps; after each, its routing goes to the policy as a plan delta at once."""
        assert self.proposer is not None
        predicted: dict[int, set[int]] = {}

        def on_plan(delta: PlanDelta) -> None:
            add_predicted(predicted, [delta])
            self.policy.on_plan(delta)

        route_last = self.policy.route_last_draft
        if ahead:
            drafts, qs = cast(PipelinedProposer, self.proposer).propose(round_id, seq, k, on_plan, route_last, ahead)
        else:
            drafts, qs = self.proposer.propose(round_id, seq, k, on_plan, route_last)
        return drafts, qs, predicted

    def _take(self, round_id: int, seq: list[int], ahead: int) -> tuple[list[int], list[torch.Tensor], dict[int, set[int]]]:
        """The round drafted ahead, which stands; plan deltas that came during the verify pass
        reach the policy together."""
        predicted: dict[int, set[int]] = {}

        def on_plans(deltas: list[PlanDelta]) -> None:
            add_predicted(predicted, deltas)
            self.policy.on_plans(deltas)

        drafts, qs = cast(PipelinedProposer, self.proposer).take_ahead(round_id, seq, on_plans, ahead)
        return drafts, qs, predicted

