"""The wire structs: round trips, the plain-msgpack layout, validation, and a seeded fuzz."""

from __future__ import annotations

import ast
import random
import typing
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest

from specter import protocol as P


def _q_row() -> P.SparseProbs:
    row = np.zeros(50, dtype=np.float32)
    row[[3, 7, 41]] = [0.25, 0.5, 0.25]
    return P.SparseProbs.from_dense(row)


SAMPLES: list[P.Message] = [
    P.Hello(P.PROTOCOL_VERSION, "draft", 1234),
    P.Welcome(P.PROTOCOL_VERSION, "transfer"),
    P.PlanDelta(3, 1, [0, 2], [[1, 5], [7, 0]], [[0.75, 0.25], [0.5, 0.5]]),
    P.DraftTokens(3, [7, 41]),
    P.DraftTokens(4, [3, 7], [_q_row(), _q_row()], 50),
    P.DraftTokens(5, [7], [], 0, "b3"),
    P.StartRequest("req-1", [1, 2, 3], 16, 0.7, 0.9, 40, 1234, 4),
    P.StartRequest("req-2", [9], 8),
    P.StartRequest("b3", [9, 4], 8, batched=True),
    P.EndRequest("b3"),
    P.Shutdown("bye"),
    P.Error("verifier.layer3", "expert (3, 5) missing"),
    P.ProposeRequest(3, 10, [5, 6], 4, True),
    P.ProposeRequest(0, 0, [1], 1),
    P.ProposeRequest(5, 12, [7], 8, False, 6),
    P.ProposeBatch(7, [P.ProposeItem("b3", 2, [4, 5], 3), P.ProposeItem("b4", 0, [1], 1)], True),
    P.AheadStart(6, 41),
    P.AheadKeep(6, 8),
    P.AheadKeep(9),
    P.FetchExpert(7, 1, 2, 5, 0, False),
    P.FetchExpert(8, 0, 3, 1, 1),
    P.PromoteFetch(7),
    P.DropFetch(8),
    P.LinkTiming(False),
    P.UsePolicy("specter+fixed", "qwen2moe-pcie4"),
    P.UsePolicy(""),
    P.ResetSlots(),
    P.RequestStart(),
    P.RoundStart(3, 1027, 8),
    P.RoundStart(4, 1028, 8, 19),
    P.VerifyStart(3, 9),
    P.LayerNeeds(2, 41, [1, 5], [0], [7]),
    P.RoundEnd(3, 2, [0, 2], [[1, 5], [0]]),
    P.FetchLater(2, [7]),
    P.Replay(),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(P.MESSAGE_TYPES)
    assert len(P.TAGS) == len(P.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_plain_msgpack_reads_tag_then_fields(msg: P.Message) -> None:
    raw = msgpack.unpackb(P.encode(msg))
    fields = [msgspec.to_builtins(getattr(msg, f), builtin_types=(bytes,)) for f in msg.__struct_fields__]
    assert raw == [msg.__struct_config__.tag, *fields]


def test_plain_msgpack_layout_by_hand() -> None:
    plan = SAMPLES[2]
    assert msgpack.unpackb(P.encode(plan)) == [
        "plan",
        3,
        1,
        [0, 2],
        [[1, 5], [7, 0]],
        [[0.75, 0.25], [0.5, 0.5]],
    ]
    draft = msgpack.unpackb(P.encode(SAMPLES[4]))
    assert draft[:3] == ["draft", 4, [3, 7]] and draft[4] == 50
    ids, probs = draft[3][0]
    assert np.frombuffer(ids, "<i4").tolist() == [3, 7, 41]
    assert np.frombuffer(probs, "<f4").tolist() == [0.25, 0.5, 0.25]


def test_a_plain_msgpack_peer_can_write_messages() -> None:
    assert P.decode(msgpack.packb(["drop", 3])) == P.DropFetch(3)
    assert P.decode(msgpack.packb(["fetch", 1, 2, 3, 4, 1])) == P.FetchExpert(1, 2, 3, 4, 1, True)
    assert P.decode(msgpack.packb(["propose", 1, 2, [3], 4])) == P.ProposeRequest(1, 2, [3], 4, False)
    # trailing fields a newer peer appended are ignored; missing defaulted ones take defaults
    assert P.decode(msgpack.packb(["promote", 5, "new-field"])) == P.PromoteFetch(5)
    assert P.decode(msgpack.packb(["start", "r", [1], 4])) == P.StartRequest("r", [1], 4)


def test_sparse_probs_round_trip_dense() -> None:
    row = np.random.default_rng(0).dirichlet(np.ones(64)).astype(np.float32)
    row[row < 0.01] = 0
    assert np.array_equal(P.SparseProbs.from_dense(row).to_dense(64), row)


BAD = {
    "negative layer": ["plan", 0, 0, [-1], [[1]], [[1.0]]],
    "negative expert": ["plan", 0, 0, [1], [[-3]], [[1.0]]],
    "id too large": ["plan", 0, 1, [2**31], [[1]], [[1.0]]],
    "NaN weight": ["plan", 0, 0, [1], [[1]], [[float("nan")]]],
    "inf weight": ["plan", 0, 0, [1], [[1]], [[float("inf")]]],
    "ragged plan": ["plan", 0, 0, [1, 2], [[1]], [[1.0]]],
    "ragged experts/probs": ["plan", 0, 0, [1], [[1, 2]], [[1.0]]],
    "bool as int": ["drop", True],
    "float as int": ["drop", 1.5],
    "string as list": ["plan", 0, 1, "abc", [[1]], [[1.0]]],
    "empty prompt": ["start", "r", [], 4],
    "top_p zero": ["start", "r", [1], 4, 1.0, 0.0],
    "temperature denormal": ["start", "r", [1], 4, 5e-324],  # 0 in float32: logits / 0
    "temperature tiny": ["start", "r", [1], 4, 1e-9],  # overflows float32 logits
    "too many ids": ["plan", 0, 1, [0] * (P.MAX_LIST + 1), [[1]], [[1.0]]],
    "missing field": ["plan", 0, 1, [1], [[1]]],
    "q rows != tokens": ["draft", 0, [1, 2], [[b"\0\0\0\0", b"\0\0\x80?"]], 10],
    "q id out of vocab": ["draft", 0, [1], [[b"\x0b\0\0\0", b"\0\0\x80?"]], 10],
    "q prob > 1": ["draft", 0, [1], [[b"\1\0\0\0", b"\0\0\0@"]], 10],
    "q odd bytes": ["draft", 0, [1], [[b"\1\0\0", b"\0\0\x80"]], 10],
    "token out of vocab": ["draft", 0, [10], [[b"\1\0\0\0", b"\0\0\x80?"]], 10],
    "map not array": {"tag": "drop", "id": 1},
    "empty array": [],
    "tag not string": [7, 1],
    "fetch negative id": ["fetch", -1, 0, 0, 0, 0],
    "fetch negative slot": ["fetch", 1, 0, 0, -5, 0],
    "fetch layer too large": ["fetch", 1, 2**31, 0, 0, 0],
    "fetch priority 2": ["fetch", 1, 0, 0, 0, 2],
    "fetch timed not bool": ["fetch", 1, 0, 0, 0, 0, 1],
    "propose k zero": ["propose", 0, 0, [1], 0],
    "propose k too large": ["propose", 0, 0, [1], P.MAX_WINDOW + 1],
    "propose no tokens": ["propose", 0, 0, [], 4],
    "propose negative keep": ["propose", 0, -1, [1], 4],
    "propose negative token": ["propose", 0, 0, [-1], 4],
    "promote negative id": ["promote", -1],
    "drop string id": ["drop", "7"],
    "timing not bool": ["timing", 0],
    "timing missing": ["timing"],
    "ragged round end": ["round_end", 0, 1, [0, 2], [[1]]],
    "round end negative accepted": ["round_end", 0, -1, [0], [[1]]],
    "layer needs negative visit": ["layer_needs", 0, -1, [1]],
    "layer needs negative expert": ["layer_needs", 0, 1, [-2]],
    "round start window too large": ["round_start", 0, 0, P.MAX_WINDOW + 1],
    "use policy name too long": ["use_policy", "x" * (P.MAX_NAME + 1)],
    "propose batch empty": ["propose_batch", 0, []],
    "propose batch item k zero": ["propose_batch", 0, [["b1", 0, [1], 0]]],
    "propose batch item no tokens": ["propose_batch", 0, [["b1", 0, [], 2]]],
    "propose batch same request twice": ["propose_batch", 0, [["b1", 0, [1], 2], ["b1", 3, [2], 2]]],
    "propose batch too many": ["propose_batch", 0, [[f"b{i}", 0, [1], 1] for i in range(P.MAX_BATCH + 1)]],
    "round start negative drafts": ["round_start", 0, 0, 4, -1],
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_invalid_messages_raise_protocol_error(name: str) -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(msgpack.packb(BAD[name]))
    assert info.value.reason == P.MALFORMED


def test_unknown_tag_and_oversize_frame() -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(msgpack.packb(["teleport", 1]))
    assert info.value.reason == P.UNKNOWN
    with pytest.raises(P.ProtocolError, match="exceeds the cap"):
        P.decode(P.encode(P.DropFetch(1)), max_bytes=2)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_type_refuses_wrong_field_types_truncation_and_missing_fields(msg: P.Message) -> None:
    raw = msgpack.unpackb(P.encode(msg))
    for i in range(1, len(raw)):  # each field in turn holds a map: no field of any struct is a map
        wrong = raw[:i] + [{"x": 1}] + raw[i + 1 :]
        with pytest.raises(P.ProtocolError) as info:
            P.decode(msgpack.packb(wrong))
        assert info.value.reason == P.MALFORMED, (i, wrong)
    required = len(msg.__struct_fields__) - len(msg.__struct_defaults__)
    for bad in (msgpack.packb(raw[:required]), P.encode(msg)[:-1]):
        with pytest.raises(P.ProtocolError) as info:
            P.decode(bad)
        assert info.value.reason == P.MALFORMED


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_type_with_a_changed_tag_is_unknown(msg: P.Message) -> None:
    raw = msgpack.unpackb(P.encode(msg))
    raw[0] = raw[0] + "-v9"
    with pytest.raises(P.ProtocolError) as info:
        P.decode(msgpack.packb(raw))
    assert info.value.reason == P.UNKNOWN


def test_version_is_6_and_checked_both_ways() -> None:
    assert P.PROTOCOL_VERSION == 6  # bumped for requests drafted together (docs/wire.md)
    assert not {"verify", "demand", "done", "cancel"} & P.TAGS
    for old in (P.Hello(1, "verifier", 3), P.Welcome(1, "draft"), P.Hello(2, "transfer", 4), P.Hello(3, "draft", 5),
                P.Hello(4, "verifier", 6), P.Hello(5, "draft", 7)):
        assert P.decode(P.encode(old)) == old  # any version's Hello/Welcome still decodes...
        with pytest.raises(P.VersionMismatch) as info:  # ...and is refused by the version check
            P.check_version(old)
        assert info.value.reason == P.WRONG_VERSION and f"speaks version {old.version}" in str(info.value)


def test_check_version() -> None:
    P.check_version(P.Hello(P.PROTOCOL_VERSION, "draft", 1))
    with pytest.raises(P.VersionMismatch, match=r"'draft' \(pid 7\) speaks version 99") as info:
        P.check_version(P.Hello(99, "draft", 7))
    assert info.value.reason == P.WRONG_VERSION


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError):
        P.encode(_q_row())  # type: ignore[arg-type]


# --- fuzz ------------------------------------------------------------------------------------

VALID_FRAMES = [P.encode(m) for m in SAMPLES]


def _random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randrange(0, 64))


def _truncated(rng: random.Random) -> bytes:
    frame = rng.choice(VALID_FRAMES)
    return frame[: rng.randrange(0, len(frame))]


def _bit_flipped(rng: random.Random) -> bytes:
    frame = bytearray(rng.choice(VALID_FRAMES))
    for _ in range(rng.randrange(1, 4)):
        frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    return bytes(frame)


def _wrong_types(rng: random.Random) -> bytes:
    raw = msgpack.unpackb(rng.choice(VALID_FRAMES))
    i = rng.randrange(1, len(raw)) if len(raw) > 1 else 0
    raw[i] = rng.choice([None, "x", -1, 2**40, 1.5, [None], {"a": 1}, b"\xff", [[-1]], True])
    return msgpack.packb(raw)


def _huge_lengths(rng: random.Random) -> bytes:
    header = rng.choice([b"\xdd", b"\xdc", b"\xdb", b"\xc6", b"\xdf"])  # array32/16, str32, bin32, map32
    size = rng.choice([2**32 - 1, 2**31, 65535, 10**9]) % (1 << (16 if header == b"\xdc" else 32))
    body = size.to_bytes(2 if header == b"\xdc" else 4, "big")
    return rng.choice([b"", b"\x92\xa4plan"]) + header + body + rng.randbytes(rng.randrange(0, 16))


def _unknown_tag(rng: random.Random) -> bytes:
    return msgpack.packb([rng.choice(["", "planx", "HELLO", "\u00e9", "x" * 300]), 1, [2]])


def _out_of_range(rng: random.Random) -> bytes:
    bad = rng.choice([-1, -(2**63), 2**31, 2**64 - 1])
    return msgpack.packb(
        rng.choice(
            [
                ["plan", 0, 0, [bad], [[1]], [[0.5]]],
                ["plan", 0, 0, [1], [[bad]], [[0.5]]],
                ["plan", bad, 0, [1], [[1]], [[0.5]]],
                ["draft", bad, [1]],
                ["draft", 0, [bad]],
                ["hello", bad, "draft", 1],
                ["fetch", bad, 0, 0, 0, 0],
                ["fetch", 0, 0, bad, 0, 0],
                ["fetch", 0, 0, 0, bad, 1],
                ["propose", bad, 0, [1], 2],
                ["propose", 0, 0, [bad], 2],
                ["promote", bad],
                ["drop", bad],
            ]
        )
    )


FUZZERS = [_random_bytes, _truncated, _bit_flipped, _wrong_types, _huge_lengths, _unknown_tag, _out_of_range]


def test_fuzz_decode_never_raises_anything_but_protocol_error() -> None:
    rng = random.Random(1234)
    outcomes = {"ok": 0, P.MALFORMED: 0, P.UNKNOWN: 0}
    for _ in range(20_000):
        frame = rng.choice(FUZZERS)(rng)
        try:
            msg = P.decode(frame)
        except P.ProtocolError as exc:
            outcomes[exc.reason] += 1
            continue
        assert isinstance(msg, P.MESSAGE_TYPES)
        outcomes["ok"] += 1
    assert outcomes[P.MALFORMED] > 10_000 and outcomes[P.UNKNOWN] > 1000


# --- no code from the wire (docs/security.md) ----------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
UNSAFE_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}


HOOKS = ("ext_hook", "object_hook", "object_pairs_hook", "list_hook")


def _call_problem(node: ast.Call) -> str | None:
    """Why this call could run code from its input, or None."""
    func, kwargs = node.func, {k.arg: ast.unparse(k.value) for k in node.keywords}
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
    if isinstance(func, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
        return f"{name}("
    if owner == "torch" and name == "load" and kwargs.get("weights_only") != "True":
        return "torch.load without weights_only=True"
    if name == "Decoder" and not (node.args or node.keywords):
        return f"untyped {ast.unparse(func)}()"
    if name in ("unpackb", "Unpacker") and set(kwargs) & set(HOOKS):
        return f"{ast.unparse(func)} with a hook"
    return None


def _unsafe_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"import {n}" for n in names if n and n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call) and (problem := _call_problem(node)):
            found.append(problem)
    return found


def test_no_pickle_eval_or_untyped_decoder_in_specter_or_actors() -> None:
    files = sorted((ROOT / "specter").rglob("*.py")) + sorted((ROOT / "actors").rglob("*.py"))
    assert len(files) > 20
    found = {str(f.relative_to(ROOT)): bad for f in files if (bad := _unsafe_calls(ast.parse(f.read_text())))}
    assert found == {}


def test_the_scan_would_see_them() -> None:
    bad = "import pickle\nx = eval(s)\ntorch.load(f)\nmsgspec.msgpack.Decoder()\nmsgpack.unpackb(b, ext_hook=h)\n"
    assert len(_unsafe_calls(ast.parse(bad))) == 5
    assert _unsafe_calls(ast.parse("model.eval()\ntorch.load(f, weights_only=True)\nDecoder(Message)\n")) == []


def test_every_socket_reads_through_the_typed_decoder() -> None:
    from specter.remote import channel

    assert isinstance(P._decoder, msgspec.msgpack.Decoder) and P._decoder.type == P.Message
    assert channel.decode is P.decode  # Channel._decode: the only place frames become objects
    assert set(typing.get_args(P.Message)) == set(P.MESSAGE_TYPES)
    assert all(t.__struct_config__.frozen and t.__struct_config__.array_like for t in P.MESSAGE_TYPES)


def test_a_round_drafted_ahead_needs_a_next_round_id() -> None:
    for msg in (P.ProposeRequest(P.MAX_ID, 0, [1], 2, False, 3), P.AheadKeep(P.MAX_ID, 1)):
        with pytest.raises(P.ProtocolError, match="no next round"):
            P.decode(P.encode(msg))
    assert P.decode(P.encode(P.AheadKeep(P.MAX_ID, 0))) == P.AheadKeep(P.MAX_ID, 0)  # nothing ahead: fine
