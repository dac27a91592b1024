"""Actor messages: round trips, base messages still read, garbage refused, over an ActorChannel."""

from __future__ import annotations

import msgpack
import pytest

from specter.actor_channel import ActorChannel
from specter.actor_messages import DropFetch, FetchExpert, PromoteFetch, ProposeRequest, decode, encode
from specter.protocol import MALFORMED, UNKNOWN, PlanDelta, ProtocolError, Shutdown

SAMPLES = [
    ProposeRequest(3, 10, [5, 6], 4, True),
    FetchExpert(7, 1, 2, 5, 0, False),
    PromoteFetch(7),
    DropFetch(8),
    PlanDelta(3, 0, [1], [[2, 3]], [[0.5, 0.5]]),
    Shutdown("bye"),
]


@pytest.mark.parametrize("msg", SAMPLES)
def test_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (msgpack.packb(["fetch", -1, 0, 0, 0, 0]), MALFORMED),
        (msgpack.packb(["fetch", 1, 0, 0, 0, 2]), MALFORMED),  # priority is 0 or 1
        (msgpack.packb(["propose", 0, 0, [], 0]), MALFORMED),  # k >= 1
        (msgpack.packb(["nonsense", 1]), UNKNOWN),
        (b"\xc1garbage", MALFORMED),
    ],
)
def test_invalid_frames_raise_protocol_error(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.reason == reason


def test_actor_channel_carries_both_and_drops_garbage() -> None:
    with ActorChannel("pair", "inproc://actor-msg-test", bind=True) as a, ActorChannel(
        "pair", "inproc://actor-msg-test", bind=False
    ) as b:
        b.socket.send(msgpack.packb(["nonsense", 1]))
        for msg in SAMPLES:
            b.send(msg)
        assert [a.recv(2) for _ in SAMPLES] == SAMPLES
        assert a.dropped[UNKNOWN] == 1
