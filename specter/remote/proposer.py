"""The verifier's stand-in for a local draft: asks the draft actor for each round's tokens.

Per round it sends one ``ProposeRequest`` (what to keep of the draft's cache, the tokens it has
not seen, K) and then reads the draft's ``PlanDelta``s as they arrive, handing each to the policy
at once, until the round's ``DraftTokens`` come. A rollback only updates the local mirror of the
draft's cache length; the draft crops when the next request says so. Messages of another round,
or not meant for the verifier, are counted in ``stale`` and logged at most once per second.

Pipelined (``propose(..., ahead=K')``): the draft drafts the next round while this one is verified.
After the verify pass ``ahead_stands`` says whether that round stands (every draft token accepted
and the target's next token the draft's guess); if so ``take_ahead`` collects it — its plan deltas
already here go to the policy together — and asks for the one after it; if not, the next
``propose`` throws it away on the draft's side, and its messages are dropped here as they come.

On the wire a round's id is the engine's round id plus a base that grows from request to request,
so a message left over from an earlier request (an optimistic round still in flight when its
request ended) can never pass for one of the running request's.

``RemoteDrafter`` is the batcher's drafter (``specter/batching.py``) over the same channel: each
batched request is started on the draft under an id of its own (``StartRequest.batched``), a round
asks for every drafting request's tokens in one ``ProposeBatch`` and reads each request's plan deltas
(to the policy as they come) and its ``DraftTokens``; a request that leaves is ended there
(``EndRequest``). Batched rounds take wire ids above every one used before, as a request does.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import msgspec
import torch

from specter.config import SamplingConfig
from specter.proposer import OnPlan, OnPlans
from specter.protocol import (
    AheadKeep,
    AheadStart,
    DraftTokens,
    EndRequest,
    Error,
    PlanDelta,
    ProposeBatch,
    ProposeItem,
    ProposeRequest,
    StartRequest,
)
from specter.remote.channel import Channel, ChannelError, DropLog
from specter.remote.peers import CHECK_S, Peer, PeerGone


class DraftError(RuntimeError):
    """The draft actor failed, or did not answer in time."""


class RemoteProposer:
    """Draft tokens from the draft actor over a ``pair`` channel (handshake done).

    Args:
        channel: the pair channel to the draft actor.
        timeout_s: longest wait for the draft's next message.

    Attributes:
        ahead_asked: optimistic rounds asked for in the running (or last) request.
        ahead_kept: those of them that stood.
        ahead_dropped: plan deltas of thrown-away optimistic rounds dropped: the draft steps wasted,
            as far as they reached the verifier.
    """

    pipelined = True  # it can have the next round drafted while this one is verified (``ahead``)

    def __init__(self, channel: Channel, timeout_s: float = 60.0):
        self.channel = channel
        self.timeout_s = timeout_s
        hello = channel.peer_hello  # the draft process, looked at while a wait hears nothing (``peers``)
        self.peer = Peer("draft", hello.pid if hello is not None else 0)
        self.cached = 0  # positions the draft's cache holds (mirrored)
        self._requests = 0
        self._ignore = DropLog("verifier: from the draft", ("stale",))
        self.stale = self._ignore.counts
        self._base = 0  # wire round id of the running request's round 0
        self._batching = False  # batched rounds (``begin_batched``) since the last request of its own
        self._next_base = 0  # above every wire round id used so far
        self._ahead: tuple[int, int, bool] | None = None  # the optimistic round asked for: (round, K, route_last)
        self._thrown: set[int] = set()  # the request's thrown-away optimistic rounds (wire ids)
        self.ahead_asked = self.ahead_kept = self.ahead_dropped = 0
        self.cold = 0  # the draft's steps that paid a one-off, as its latest tokens said (``DraftTokens.cold``)

    def prefill(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """Start a request on the draft (it prefills while the verifier goes on)."""
        self._new_base(0)
        self._requests += 1
        self._ahead = None
        self._thrown.clear()
        self.ahead_asked = self.ahead_kept = self.ahead_dropped = 0
        self.channel.send(
            StartRequest(
                f"r{self._requests}", list(prompt_ids), 1, sampling.temperature, sampling.top_p, sampling.top_k,
                sampling.seed,
            )
        )
        self.cached = len(prompt_ids)

    def propose(
        self, round_id: int, seq: list[int], k: int, on_plan: OnPlan, route_last: bool, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor]]:
        """K draft tokens after ``seq``; plan deltas reach ``on_plan`` as the draft sends them.
        With ``ahead``, the draft then drafts round ``round_id + 1`` (``ahead`` tokens) at once."""
        self._throw_ahead()
        wire = self._wire(round_id)
        self.channel.send(ProposeRequest(wire, self.cached, list(seq[self.cached :]), k, route_last, ahead))
        tokens = self._collect(wire, lambda delta: on_plan(self._local(delta)))
        return self._finish(wire, seq, k, route_last, ahead, tokens)

    def begin_batched(self, round_id: int) -> None:
        """Batched round ``round_id`` starts; after a request of its own (or none yet) the batched rounds
        take wire ids above every one used so far, counting on with the batcher's round ids."""
        if not self._batching:
            self._new_base(round_id)
            self._batching = True
        self._wire(round_id)

    def propose_batch(
        self, round_id: int, items: list[ProposeItem], on_plan: OnPlan, route_last: bool,
    ) -> dict[str, DraftTokens]:
        """Round ``round_id`` drafted for ``items`` together: each request's plan deltas reach
        ``on_plan`` as they come; returns each request's ``DraftTokens`` by id."""
        wire = self._wire(round_id)
        self.channel.send(ProposeBatch(wire, items, route_last))
        answers: dict[str, DraftTokens] = {}
        while len(answers) < len(items):
            msg = self._wait(wire, "answer")
            if isinstance(msg, PlanDelta):
                on_plan(self._local(msg))
            elif isinstance(msg, DraftTokens):
                answers[msg.request_id] = msg
        if set(answers) != {item.request_id for item in items}:
            raise DraftError(f"draft: round {wire} answered for {sorted(answers)}, "
                             f"asked for {[item.request_id for item in items]}")
        return answers

    def _new_base(self, round_id: int) -> None:
        """Wire ids from above every one used so far (round ``round_id`` takes the first); what an
        earlier request left on the socket is dropped."""
        self._throw_ahead()  # an optimistic round still open when the last request ended
        while (stale := self.channel.recv(0)) is not None:  # left over by a request that ended
            self._drop(stale, -1)
        self._base = self._next_base - round_id
        self._batching = False

    def ahead_stands(self, all_accepted: bool, token: int) -> bool:
        """After the verify pass: whether the optimistic round asked for stands — every draft token
        was accepted and the target's next token ``token`` is the one the draft assumed."""
        if self._ahead is None:
            return False
        if all_accepted and self._expect_start(self._ahead[0]).bonus == token:
            return True
        self._throw_ahead()
        return False

    def take_ahead(
        self, round_id: int, seq: list[int], on_plans: OnPlans, ahead: int = 0
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The optimistic round that stands (``ahead_stands``) as round ``round_id``'s draft; ``seq``
        now ends with the token it assumed. Its plan deltas already here reach ``on_plans`` in one
        call, later ones one per call. With ``ahead``, the draft drafts the round after it too."""
        wire = self._wire(round_id)
        assert self._ahead is not None and self._ahead[0] == wire, "take_ahead() after ahead_stands()"
        _, k, route_last = self._ahead
        self.ahead_kept += 1
        self.channel.send(AheadKeep(wire, ahead))
        early: list[PlanDelta] = []  # what came during the verify pass
        msg = self._read(wire, 0.0)
        while isinstance(msg, PlanDelta):
            early.append(self._local(msg))
            msg = self._read(wire, 0.0)
        if early:
            on_plans(early)
        tokens = msg if isinstance(msg, DraftTokens) else self._collect(wire, lambda d: on_plans([self._local(d)]))
        return self._finish(wire, seq, k, route_last, ahead, tokens)

    def rollback(self, length: int) -> None:
        """The draft keeps only ``length`` positions (sent with the next request)."""
        self.cached = min(self.cached, length)

    def wire_id(self, round_id: int) -> int:
        """Round ``round_id`` of the running request as the draft's messages name it."""
        return self._base + round_id

    def _wire(self, round_id: int) -> int:
        wire = self._base + round_id
        self._next_base = max(self._next_base, wire + 2)  # + 2: the optimistic round after it
        return wire

    def _local(self, delta: PlanDelta) -> PlanDelta:
        """A plan delta with the engine's round id."""
        return msgspec.structs.replace(delta, round=delta.round - self._base)

    def _finish(
        self, wire: int, seq: list[int], k: int, route_last: bool, ahead: int, tokens: DraftTokens
    ) -> tuple[list[int], list[torch.Tensor]]:
        drafted = _drafted(tokens, k, f"round {wire}")
        self.cold = tokens.cold  # a draft process started anew counts from 0: a change, as a growth is
        self.cached = _cached_after(seq, k, route_last)
        self._ahead = (wire + 1, ahead, route_last) if ahead else None
        self.ahead_asked += bool(ahead)
        return drafted

    def _throw_ahead(self) -> None:
        """The optimistic round asked for does not stand: its messages are dropped from now on (the
        draft throws it away when it reads the next request)."""
        if self._ahead is not None:
            self._thrown.add(self._ahead[0])
            self._ahead = None

    def _expect_start(self, wire: int) -> AheadStart:
        while not isinstance(msg := self._wait(wire, "AheadStart"), AheadStart):
            pass  # a plan delta before the round's start: none is sent
        return msg

    def _collect(self, wire: int, on_plan: OnPlan) -> DraftTokens:
        while not isinstance(msg := self._wait(wire, "answer"), DraftTokens):
            if isinstance(msg, PlanDelta):
                on_plan(msg)
        return msg

    def _wait(self, wire: int, what: str) -> PlanDelta | DraftTokens | AheadStart:
        """The next message of round ``wire`` within ``timeout_s``, else ``DraftError``."""
        msg = self._read(wire, self.timeout_s)
        if msg is None:
            raise DraftError(f"draft: no {what} for round {wire} within {self.timeout_s:.1f}s")
        return msg

    def _read(self, wire: int, timeout_s: float) -> PlanDelta | DraftTokens | AheadStart | None:
        """The next message of round ``wire`` (None when none came within ``timeout_s``); an
        ``Error`` raises ``DraftError``, messages of other rounds are dropped (``_drop``). While
        nothing comes it looks at the draft's process every ``CHECK_S``: gone, ``DraftError`` at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            msg = self.channel.recv(max(min(remaining, CHECK_S), 0.0))
            if msg is None:
                if remaining <= CHECK_S:
                    return None
                try:
                    self.peer.check(f"round {wire} was awaited")
                except PeerGone as exc:
                    raise DraftError(f"draft: {exc}") from None
                continue
            if isinstance(msg, PlanDelta | DraftTokens | AheadStart) and msg.round == wire:
                return msg
            if isinstance(msg, Error):
                raise DraftError(f"draft: {msg.where}: {msg.message}")
            self._drop(msg, wire)

    def _drop(self, msg: object, wire: int) -> None:
        """A message that is not for round ``wire``: quietly when it belongs to a thrown-away
        optimistic round or to an earlier request, else counted as stale."""
        round_id = getattr(msg, "round", None)
        if isinstance(round_id, int) and (round_id in self._thrown or round_id < self._base):
            self.ahead_dropped += isinstance(msg, PlanDelta)
        else:
            self._ignore("stale", f"a {type(msg).__name__} that is not for round {wire}")


@dataclass(eq=False)
class RemoteDraftRequest:
    """The verifier's mirror of one batched request's draft: its id there and its cache's length."""

    request_id: str
    cached: int

    def rollback(self, length: int) -> None:
        """Only ``length`` positions stand (the draft crops when the next round says so)."""
        self.cached = min(self.cached, length)


class RemoteDrafter:
    """The batcher's drafter (``specter.batch_draft.BatchDrafter``) over the draft process.

    Args:
        proposer: the verifier's ``RemoteProposer`` (its channel, and its wire ids, which the
            ``RemotePolicy``'s round messages name).
    """

    def __init__(self, proposer: RemoteProposer):
        self.proposer = proposer
        self.started = 0  # batched requests started (their ids on the draft: b1, b2, …)

    def start(self, prompt_ids: list[int], sampling: SamplingConfig) -> RemoteDraftRequest:
        self.started += 1
        handle = RemoteDraftRequest(f"b{self.started}", len(prompt_ids))
        self.proposer.channel.send(StartRequest(handle.request_id, list(prompt_ids), 1, sampling.temperature,
                                                sampling.top_p, sampling.top_k, sampling.seed, batched=True))
        return handle

    def begin_round(self, round_id: int) -> None:
        self.proposer.begin_batched(round_id)

    def propose(
        self, round_id: int, handles: list[RemoteDraftRequest], seqs: list[list[int]], ks: list[int],
        on_plan: OnPlan, route_last: bool,
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        items = [ProposeItem(h.request_id, h.cached, list(seq[h.cached:]), k)
                 for h, seq, k in zip(handles, seqs, ks, strict=True) if k > 0]
        answers = self.proposer.propose_batch(round_id, items, on_plan, route_last) if items else {}
        out: list[tuple[list[int], list[torch.Tensor]]] = []
        for handle, seq, k in zip(handles, seqs, ks, strict=True):
            if k == 0:
                out.append(([], []))
                continue
            out.append(_drafted(answers[handle.request_id], k, f"request {handle.request_id}"))
            handle.cached = _cached_after(seq, k, route_last)
        return out

    def end(self, handle: RemoteDraftRequest) -> None:
        """Tell the draft to drop the request's cache; a draft that does not read is not waited for."""
        with contextlib.suppress(ChannelError):
            self.proposer.channel.send(EndRequest(handle.request_id), timeout_s=0)


def _drafted(tokens: DraftTokens, k: int, what: str) -> tuple[list[int], list[torch.Tensor]]:
    """The draft tokens of an answer and their dense q rows (sampled); ``DraftError`` unless it has ``k``."""
    if len(tokens.tokens) != k:
        raise DraftError(f"draft: {what} returned {len(tokens.tokens)} tokens, asked for {k}")
    return list(tokens.tokens), [torch.from_numpy(row.to_dense(tokens.vocab_size)) for row in tokens.q]


def _cached_after(seq: list[int], k: int, route_last: bool) -> int:
    """Positions the draft's cache holds after a round of ``k`` drafts after ``seq``: the sequence but its
    last token's successor, the K - 1 drafts it fed, and the K-th with ``route_last``."""
    return len(seq) + k - 1 + (1 if route_last else 0)
