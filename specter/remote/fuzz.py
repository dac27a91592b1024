"""A seeded fuzzer for the plan plane's sockets (issue 8): garbage in, counted drops out.

:class:`FrameFuzzer` makes frames that a peer should never send: random bytes, truncated and
bit-flipped messages, wrong field types, huge length headers, deeply nested arrays, unknown tags,
ids outside the wire's ranges, structs whose ids name nothing in the engine (a layer, expert, slot,
token or transfer it does not have), another protocol version, and well-formed messages at the
wrong time or for another actor. A few stray but fitting draft requests (``stray_valid``) go to
the draft too.

What it never sends is a well-formed command the actor would rightly obey and that changes the
engine: ``Shutdown``, a ``FetchExpert`` into a real slot, a promote/drop of a transfer id the
verifier may have issued, ``LinkTiming(False)``, the round's schedule messages (``UsePolicy``,
``RoundStart``, a ``LayerNeeds`` that names real experts, …). Plan deltas of a round that is not
running it does send: the schedule holds a few rounds ahead and drops the rest (they move experts
at most, never tokens). The plan plane has no authentication: any
process of the same user can reach its 0700 ipc directory and command the actors (as it could
ptrace them), so such frames test nothing about robustness (docs/security.md). Every frame is
decoded here before it is sent, so a bit flip that happens to make one of them is replaced.

Sending them to a launched replica and reading what each actor counted:
``specter/remote/fuzz_replica.py`` (``fuzz_engine``); ``scripts/fuzz_wire.py`` is the command line.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack

from specter import protocol as P

ID_FLOOR = 1 << 30  # promote/drop ids from here up: far above any transfer id a verifier issues
VALID_RATE = 0.002  # share of stray but fitting draft requests (they make the draft work)


@dataclass(frozen=True)
class Target:
    """What one fuzzed actor accepts (read from the running actor).

    Attributes:
        role: ``transfer`` or ``draft``.
        layers: MoE layer ids (transfer).
        num_experts: routed experts per layer (transfer).
        num_slots: shared slots (transfer).
        vocab_size: token ids are below this (draft).
        max_positions: positions the draft holds (draft).
    """

    role: str
    layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_slots: int = 0
    vocab_size: int = 0
    max_positions: int = 0


class FrameFuzzer:
    """Seeded bad frames for one actor's socket; ``frame()`` returns ``(category, parts)``.

    Args:
        target: the actor's ranges.
        seed: the random seed (the same seed gives the same frames).
    """

    def __init__(self, target: Target, seed: int):
        self.t, self.rng = target, random.Random(seed)
        self.valid = [P.encode(m) for m in self._valid_looking()]
        self.makers = [
            self._random_bytes, self._truncated, self._bit_flipped, self._wrong_types, self._huge_length,
            self._deep, self._unknown_tag, self._wire_range, self._engine_range, self._wrong_version,
            self._out_of_order, self._multipart,
        ]
        self.skipped = 0  # frames that came out as commands the actor would obey, replaced

    def frame(self) -> tuple[str, list[bytes]]:
        """One frame (a list of ZeroMQ parts; more than one only for ``multipart``)."""
        if self.t.role == "draft" and self.rng.random() < VALID_RATE:
            return "stray_valid", [P.encode(self._stray_request())]
        while True:
            maker = self.rng.choice(self.makers)
            parts = maker()
            if len(parts) > 1 or not self._obeyed(parts[0]):
                return maker.__name__.lstrip("_"), parts
            self.skipped += 1

    # -- the categories ---------------------------------------------------------------------
    def _random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randrange(0, 96))]

    def _truncated(self) -> list[bytes]:
        frame = self.rng.choice(self.valid)
        return [frame[: self.rng.randrange(0, len(frame))]]

    def _bit_flipped(self) -> list[bytes]:
        frame = bytearray(self.rng.choice(self.valid))
        for _ in range(self.rng.randrange(1, 4)):
            frame[self.rng.randrange(len(frame))] ^= 1 << self.rng.randrange(8)
        return [bytes(frame)]

    def _wrong_types(self) -> list[bytes]:
        raw = msgpack.unpackb(self.rng.choice(self.valid))
        i = self.rng.randrange(1, len(raw)) if len(raw) > 1 else 0
        raw[i] = self.rng.choice([None, "x", -1, 2**40, 1.5, [None], {"a": 1}, b"\xff", [[-1]], True, 2**64 - 1])
        return [msgpack.packb(raw)]

    def _huge_length(self) -> list[bytes]:
        header, width = self.rng.choice([(b"\xdd", 4), (b"\xdc", 2), (b"\xdb", 4), (b"\xc6", 4), (b"\xdf", 4)])
        size = self.rng.choice([2**32 - 1, 2**31, 65535, 10**9]) % (1 << (8 * width))
        lead = self.rng.choice([b"", b"\x92\xa5fetch", b"\x96\xa7propose\x00\x00", b"\x93\xa4plan"])
        return [lead + header + size.to_bytes(width, "big") + self.rng.randbytes(self.rng.randrange(0, 16))]

    def _deep(self) -> list[bytes]:
        depth = self.rng.choice([64, 1000, 100_000])
        lead = self.rng.choice([b"", b"\x92\xa4drop", b"\x96\xa5fetch\x00\x00\x00"])
        return [lead + b"\x91" * depth + b"\x00"]

    def _unknown_tag(self) -> list[bytes]:
        tag = self.rng.choice(["", "fetchx", "FETCH", "propose2", "\u00e9", "x" * 300])
        return [msgpack.packb([tag, 1, [2]])]

    def _wire_range(self) -> list[bytes]:
        bad = self.rng.choice([-1, -(2**63), 2**31, 2**64 - 1])
        raw = self.rng.choice(
            [["fetch", bad, 0, 0, 0, 1], ["fetch", 0, bad, 0, 0, 1], ["fetch", 0, 0, bad, 0, 1],
             ["fetch", 0, 0, 0, bad, 1], ["fetch", 0, 0, 0, 0, bad], ["promote", bad], ["drop", bad],
             ["propose", bad, 0, [1], 2], ["propose", 0, bad, [1], 2], ["propose", 0, 0, [bad], 2],
             ["propose", 0, 0, [1], bad], ["start", "r", [bad], 4], ["plan", bad, 0, [1], [[1]], [[0.5]]],
             ["plan", 0, bad, [1], [[1]], [[0.5]]], ["plan", 0, 0, [bad], [[1]], [[0.5]]], ["draft", bad, [1]]]
        )
        return [msgpack.packb(raw)]

    def _engine_range(self) -> list[bytes]:
        """Structs that decode but name nothing the engine has."""
        t, rng, big = self.t, self.rng, self.rng.choice([1, 7, 1000, P.MAX_ID - 1])
        if t.role == "transfer":
            layer, expert, slot = rng.choice(t.layers), rng.randrange(t.num_experts), rng.randrange(t.num_slots)
            which = rng.randrange(5)
            if which == 0:
                layer = _not_in(t.layers, rng)
            elif which == 1:
                expert = t.num_experts - 1 + big
            elif which == 2:
                slot = t.num_slots - 1 + big
            else:
                unknown = rng.randrange(ID_FLOOR, P.MAX_ID)
                return [P.encode(P.PromoteFetch(unknown) if rng.random() < 0.5 else P.DropFetch(unknown))]
            if which == 2 or rng.random() < 0.5:
                return [P.encode(P.FetchExpert(rng.randrange(P.MAX_ID), layer, expert, slot, rng.randrange(2)))]
            # the schedule's messages naming a layer or expert the engine does not have
            schedule: list[P.Message] = [
                P.LayerNeeds(layer, rng.randrange(P.MAX_ID), [expert]), P.LayerNeeds(layer, 1, [], [expert]),
                P.FetchLater(layer, [expert]), P.PlanDelta(rng.randrange(P.MAX_ID), 0, [layer], [[expert]], [[0.5]]),
            ]
            return [P.encode(rng.choice(schedule))]
        token = min(t.vocab_size - 1 + big, P.MAX_ID)
        beyond = min(t.max_positions + big, P.MAX_TOKENS)  # positions the draft does not have
        choices: list[P.Message] = [
            P.StartRequest("fuzz", [1, token], 4),
            P.ProposeRequest(rng.randrange(P.MAX_ID), 0, [token], 2),
            P.ProposeRequest(0, beyond, [1], 2),  # keep past what the cache holds
            P.StartRequest("fuzz-b", [1, token], 4, batched=True),
            P.ProposeBatch(rng.randrange(P.MAX_ID), [P.ProposeItem("fuzz-never-started", 0, [1], 2)]),
        ]
        if t.max_positions < 4096:  # small enough to spell out
            choices.append(P.StartRequest("fuzz", [1] * (t.max_positions + rng.choice([1, 7])), 4))
        if t.max_positions < P.MAX_WINDOW:
            choices.append(P.ProposeRequest(0, 0, [1], P.MAX_WINDOW))
        return [P.encode(rng.choice(choices))]

    def _wrong_version(self) -> list[bytes]:
        version = self.rng.choice([0, P.PROTOCOL_VERSION - 1, P.PROTOCOL_VERSION + 1, P.MAX_ID])
        if version == P.PROTOCOL_VERSION:
            version = 0
        hello: list[P.Message] = [P.Hello(version, "fuzz", 1), P.Welcome(version, "fuzz")]
        msg = self.rng.choice(hello)
        return [P.encode(msg)]

    def _out_of_order(self) -> list[bytes]:
        """Well-formed messages for another actor or another moment."""
        others: list[P.Message] = [
            P.Hello(P.PROTOCOL_VERSION, "fuzz", 1), P.Welcome(P.PROTOCOL_VERSION, "fuzz"),
            P.PlanDelta(self.rng.randrange(P.MAX_ID), 0, [1], [[2]], [[0.5]]), P.DraftTokens(3, [1, 2]),
            P.Shutdown("not really"), P.Error("fuzz", "not really"), P.AheadStart(3, 1),
            P.AheadKeep(self.rng.randrange(P.MAX_ID), self.rng.randrange(3)),  # no round of that id is open
        ]
        if self.t.role == "transfer":
            others += [P.StartRequest("r", [1], 1), P.ProposeRequest(0, 0, [1], 1), P.LinkTiming(True),
                       P.ProposeBatch(0, [P.ProposeItem("r", 0, [1], 1)]), P.EndRequest("r")]
        else:
            others += [P.FetchExpert(0, 0, 0, 0, 0), P.PromoteFetch(0), P.DropFetch(0), P.LinkTiming(False),
                       P.UsePolicy("demand-lru"), P.ResetSlots(), P.RequestStart(), P.RoundStart(0, 0, 2),
                       P.VerifyStart(0, 3), P.LayerNeeds(0, 1, [0]), P.RoundEnd(0, 1, [0], [[1]]),
                       P.FetchLater(0, [1]), P.Replay()]
        return [P.encode(self.rng.choice(others))]

    def _multipart(self) -> list[bytes]:
        return [self.rng.choice(self.valid) for _ in range(self.rng.randrange(2, 4))]

    # -- helpers ------------------------------------------------------------------------------
    def _valid_looking(self) -> list[P.Message]:
        return [
            P.FetchExpert(ID_FLOOR, 1, 2, 3, 1), P.PromoteFetch(ID_FLOOR), P.DropFetch(ID_FLOOR + 1),
            P.ProposeRequest(3, 1, [5, 6], 4, True), P.StartRequest("r", [1, 2, 3], 8),
            P.PlanDelta(3, 1, [0, 2], [[1, 5], [7, 0]], [[0.75, 0.25], [0.5, 0.5]]),
            P.Hello(P.PROTOCOL_VERSION, "fuzz", 7), P.DraftTokens(4, [3, 7]), P.Shutdown("fuzz"),
            P.LinkTiming(True), P.ProposeRequest(5, 2, [1], 2, False, 3), P.AheadStart(6, 2), P.AheadKeep(6, 1),
        ]

    def _stray_request(self) -> P.Message:
        """A request that fits the draft, sent between requests: the draft runs it, then the next
        real ``StartRequest`` resets its cache."""
        tokens = [self.rng.randrange(self.t.vocab_size) for _ in range(self.rng.randrange(1, 5))]
        if self.rng.random() < 0.5:
            return P.StartRequest("fuzz", tokens, 1)
        ahead = self.rng.choice([0, 0, 2])  # a round drafted ahead stays open until the next message
        return P.ProposeRequest(self.rng.randrange(P.MAX_ID - 1), 0, tokens, self.rng.randrange(1, 4), False, ahead)

    def _obeyed(self, frame: bytes) -> bool:
        """Whether the actor would rightly obey this frame in a way that changes the engine."""
        try:
            msg = P.decode(frame)
        except P.ProtocolError:
            return False
        if isinstance(msg, P.Shutdown):
            return True
        if self.t.role == "draft":
            return False
        if isinstance(msg, P.FetchExpert):
            return msg.layer in self.t.layers and msg.expert < self.t.num_experts and msg.slot < self.t.num_slots
        if isinstance(msg, P.PromoteFetch | P.DropFetch):
            return msg.id < ID_FLOOR
        if isinstance(msg, P.UsePolicy | P.ResetSlots | P.RequestStart | P.RoundStart | P.VerifyStart | P.RoundEnd
                      | P.Replay):
            return True  # the round's messages: obeyed as the verifier's
        if isinstance(msg, P.LayerNeeds | P.FetchLater):
            experts = [*msg.wait, *msg.ready, *msg.host] if isinstance(msg, P.LayerNeeds) else msg.experts
            return msg.layer in self.t.layers and all(e < self.t.num_experts for e in experts)
        return isinstance(msg, P.LinkTiming) and not msg.timed


def _not_in(layers: tuple[int, ...], rng: random.Random) -> int:
    while (layer := rng.choice([rng.randrange(64), rng.randrange(P.MAX_ID)])) in layers:
        pass
    return layer
