"""A ``Channel`` that also carries the actor messages of ``specter.actor_messages``."""

from __future__ import annotations

import zmq

from specter import actor_messages
from specter.channel import Channel, ChannelError, ChannelTimeout, _ms
from specter.protocol import ProtocolError


class ActorChannel(Channel):
    """``specter.channel.Channel`` (same handshake, timeouts and dropping rules) whose codec also
    knows ``ProposeRequest``, ``FetchExpert``, ``PromoteFetch`` and ``DropFetch``."""

    def send(self, msg: actor_messages.AnyMessage, timeout_s: float | None = None) -> None:  # type: ignore[override]
        """Send one message; see ``Channel.send``."""
        self._check_open()
        if self.kind == "pull":
            raise ChannelError(f"{self!r}: a pull channel cannot send")
        data = actor_messages.encode(msg)
        if self._try_send(data):
            return
        wait = self._timeout(timeout_s)
        if self.socket.poll(_ms(wait), zmq.POLLOUT) and self._try_send(data):
            return
        raise ChannelTimeout(
            f"send of {type(msg).__name__} to {self.peer} at {self.address} timed out after {wait:.1f}s "
            "(peer not connected, or not reading)"
        )

    def _decode(self, frames: list[bytes]) -> None:
        if not frames:
            return
        if len(frames) != 1:
            self._drop("malformed", f"{len(frames)}-part message")
            return
        try:
            self._pending.append(actor_messages.decode(frames[0], self.max_bytes))  # type: ignore[arg-type]
        except ProtocolError as exc:
            self._drop(exc.reason, str(exc))
