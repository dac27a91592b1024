"""Every message that crosses a socket between Specter's processes, and ``PROTOCOL_VERSION``.

Typed msgspec structs encoded as msgpack arrays (``array_like``), tagged so that one decoder
reads a union: on the wire a message is ``[tag, field0, field1, ...]``. Plans carry ids and
scores, never tensors; the draft's token probabilities travel as little-endian int32/float32
bytes (:class:`SparseProbs`), never pickled. New fields go at the end, with defaults; a decoder
ignores trailing fields it does not know, so appending is compatible within one version.
``Hello`` and ``Welcome`` keep their layout forever, so that a version mismatch is always readable.

``decode`` is the only way in: it raises :class:`ProtocolError` (a ``ValueError``) for anything
malformed, with ``reason`` one of ``malformed``, ``unknown`` (an unknown tag) or ``wrong_version``.
See docs/wire.md.
"""

from __future__ import annotations

from typing import Annotated

import msgpack
import msgspec
import numpy as np
from msgspec import Meta

from specter.config import MIN_TEMPERATURE  # 0 is greedy; a smaller one overflows logits / T

PROTOCOL_VERSION = 6  # 2: the actor messages (propose, fetch, promote, drop) and timing joined;
# 3: verify, demand, done and cancel left (no component sent them); 4: pipelined drafting
# (ProposeRequest.ahead, AheadStart, AheadKeep); 5: the schedule in the transfer actor (UsePolicy,
# ResetSlots, RequestStart, RoundStart, VerifyStart, LayerNeeds, RoundEnd, FetchLater, Replay); 6: several
# requests drafted together (StartRequest.batched, ProposeBatch, DraftTokens.request_id, EndRequest,
# RoundStart.drafts)

# Caps that a decoder enforces: a peer cannot make us allocate more than these.
MAX_ID = 2**31 - 1  # layer, expert, token, round and step ids
MAX_LIST = 1 << 16  # ids in one list (experts of one layer, layers of one plan)
MAX_TOKENS = 1 << 20  # tokens in a prompt or a finished request
MAX_WINDOW = 1 << 10  # draft tokens in one round
MAX_BATCH = 256  # requests drafted together in one round
MAX_SCORE = 1e6  # router weights (some models scale them above 1; never NaN or inf)
MAX_NAME = 256  # roles, request ids, places
MAX_TEXT = 1 << 20  # free text and stats JSON
MAX_FRAME_BYTES = 64 << 20  # a whole frame

MALFORMED, UNKNOWN, WRONG_VERSION = "malformed", "unknown", "wrong_version"

Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
Ids = Annotated[list[Id], Meta(max_length=MAX_LIST)]
Score = Annotated[float, Meta(ge=0.0, le=MAX_SCORE)]
Scores = Annotated[list[Score], Meta(max_length=MAX_LIST)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Version = Annotated[int, Meta(ge=0, le=MAX_ID)]
Pid = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Blob = Annotated[bytes, Meta(max_length=4 * MAX_TOKENS)]


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol.

    Attributes:
        reason: ``malformed``, ``unknown`` (unknown tag) or ``wrong_version``.
    """

    def __init__(self, message: str, reason: str = MALFORMED):
        super().__init__(message)
        self.reason = reason


class VersionMismatch(ProtocolError):
    """The peer speaks another ``PROTOCOL_VERSION``."""

    def __init__(self, message: str):
        super().__init__(message, WRONG_VERSION)


class Hello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    """First frame of a connection, both ways: who I am and what I speak. Layout frozen forever."""

    version: Version
    role: Name
    pid: Pid


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag="welcome"):
    """Answer to a peer's ``Hello``: my version and role. Layout frozen forever."""

    version: Version
    role: Name


class PlanDelta(msgspec.Struct, frozen=True, array_like=True, tag="plan"):
    """What the draft's routers picked at one draft step of one round (draft → transfer, whose
    policy schedules the transfers, and draft → verifier, for its prediction-recall figures and,
    with the schedule in the verifier, its policy; the draft server sends one per step as it ends).

    Attributes:
        round: the speculative round this step belongs to (stale rounds are cancelled).
        step: the draft step within the round, 0-based.
        layers: MoE layer ids, in the order of ``experts`` and ``probs``.
        experts: per layer, the top-k expert ids of this step's last position (the one the verify pass
            runs: a step that feeds several tokens routes them all, but the target has run the others).
        probs: per layer, the router weight of each id in ``experts``.
    """

    round: Id
    step: Id
    layers: Ids
    experts: Annotated[list[Ids], Meta(max_length=MAX_LIST)]
    probs: Annotated[list[Scores], Meta(max_length=MAX_LIST)]


class SparseProbs(msgspec.Struct, frozen=True, array_like=True):
    """One draft distribution q over the vocabulary, nonzero entries only (not a message).

    Attributes:
        ids: token ids, little-endian int32 (ascending when made by ``from_dense``).
        probs: their probabilities, little-endian float32 (float32 is what the draft computes).
    """

    ids: Blob
    probs: Blob

    @classmethod
    def from_dense(cls, row: np.ndarray) -> SparseProbs:
        """Pack a dense (V,) probability row (numpy, or a CPU tensor via ``np.asarray``)."""
        dense = np.asarray(row, dtype=np.float32).reshape(-1)
        ids = np.flatnonzero(dense).astype("<i4")
        return cls(ids.tobytes(), dense[ids].astype("<f4").tobytes())

    def to_dense(self, vocab_size: int) -> np.ndarray:
        """The dense (V,) float32 row this packs."""
        dense = np.zeros(vocab_size, dtype=np.float32)
        dense[np.frombuffer(self.ids, dtype="<i4")] = np.frombuffer(self.probs, dtype="<f4")
        return dense


class DraftTokens(msgspec.Struct, frozen=True, array_like=True, tag="draft"):
    """The K draft tokens of a round (draft → verifier).

    Attributes:
        round: the round they were drafted in.
        tokens: the draft tokens, in order.
        q: for sampling, one :class:`SparseProbs` per token (the warped distribution it was drawn
            from); empty when greedy.
        vocab_size: length of the dense rows of ``q`` (0 when ``q`` is empty).
        request_id: the request they are for, in answer to a ``ProposeBatch``; "" otherwise.
        cold: the draft's steps so far that paid a one-off (a token count's first step, a CUDA graph
            capture: ``GraphedStep.cold``); a round in which it grew teaches the K chooser no cost.
    """

    round: Id
    tokens: Annotated[list[Id], Meta(max_length=MAX_WINDOW)]
    q: Annotated[list[SparseProbs], Meta(max_length=MAX_WINDOW)] = []
    vocab_size: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    request_id: Name = ""
    cold: Annotated[int, Meta(ge=0)] = 0


class StartRequest(msgspec.Struct, frozen=True, array_like=True, tag="start"):
    """Start generating for one prompt (verifier → draft: ``RemoteProposer.prefill``).

    Sampling fields mean what ``SamplingConfig``'s do (temperature 0: greedy; top_k 0: off);
    ``window`` is K, 0 for the policy's default. ``batched``: one of several requests drafted
    together (``ProposeBatch``), kept by ``request_id`` until its ``EndRequest``; otherwise it
    replaces the one request the draft serves by ``ProposeRequest``.
    """

    request_id: Name
    prompt_ids: Annotated[list[Id], Meta(min_length=1, max_length=MAX_TOKENS)]
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
    temperature: Annotated[float, Meta(ge=0.0, le=1e4)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=MAX_ID)] = 0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    window: Annotated[int, Meta(ge=0, le=MAX_WINDOW)] = 0
    batched: bool = False


class EndRequest(msgspec.Struct, frozen=True, array_like=True, tag="end_request"):
    """A batched request ended (verifier → draft): its draft cache is dropped. An id the draft does
    not hold (ended already) is nothing to do."""

    request_id: Name


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    """Stop after the current work (verifier → draft and transfer, as the verifier closes)."""

    reason: Text = ""


class Error(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    """A failure that the peer should know about: where it happened and what it was."""

    where: Name
    message: Text


Priority = Annotated[int, Meta(ge=0, le=1)]  # 0 demand, 1 prefetch (specter.experts.link)


class ProposeRequest(msgspec.Struct, frozen=True, array_like=True, tag="propose"):
    """Draft ``k`` tokens for round ``round`` (verifier → draft).

    Attributes:
        round: the round.
        keep: positions of the draft's cache that stand (it crops to this first).
        tokens: the tokens after those ``keep`` positions that the draft has not processed.
        k: draft tokens to propose.
        route_last: one more forward to route the K-th draft token's position too.
        ahead: pipelined drafting: once this round's ``DraftTokens`` are sent, draft round
            ``round + 1`` with ``ahead`` tokens at once, assuming the verifier accepts every draft
            token and its next token is the draft's own guess (``AheadStart``); 0: do not.
    """

    round: Id
    keep: Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
    tokens: Annotated[list[Id], Meta(min_length=1, max_length=MAX_TOKENS)]
    k: Annotated[int, Meta(ge=1, le=MAX_WINDOW)]
    route_last: bool = False
    ahead: Annotated[int, Meta(ge=0, le=MAX_WINDOW)] = 0


class ProposeItem(msgspec.Struct, frozen=True, array_like=True):
    """One request's part of a ``ProposeBatch``: ``keep``, ``tokens`` and ``k`` as ``ProposeRequest``'s."""

    request_id: Name
    keep: Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
    tokens: Annotated[list[Id], Meta(min_length=1, max_length=MAX_TOKENS)]
    k: Annotated[int, Meta(ge=1, le=MAX_WINDOW)]


class ProposeBatch(msgspec.Struct, frozen=True, array_like=True, tag="propose_batch"):
    """Draft round ``round`` for several batched requests together (verifier → draft): each draft step
    is one forward over every request still drafting. The draft sends each request's plan delta per
    step (all carrying ``round``), then one ``DraftTokens`` per item, in order, naming its request."""

    round: Id
    items: Annotated[list[ProposeItem], Meta(min_length=1, max_length=MAX_BATCH)]
    route_last: bool = False


class AheadStart(msgspec.Struct, frozen=True, array_like=True, tag="ahead_start"):
    """The draft starts optimistic round ``round`` assuming the target's next token is ``bonus``
    (draft → verifier, before that round's plans). The round stands only if the verifier accepts
    every draft token of the round before and its own next token is ``bonus``."""

    round: Id
    bonus: Id


class AheadKeep(msgspec.Struct, frozen=True, array_like=True, tag="ahead_keep"):
    """Optimistic round ``round`` stands (verifier → draft); once it is drafted, draft round
    ``round + 1`` optimistically with ``ahead`` tokens (0: none). Anything else the verifier sends
    instead throws the optimistic round away (the draft rolls back its cache and generator)."""

    round: Id
    ahead: Annotated[int, Meta(ge=0, le=MAX_WINDOW)] = 0


class FetchExpert(msgspec.Struct, frozen=True, array_like=True, tag="fetch"):
    """Copy expert ``(layer, expert)`` into ``slot`` and publish it there (verifier → transfer).

    Attributes:
        id: the verifier's transfer id (for ``PromoteFetch``/``DropFetch``).
        priority: 0 demand, 1 prefetch.
        timed: False for untimed copies (the initial residency fill: not counted, no link model).
    """

    id: Id
    layer: Id
    expert: Id
    slot: Id
    priority: Priority
    timed: bool = True


class PromoteFetch(msgspec.Struct, frozen=True, array_like=True, tag="promote"):
    """A queued prefetch is needed now: make it a demand transfer (verifier → transfer)."""

    id: Id


class DropFetch(msgspec.Struct, frozen=True, array_like=True, tag="drop"):
    """Drop a queued, not yet started transfer (verifier → transfer)."""

    id: Id


class LinkTiming(msgspec.Struct, frozen=True, array_like=True, tag="timing"):
    """From now on copies wait out the link model (``timed``) or finish at copy speed (verifier →
    transfer; the engine's untimed prefill). Read when a copy starts, as ``SimulatedLink.timed``."""

    timed: bool


# -- the schedule in the transfer actor (verifier → transfer; plans come from the draft) ------------


class UsePolicy(msgspec.Struct, frozen=True, array_like=True, tag="use_policy"):
    """Schedule with this policy from now on (a fresh residency map, the initial slots filled
    untimed); ``host_profile`` names the profile whose host computes late experts ("" the default).
    An empty ``name``: stop scheduling (the verifier sends copy commands again)."""

    name: Name
    host_profile: Name = ""


class ResetSlots(msgspec.Struct, frozen=True, array_like=True, tag="reset_slots"):
    """Empty every slot and refill the initial residency (a request starts from it); the policy
    and what it learnt stay."""


class RequestStart(msgspec.Struct, frozen=True, array_like=True, tag="request_start"):
    """A request starts (``Policy.begin_request``)."""


class RoundStart(msgspec.Struct, frozen=True, array_like=True, tag="round_start"):
    """Round ``round`` (the engine's id) starts with window ``k``; the draft's plan deltas for it
    carry ``wire`` (the draft's round id on the wire). ``drafts``: the plan deltas a batched round
    sends, every drafting request's (``Policy.round_drafts``); 0: one request's ``k``."""

    round: Id
    wire: Id
    k: Annotated[int, Meta(ge=0, le=MAX_WINDOW)]
    drafts: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0


class VerifyStart(msgspec.Struct, frozen=True, array_like=True, tag="verify_start"):
    """The verify pass of ``round`` over ``positions`` positions starts."""

    round: Id
    positions: Annotated[int, Meta(ge=0, le=MAX_TOKENS)]


class LayerNeeds(msgspec.Struct, frozen=True, array_like=True, tag="layer_needs"):
    """The pass reached MoE ``layer`` (its ``visit``-th MoE layer since the verifier started): it
    computes ``ready`` from their slots and ``host`` on the host, and waits for ``wait`` (demand:
    fetched ahead of every prefetch, or promoted)."""

    layer: Id
    visit: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    wait: Ids
    ready: Ids = []
    host: Ids = []


class RoundEnd(msgspec.Struct, frozen=True, array_like=True, tag="round_end"):
    """``round`` is decided: ``accepted`` draft tokens; the verify pass's experts per layer."""

    round: Id
    accepted: Annotated[int, Meta(ge=0, le=MAX_WINDOW)]
    layers: Ids
    experts: Annotated[list[Ids], Meta(max_length=MAX_LIST)]


class FetchLater(msgspec.Struct, frozen=True, array_like=True, tag="fetch_later"):
    """Experts of ``layer`` the host just computed: move them into slots for later uses."""

    layer: Id
    experts: Ids


class Replay(msgspec.Struct, frozen=True, array_like=True, tag="replay"):
    """The ``oracle``: what it recorded is the next run's future (``Oracle.replay``)."""


Message = (
    Hello
    | Welcome
    | PlanDelta
    | DraftTokens
    | StartRequest
    | Shutdown
    | Error
    | ProposeRequest
    | ProposeBatch
    | EndRequest
    | AheadStart
    | AheadKeep
    | FetchExpert
    | PromoteFetch
    | DropFetch
    | LinkTiming
    | UsePolicy
    | ResetSlots
    | RequestStart
    | RoundStart
    | VerifyStart
    | LayerNeeds
    | RoundEnd
    | FetchLater
    | Replay
)
MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (
    Hello,
    Welcome,
    PlanDelta,
    DraftTokens,
    StartRequest,
    Shutdown,
    Error,
    ProposeRequest,
    ProposeBatch,
    EndRequest,
    AheadStart,
    AheadKeep,
    FetchExpert,
    PromoteFetch,
    DropFetch,
    LinkTiming,
    UsePolicy,
    ResetSlots,
    RequestStart,
    RoundStart,
    VerifyStart,
    LayerNeeds,
    RoundEnd,
    FetchLater,
    Replay,
)
TAGS: frozenset[str] = frozenset(str(t.__struct_config__.tag) for t in MESSAGE_TYPES)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One message as msgpack bytes: ``[tag, field0, ...]``.

    Raises:
        TypeError: ``msg`` is not a protocol message.
    """
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Read one message, fully validated.

    Raises:
        ProtocolError: for anything that is not a valid message (its ``reason`` says why).
    """
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the cap of {max_bytes}")
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        reason = _classify(bytes(data))
        raise ProtocolError(f"{reason} frame: {exc}", reason) from None
    _check(msg)
    return msg


def check_version(peer: Hello | Welcome, expected: int = PROTOCOL_VERSION) -> None:
    """Raise :class:`VersionMismatch` unless the peer speaks ``expected``."""
    if peer.version != expected:
        pid = f" (pid {peer.pid})" if isinstance(peer, Hello) else ""
        raise VersionMismatch(
            f"protocol version mismatch: peer {peer.role!r}{pid} speaks version {peer.version}, "
            f"this process speaks {expected}; run the same Specter build on both sides"
        )


def _classify(data: bytes) -> str:
    """``unknown`` when the frame is an array led by a string that is not a known tag."""
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=len(data) + 1)
        unpacker.feed(data)
        if unpacker.read_array_header() < 1:
            return MALFORMED
        tag = unpacker.unpack()
    except Exception:  # any garbage: plain msgpack's errors are many and unimportant here
        return MALFORMED
    return UNKNOWN if isinstance(tag, str) and tag not in TAGS else MALFORMED


def _check(msg: Message) -> None:
    """Consistency that per-field types cannot express (parallel list lengths and the like)."""
    if isinstance(msg, PlanDelta):
        _same_lengths("PlanDelta", msg.layers, msg.experts, msg.probs)
        if list(map(len, msg.experts)) != list(map(len, msg.probs)):
            raise ProtocolError("PlanDelta: an experts list and its probs differ in length")
    elif isinstance(msg, DraftTokens):
        _check_draft(msg)
    elif isinstance(msg, ProposeRequest | AheadKeep) and msg.ahead and msg.round >= MAX_ID:
        raise ProtocolError(f"{type(msg).__name__}: round {msg.round} has no next round to draft ahead")
    elif isinstance(msg, RoundEnd):
        _same_lengths("RoundEnd", msg.layers, msg.experts)
    elif isinstance(msg, ProposeBatch) and len({item.request_id for item in msg.items}) < len(msg.items):
        raise ProtocolError("ProposeBatch: a request appears twice")
    elif isinstance(msg, StartRequest) and 0 < msg.temperature < MIN_TEMPERATURE:
        raise ProtocolError(f"StartRequest: temperature {msg.temperature} is neither 0 nor >= {MIN_TEMPERATURE}")


def _same_lengths(what: str, *lists: list) -> None:
    if len({len(x) for x in lists}) > 1:
        raise ProtocolError(f"{what}: parallel lists differ in length {[len(x) for x in lists]}")


def _check_draft(msg: DraftTokens) -> None:
    if not msg.q:
        return
    if len(msg.q) != len(msg.tokens):
        raise ProtocolError(f"DraftTokens: {len(msg.q)} q rows for {len(msg.tokens)} tokens")
    if any(t >= msg.vocab_size for t in msg.tokens):
        raise ProtocolError(f"DraftTokens: a token id is >= vocab_size {msg.vocab_size}")
    for row in msg.q:
        if len(row.ids) % 4 or len(row.ids) != len(row.probs) or len(row.ids) > 4 * msg.vocab_size:
            raise ProtocolError(f"SparseProbs: {len(row.ids)} id bytes vs {len(row.probs)} prob bytes")
    for ids, probs in _q_arrays(msg.q):
        if ids.size and (ids.min() < 0 or ids.max() >= msg.vocab_size):
            raise ProtocolError(f"SparseProbs: token id outside [0, {msg.vocab_size})")
        if not ((probs >= 0) & (probs <= 1)).all():  # NaN fails both comparisons
            raise ProtocolError("SparseProbs: a probability is not in [0, 1]")


def _q_arrays(q: list[SparseProbs]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zero-copy arrays of each row, or of all rows joined when they are short (numpy's
    per-call overhead dominates short rows; copying dominates long ones)."""
    if sum(len(row.ids) for row in q) <= 1 << 16:
        q = [SparseProbs(b"".join(row.ids for row in q), b"".join(row.probs for row in q))]
    return [(np.frombuffer(row.ids, dtype="<i4"), np.frombuffer(row.probs, dtype="<f4")) for row in q]


__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "AheadKeep",
    "AheadStart",
    "DraftTokens",
    "DropFetch",
    "EndRequest",
    "Error",
    "FetchExpert",
    "FetchLater",
    "Hello",
    "LayerNeeds",
    "LinkTiming",
    "Message",
    "PlanDelta",
    "PromoteFetch",
    "ProposeBatch",
    "ProposeItem",
    "ProposeRequest",
    "ProtocolError",
    "Replay",
    "RequestStart",
    "ResetSlots",
    "RoundEnd",
    "RoundStart",
    "Shutdown",
    "SparseProbs",
    "StartRequest",
    "UsePolicy",
    "VerifyStart",
    "VersionMismatch",
    "Welcome",
    "check_version",
    "decode",
    "encode",
]
