"""The actors' messages over a plain Channel, and the draft server refusing what does not fit."""

from __future__ import annotations

import uuid

import msgpack
import pytest
import torch

from specter.protocol import (
    MALFORMED,
    UNKNOWN,
    DraftTokens,
    DropFetch,
    Error,
    FetchExpert,
    LinkTiming,
    PlanDelta,
    PromoteFetch,
    ProposeRequest,
    Shutdown,
    StartRequest,
)
from specter.remote.channel import Channel
from specter.remote.draft_server import FAILED, OUT_OF_RANGE, UNEXPECTED, DraftServer

SAMPLES = [
    ProposeRequest(3, 10, [5, 6], 4, True),
    FetchExpert(7, 1, 2, 5, 0, False),
    PromoteFetch(7),
    DropFetch(8),
    LinkTiming(False),
    PlanDelta(3, 0, [1], [[2, 3]], [[0.5, 0.5]]),
    Shutdown("bye"),
]


def test_a_plain_channel_carries_actor_messages_and_drops_garbage() -> None:
    with Channel("pair", "inproc://actor-msg-test", bind=True) as a, Channel(
        "pair", "inproc://actor-msg-test", bind=False
    ) as b:
        b.socket.send(msgpack.packb(["nonsense", 1]))
        b.socket.send(msgpack.packb(["fetch", 1, 0, 0, 0, 2]))  # priority is 0 or 1
        for msg in SAMPLES:
            b.send(msg)
        assert [a.recv(60) for _ in SAMPLES] == SAMPLES  # 60 s: only a hang reaches it
        assert (a.dropped[UNKNOWN], a.dropped[MALFORMED], a.received) == (1, 1, len(SAMPLES))


class _Config:
    vocab_size, max_position_embeddings = 16, 12


class _Draft:
    """Records what it is asked to run; indexes a 16-token embedding as a real draft would."""

    def __init__(self) -> None:
        self.model = type("M", (), {"config": _Config()})()
        self.embedding = torch.zeros(16, 2)
        self.inputs: list[list[int]] = []

    @property
    def last_routing(self) -> dict:
        return {0: (torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))}

    @property
    def last_compute(self) -> dict:
        return {0: "int4"}

    def new_cache(self) -> object:
        return object()

    def forward(self, input_ids: torch.Tensor, cache) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.inputs.append(input_ids[0].tolist())
        self.embedding[input_ids]  # an out-of-range id would raise IndexError here
        logits = torch.zeros(1, input_ids.shape[1], 16)
        logits[..., 3] = 1.0
        return logits


@pytest.fixture()
def served():  # type: ignore[no-untyped-def]
    # A fresh name each time: ZeroMQ releases a closed socket's inproc name asynchronously.
    name = f"inproc://draft-srv-{uuid.uuid4().hex}"
    with Channel("pair", name, bind=True) as a, Channel("pair", name, bind=False) as b:
        draft = _Draft()
        yield DraftServer(draft, a), draft, b


def test_draft_refuses_ids_that_do_not_fit_before_running_anything(served, monkeypatch) -> None:
    server, draft, verifier = served
    monkeypatch.setattr("specter.proposer.crop_cache", lambda cache, n: None)
    bad = [
        ProposeRequest(0, 0, [1], 2),  # before any StartRequest
        StartRequest("r", [1, 16], 4),  # token 16 >= vocab 16
        StartRequest("r", list(range(13)), 4),  # 13 positions > 12
    ]
    for msg in bad:
        assert server.handle(msg)
    assert draft.inputs == []
    assert server.handle(StartRequest("r", [1, 2, 3], 4))
    assert draft.inputs == [[1, 2, 3]]
    for msg in (
        ProposeRequest(0, 4, [5], 2),  # keep past the 3 positions the cache holds
        ProposeRequest(0, 3, [99], 2),  # token outside the vocabulary
        ProposeRequest(0, 3, [5], 9, True),  # 3 kept + 1 fed + 8 drafted + the routed last = 13 > 12
    ):
        assert server.handle(msg)
    assert server.handle(FetchExpert(1, 0, 0, 0, 0))  # for the transfer actor
    assert draft.inputs == [[1, 2, 3]]
    assert server.rejections == {OUT_OF_RANGE: 6, UNEXPECTED: 1, FAILED: 0}
    errors = [verifier.recv(60) for _ in range(6)]
    assert all(isinstance(e, Error) and e.where == "draft" for e in errors), errors
    assert server.handle(ProposeRequest(0, 3, [5], 2))  # a fitting one still drafts
    replies = [verifier.recv(60) for _ in range(3)]
    assert isinstance(replies[-1], DraftTokens) and replies[-1].tokens == [3, 3]


def test_draft_answers_without_waiting_and_never_stops_on_a_full_queue(served) -> None:
    server, _, _ = served
    for _ in range(3000):  # far beyond ZeroMQ's default queue of 1000 frames each way
        assert server.handle(ProposeRequest(0, 0, [1], 2))
    assert server.rejections[OUT_OF_RANGE] == 3000 and server.unsent > 0
    assert not server.handle(Shutdown())


def test_the_draft_tells_the_verifier_its_one_off_steps(served, monkeypatch) -> None:
    """``DraftTokens.cold``: the draft's steps that ran a token count first or captured its CUDA graphs
    (``GraphedStep.cold``), so the verifier's K chooser learns no cost from the round they fell in."""
    server, draft, verifier = served
    monkeypatch.setattr("specter.proposer.crop_cache", lambda cache, n: None)
    assert server.handle(StartRequest("r", [1, 2, 3], 8))
    assert server.handle(ProposeRequest(0, 3, [5], 2))
    first = [verifier.recv(60) for _ in range(3)][-1]
    draft.graphed = type("G", (), {"cold": 4})()  # as a graphed draft's step counts them
    assert server.handle(ProposeRequest(1, 5, [3], 2))
    second = [verifier.recv(60) for _ in range(3)][-1]
    assert isinstance(first, DraftTokens) and isinstance(second, DraftTokens)
    assert (first.cold, second.cold) == (0, 4)
