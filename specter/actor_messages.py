"""Plan-plane messages between the actors that ``specter.protocol`` does not define.

Same conventions as ``specter.protocol`` (msgspec structs, msgpack arrays ``[tag, field0, ...]``,
fields only appended with defaults), in their own module so that the base protocol's table stays
as it is. ``encode``/``decode`` here read and write both these and every ``specter.protocol``
message; :class:`specter.actor_channel.ActorChannel` uses them. See docs/actors.md.
"""

from __future__ import annotations

from typing import Annotated

import msgpack
import msgspec
from msgspec import Meta

from specter import protocol
from specter.protocol import MALFORMED, MAX_FRAME_BYTES, MAX_WINDOW, UNKNOWN, Id, ProtocolError, Tokens

Priority = Annotated[int, Meta(ge=0, le=1)]  # 0 demand, 1 prefetch (specter.experts.link)


class ProposeRequest(msgspec.Struct, frozen=True, array_like=True, tag="propose"):
    """Draft ``k`` tokens for round ``round`` (verifier → draft).

    Attributes:
        round: the round.
        keep: positions of the draft's cache that stand (it crops to this first).
        tokens: the tokens after those ``keep`` positions that the draft has not processed.
        k: draft tokens to propose.
        route_last: one more forward to route the K-th draft token's position too.
    """

    round: Id
    keep: Annotated[int, Meta(ge=0, le=protocol.MAX_TOKENS)]
    tokens: Tokens
    k: Annotated[int, Meta(ge=1, le=MAX_WINDOW)]
    route_last: bool = False


class FetchExpert(msgspec.Struct, frozen=True, array_like=True, tag="fetch"):
    """Copy expert ``(layer, expert)`` into ``slot`` and publish it there (verifier → transfer).

    Attributes:
        id: the verifier's transfer id (for ``PromoteFetch``/``DropFetch``).
        timed: False for untimed copies (the initial residency fill).
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


ActorMessage = ProposeRequest | FetchExpert | PromoteFetch | DropFetch
ACTOR_MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (ProposeRequest, FetchExpert, PromoteFetch, DropFetch)
AnyMessage = protocol.Message | ActorMessage

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ActorMessage)
ACTOR_TAGS: frozenset[str] = frozenset(str(t.__struct_config__.tag) for t in ACTOR_MESSAGE_TYPES)
assert not ACTOR_TAGS & protocol.TAGS


def encode(msg: AnyMessage) -> bytes:
    """One message (of either module) as msgpack bytes.

    Raises:
        TypeError: ``msg`` is not a message.
    """
    if isinstance(msg, ACTOR_MESSAGE_TYPES):
        return _encoder.encode(msg)
    return protocol.encode(msg)  # type: ignore[arg-type]


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> AnyMessage:
    """Read one message of either module, fully validated.

    Raises:
        ProtocolError: anything else (``reason`` as in ``specter.protocol``).
    """
    try:
        return protocol.decode(data, max_bytes)
    except ProtocolError as exc:
        if exc.reason != UNKNOWN:
            raise
        first = exc
    try:
        msg: ActorMessage = _decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        if _tag(bytes(data)) in ACTOR_TAGS:
            raise ProtocolError(f"malformed frame: {exc}", MALFORMED) from None
        raise first from None
    return msg


def _tag(data: bytes) -> object:
    """The first item of a msgpack array (the tag), or None."""
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=len(data) + 1)
        unpacker.feed(data)
        return unpacker.unpack() if unpacker.read_array_header() >= 1 else None
    except Exception:  # garbage: no tag
        return None
