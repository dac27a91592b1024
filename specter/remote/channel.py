"""A ``Channel`` that sends and receives protocol messages over ZeroMQ with timeouts everywhere
(its endpoints: ``specter/remote/endpoints.py``).

A ``Channel`` wraps one socket (PUSH, PULL or PAIR). It never raises on garbage from the wire:
a frame that does not decode is dropped, counted in ``dropped`` by reason and logged (at most one
line per reason per second). Anything that can wait takes a timeout and, when it runs out, names
the peer and the endpoint. Endpoints are ``ipc://`` (in a 0700 directory) or loopback ``tcp://``
unless a caller passes ``expose=True`` explicitly. See docs/wire.md and docs/security.md.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import zmq

from specter.protocol import (
    MALFORMED,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    UNKNOWN,
    WRONG_VERSION,
    Hello,
    Message,
    ProtocolError,
    VersionMismatch,
    Welcome,
    check_version,
    decode,
    encode,
)
from specter.remote.endpoints import check_endpoint

log = logging.getLogger(__name__)

SOCKET_KINDS = {"push": zmq.PUSH, "pull": zmq.PULL, "pair": zmq.PAIR}
_LOG_EVERY_S = 1.0


class ChannelError(RuntimeError):
    """A socket could not do its job: a peer did not answer in time, or the channel is closed."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A send or a handshake ran out of time."""


class DropLog:
    """Counts refused input per reason and logs it, at most one warning per reason per second.

    Args:
        what: who refuses (it starts every log line).
        reasons: reasons that start at 0 (others are added when first counted).
    """

    def __init__(self, what: str, reasons: tuple[str, ...] = ()):
        self.what = what
        self.counts: dict[str, int] = dict.fromkeys(reasons, 0)
        self._last: dict[str, float] = {}

    def __call__(self, reason: str, detail: str, exc_info: bool = False) -> None:
        """Count one refusal; log it (with the traceback if ``exc_info``) unless this reason
        logged less than a second ago."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last.get(reason, -math.inf) >= _LOG_EVERY_S:
            self._last[reason] = now
            log.warning(
                "%s: dropped a frame, %s (%d so far): %s", self.what, reason, self.counts[reason], detail[:200],
                exc_info=exc_info,
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class Channel:
    """One ZeroMQ socket that carries protocol messages.

    Args:
        kind: ``push``, ``pull`` or ``pair``.
        address: an endpoint from :func:`endpoint` (checked again: loopback tcp or ipc only).
        bind: bind (True) or connect (False).
        peer: the peer's name, for error messages and logs.
        timeout_s: default timeout of ``send``, ``recv`` and ``handshake``.
        max_bytes: frames longer than this are refused (by ZeroMQ before they are read).
        context: the ZeroMQ context (default: the process-wide one).
        expose: allow a non-loopback tcp address (:func:`check_endpoint`).

    Attributes:
        dropped: frames dropped, per reason (``malformed``, ``unknown``, ``wrong_version``).
        received: valid messages decoded (so frames read = ``received`` + sum of ``dropped``).
    """

    def __init__(
        self,
        kind: str,
        address: str,
        *,
        bind: bool,
        peer: str = "peer",
        timeout_s: float = 10.0,
        max_bytes: int = MAX_FRAME_BYTES,
        context: zmq.Context | None = None,
        expose: bool = False,
    ):
        if kind not in SOCKET_KINDS:
            raise ValueError(f"channel kind {kind!r}: must be one of {sorted(SOCKET_KINDS)}")
        self.kind, self.peer, self.timeout_s, self.max_bytes = kind, peer, timeout_s, max_bytes
        self.bound = bind
        self._drops = DropLog(f"{kind} channel from {peer}", (MALFORMED, UNKNOWN, WRONG_VERSION))
        self.dropped: dict[str, int] = self._drops.counts
        self.received = 0
        self.peer_hello: Hello | None = None
        self._pending: deque[Message] = deque()
        self.socket = (context or zmq.Context.instance()).socket(SOCKET_KINDS[kind])
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.address = self._open(check_endpoint(address, expose), bind)
        self._drops.what = repr(self)

    def _open(self, address: str, bind: bool) -> str:
        try:
            if bind:
                self.socket.bind(address)
                return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self.socket.connect(address)
            return address
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            verb = "bind" if bind else "connect"
            raise ChannelError(f"{self.kind} channel to {self.peer}: cannot {verb} {address}: {exc}") from exc

    def __repr__(self) -> str:
        return f"Channel({self.kind}, {self.address}, peer={self.peer!r})"

    # --- sending ---------------------------------------------------------------------------

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        """Send one message; waits up to ``timeout_s`` for room (no peer or a full queue).

        Raises:
            ChannelTimeout: the message could not be queued in time.
            ChannelError: the channel is closed or cannot send.
        """
        self._check_open()
        if self.kind == "pull":
            raise ChannelError(f"{self!r}: a pull channel cannot send")
        data = encode(msg)
        if self._try_send(data):  # the common case: room in the queue, no poll needed
            return
        wait = self._timeout(timeout_s)
        if self.socket.poll(_ms(wait), zmq.POLLOUT) and self._try_send(data):
            return
        raise ChannelTimeout(
            f"send of {type(msg).__name__} to {self.peer} at {self.address} timed out after {wait:.1f}s "
            "(peer not connected, or not reading)"
        )

    def _try_send(self, data: bytes) -> bool:
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    # --- receiving -------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next valid message, or None when none came within ``timeout_s``.

        Garbage frames are dropped and counted; a ``Hello``/``Welcome`` of another protocol
        version is dropped as ``wrong_version``. Never raises on what the peer sent.
        """
        self._check_open()
        if self.kind == "push":
            raise ChannelError(f"{self!r}: a push channel cannot receive")
        deadline = time.monotonic() + self._timeout(timeout_s)
        while True:
            msg = self._next(deadline)
            if not isinstance(msg, Hello | Welcome) or msg.version == PROTOCOL_VERSION:
                return msg
            self.received -= 1  # decoded, but refused: count it once, as dropped
            self._drop(WRONG_VERSION, f"{type(msg).__name__} of protocol version {msg.version}")

    def _next(self, deadline: float) -> Message | None:
        """Buffered messages first, then the socket; garbage is dropped here."""
        while not self._pending:
            frames = self._frames(deadline)
            if frames is None:
                return None
            self._decode(frames)
        return self._pending.popleft()

    def _frames(self, deadline: float) -> list[bytes] | None:
        """The next frames; [] when a poll woke without a message; None at the deadline."""
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK)  # try first: no poll when one is queued
        except zmq.Again:
            pass
        remaining = deadline - time.monotonic()
        if remaining < 0 or not self.socket.poll(_ms(remaining), zmq.POLLIN):
            return None
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return []

    def _decode(self, frames: list[bytes]) -> None:
        if not frames:
            return
        if len(frames) != 1:
            self._drop(MALFORMED, f"{len(frames)}-part message")
            return
        try:
            self._pending.append(decode(frames[0], self.max_bytes))
        except ProtocolError as exc:
            self._drop(exc.reason, str(exc))
            return
        self.received += 1

    def _drop(self, reason: str, detail: str) -> None:
        self._drops(reason, detail)

    # --- handshake -------------------------------------------------------------------------

    def handshake(self, role: str, timeout_s: float | None = None) -> Hello | None:
        """Check that the peer speaks this ``PROTOCOL_VERSION``; call once, right after opening.

        ``pair``: both sides send ``Hello`` and answer the other's with ``Welcome``; both check.
        ``push``: sends ``Hello`` only (it cannot hear back). ``pull``: waits for one ``Hello``.

        Returns:
            The peer's ``Hello`` (None on a push channel).

        Raises:
            VersionMismatch: the peer speaks another version.
            ChannelTimeout: the peer said nothing in time (it names the peer and endpoint).
        """
        wait = self._timeout(timeout_s)
        deadline = time.monotonic() + wait
        if self.kind != "pull":
            self._send_hello(role, wait)
        if self.kind == "push":
            return None
        hello, welcomed = None, self.kind == "pull"
        while hello is None or not welcomed:
            msg = self._handshake_message(role, deadline, wait)
            if isinstance(msg, Hello):
                hello = msg
                if self.kind == "pair":
                    self.send(Welcome(PROTOCOL_VERSION, role), max(deadline - time.monotonic(), 0.0))
            elif isinstance(msg, Welcome):
                welcomed = True
        self.peer_hello = hello
        log.debug(
            "%s: handshake with %s (%s, pid %d) at %s", role, self.peer, hello.role, hello.pid, self.address
        )
        return hello

    def _send_hello(self, role: str, wait: float) -> None:
        try:
            self.send(Hello(PROTOCOL_VERSION, role, os.getpid()), wait)
        except ChannelTimeout:
            raise self._no_answer(role, wait) from None

    def _handshake_message(self, role: str, deadline: float, wait: float) -> Hello | Welcome:
        """The next Hello/Welcome, version-checked; other messages stay queued for ``recv``."""
        while True:
            frames = self._frames(deadline)
            if frames is None:
                raise self._no_answer(role, wait)
            before = len(self._pending)
            self._decode(frames)
            if len(self._pending) == before:
                continue
            msg = self._pending[-1]
            if isinstance(msg, Hello | Welcome):
                self._pending.pop()
                self._check_peer(role, msg)
                return msg

    def _check_peer(self, role: str, msg: Hello | Welcome) -> None:
        try:
            check_version(msg)
        except VersionMismatch as exc:
            raise VersionMismatch(
                f"{role}: handshake with {self.peer} at {self.address} failed: {exc}"
            ) from None

    def _no_answer(self, role: str, wait: float) -> ChannelTimeout:
        return ChannelTimeout(
            f"{role}: no handshake from {self.peer} at {self.address} within {wait:.1f}s "
            f"(is it running and speaking Specter protocol {PROTOCOL_VERSION}?)"
        )

    # --- lifetime --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return bool(self.socket.closed)

    def close(self) -> None:
        """Close at once (linger 0: unsent frames are dropped) and remove a bound ipc socket file."""
        if self.closed:
            return
        self.socket.close(linger=0)
        if self.bound and self.address.startswith("ipc://"):
            Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)

    def __enter__(self) -> Channel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ChannelError(f"{self!r} is closed")

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else max(timeout_s, 0.0)


def _ms(seconds: float) -> int | None:
    """Seconds → zmq poll milliseconds (None: forever, for ``math.inf``)."""
    return None if math.isinf(seconds) else max(int(math.ceil(seconds * 1000)), 0)
