"""Drafting for several requests at once: one draft forward per step over every request still drafting.

The batcher (``specter/batching.py``) drafts each round for all its drafting requests together.
``propose_together`` and ``draft_together`` batch the draft forwards of several
``specter.proposer.LocalProposer``s (each with its own cache and generator, the draft's weights
shared); ``BatchDrafter`` is what the batcher needs of a drafter, ``LocalDrafter`` that over a draft
in this process (``specter.remote.proposer.RemoteDrafter``: over the draft process, whose server
batches with ``draft_together`` too).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specter.config import SamplingConfig
from specter.proposer import Draft, LocalProposer, OnPlan, plan_delta
from specter.timing.clock import WallClock


def propose_together(
    round_id: int, proposers: list[LocalProposer], seqs: list[list[int]], ks: list[int], on_plan: OnPlan,
    route_last: bool,
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each proposer's ``ks[i]`` draft tokens after ``seqs[i]`` (what its ``propose`` returns), their
    draft forwards batched (``draft_together``, each feeding what its own cache lacks)."""
    return draft_together(round_id, proposers, [seq[p.cached:] for p, seq in zip(proposers, seqs, strict=True)],
                          ks, on_plan, route_last)


def draft_together(
    round_id: int, proposers: list[LocalProposer], feeds: list[list[int]], ks: list[int], on_plan: OnPlan,
    route_last: bool,
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each proposer's ``ks[i]`` draft tokens after feeding ``feeds[i]`` (the tokens its cache lacks;
    what its ``extend`` returns), the draft forwards batched: step j is one forward over every proposer
    still drafting (``DraftModel.forward_batch``). Each proposer's routing goes to ``on_plan`` as its
    step finishes, its own positions' rows, so the policy sees what every request will need; the
    clock is charged one forward per step. Proposers made without ``batched`` (a draft that cannot
    batch) draft one after another."""
    out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in proposers]
    if not all(p.batched for p in proposers) or sum(k > 0 for k in ks) < 2:
        return [p.extend(round_id, feed, k, on_plan, route_last) if k > 0 else ([], [])
                for p, feed, k in zip(proposers, feeds, ks, strict=True)]
    draft: Any = proposers[0].draft
    pending = {i: feeds[i] for i in range(len(proposers)) if ks[i] > 0}
    while pending:
        order = sorted(pending)
        feeds = [pending[i] for i in order]
        logits = draft.forward_batch(feeds, [proposers[i].cache for i in order])
        proposers[0].clock.charge_draft(draft.last_routing, sum(map(len, feeds)),
                                        sum(proposers[i].cached for i in order), draft.last_compute)
        start = 0
        for n, i in enumerate(order):
            proposer, rows = proposers[i], len(feeds[n])
            routing = {layer: (ids[start:start + rows], probs[start:start + rows])
                       for layer, (ids, probs) in draft.last_routing.items()}
            start += rows
            proposer.cached += rows
            proposer.last_logits = logits[n][0, -1]
            drafted, qs = out[i]
            on_plan(plan_delta(round_id, len(drafted), routing))
            if len(drafted) == ks[i]:  # the forward that routed its last draft token
                del pending[i]
                continue
            token = (draft.last_tokens[n] if proposer.sampling.greedy
                     else proposer.choose_token(logits[n][0, -1], qs))
            drafted.append(token)
            if len(drafted) == ks[i] and not route_last:
                del pending[i]
            else:
                pending[i] = [token]
    return out


class BatchDrafter(Protocol):
    """Drafts for the batcher's requests (``specter/batching.py``): a draft here (``LocalDrafter``) or
    the draft process (``specter.remote.proposer.RemoteDrafter``). ``start`` gives a request's handle
    (its ``cached`` positions, its ``rollback``), ``propose`` drafts a round for several together."""

    def start(self, prompt_ids: list[int], sampling: SamplingConfig) -> Any:
        """A request joins: its draft cache over the prompt; returns its handle."""

    def begin_round(self, round_id: int) -> None:
        """Batched round ``round_id`` starts (before the policy hears of it)."""

    def propose(
        self, round_id: int, handles: list[Any], seqs: list[list[int]], ks: list[int], on_plan: OnPlan,
        route_last: bool,
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Each request's ``ks[i]`` draft tokens after ``seqs[i]``, drafted together."""

    def end(self, handle: Any) -> None:
        """A request left: drop its draft cache (never raises)."""


class LocalDrafter:
    """``BatchDrafter`` over a draft model in this process: a ``LocalProposer`` per request, each with
    its own cache and generator, the draft's weights shared."""

    def __init__(self, draft: Draft, clock: WallClock | None = None):
        self.draft, self.clock = draft, clock

    def start(self, prompt_ids: list[int], sampling: SamplingConfig) -> LocalProposer:
        proposer = LocalProposer(self.draft, self.clock, batched=True)
        proposer.prefill(prompt_ids, sampling)  # the draft is resident: one pass
        return proposer

    def begin_round(self, round_id: int) -> None:
        """Nothing: the round ids are the batcher's own."""

    def propose(
        self, round_id: int, handles: list[LocalProposer], seqs: list[list[int]], ks: list[int], on_plan: OnPlan,
        route_last: bool,
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        return propose_together(round_id, handles, seqs, ks, on_plan, route_last)

    def end(self, handle: LocalProposer) -> None:
        handle.cache = None
