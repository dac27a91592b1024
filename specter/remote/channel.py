"""Thin ZeroMQ helpers for the plan plane: private ipc directories, loopback-only endpoints, and
a ``Channel`` that sends and receives protocol messages with timeouts everywhere.

A ``Channel`` wraps one socket (PUSH, PULL or PAIR). It never raises on garbage from the wire:
a frame that does not decode is dropped, counted in ``dropped`` by reason and logged (at most one
line per reason per second). Anything that can wait takes a timeout and, when it runs out, names
the peer and the endpoint. Endpoints are ``ipc://`` (in a 0700 directory) or loopback ``tcp://``
unless a caller passes ``expose=True`` explicitly. See docs/wire.md and docs/security.md.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
import shutil
import tempfile
import time
import weakref
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

log = logging.getLogger(__name__)

SOCKET_KINDS = {"push": zmq.PUSH, "pull": zmq.PULL, "pair": zmq.PAIR}
MAX_IPC_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
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


class IpcDir:
    """A fresh private (0700) directory for ``ipc://`` socket files, removed by ``cleanup()``.

    Args:
        base: where to make it (default: the system temp directory; keep it short, socket paths
            are limited to 107 characters).
    """

    def __init__(self, base: str | os.PathLike[str] | None = None):
        self.path = Path(tempfile.mkdtemp(prefix="specter-ipc-", dir=base))
        os.chmod(self.path, 0o700)  # mkdtemp already does; say it so that umask cannot matter
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), ignore_errors=True)

    def endpoint(self, name: str) -> str:
        """``ipc://DIR/name.sock`` inside this directory."""
        return endpoint("ipc", name, directory=self.path)

    def cleanup(self) -> None:
        """Remove the directory and every socket file in it (idempotent)."""
        self._finalizer()

    def __enter__(self) -> IpcDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def private_ipc_dir(base: str | os.PathLike[str] | None = None) -> IpcDir:
    """A fresh 0700 temp directory for ``ipc://`` sockets; use as a context manager or ``cleanup()``."""
    return IpcDir(base)


def endpoint(
    kind: str, name: str | int, directory: str | os.PathLike[str] | None = None, host: str = "127.0.0.1",
    expose: bool = False,
) -> str:
    """An endpoint string: ``ipc://DIRECTORY/NAME.sock`` or ``tcp://HOST:PORT`` (HOST 127.0.0.1).

    Args:
        kind: ``ipc`` or ``tcp``.
        name: for ipc a socket name (letters, digits, ``_.-``); for tcp a port (0 or ``*``: any free).
        directory: for ipc, the (private) directory of the socket file.
        host: for tcp, the address; anything but loopback needs ``expose=True``.
        expose: allow a non-loopback tcp host (see :func:`check_endpoint`).

    Raises:
        ValueError: a bad kind, name, port or directory, or a socket path that is too long.
    """
    if kind == "ipc":
        if directory is None:
            raise ValueError("endpoint('ipc', ...): give the directory (see private_ipc_dir())")
        if not _NAME.fullmatch(str(name)):
            raise ValueError(f"ipc socket name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
        return check_endpoint(f"ipc://{Path(directory) / f'{name}.sock'}")
    if kind == "tcp":
        port = "*" if str(name) in ("0", "*") else str(name)
        if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"tcp port {name!r}: must be 1-65535, or 0/'*' for any free port")
        return check_endpoint(f"tcp://{host}:{port}", expose=expose)
    raise ValueError(f"endpoint kind {kind!r}: must be 'ipc' or 'tcp'")


def check_endpoint(address: str, expose: bool = False) -> str:
    """Return ``address`` if it is ``ipc://``, ``inproc://`` or loopback ``tcp://``; else raise.

    Args:
        address: a ZeroMQ endpoint.
        expose: also accept a tcp host that is not loopback (``0.0.0.0``, ``*``, an interface or a
            public address). Nothing in Specter passes it: it is for a deployment that puts its own
            authentication and encryption in front of the plan plane (docs/security.md).

    Raises:
        ValueError: any other transport, a tcp host that is not loopback (the plan plane has no
            authentication, so it must never listen on or reach a network), or a long ipc path.
    """
    transport, sep, rest = address.partition("://")
    if not sep or not rest:
        raise ValueError(f"endpoint {address!r}: expected ipc://PATH or tcp://127.0.0.1:PORT")
    if transport == "ipc":
        if len(rest) > MAX_IPC_PATH:
            raise ValueError(
                f"ipc path {rest!r} is {len(rest)} characters, over {MAX_IPC_PATH}: use a shorter directory"
            )
        return address
    if transport == "inproc":
        return address
    if transport == "tcp":
        if expose:
            _port_checked_host(address, rest)
            log.warning("endpoint %s: exposed beyond loopback (expose=True); the plan plane has no authentication", address)
            return address
        _check_loopback(address, rest)
        return address
    raise ValueError(f"endpoint {address!r}: transport {transport!r} refused; use ipc:// or loopback tcp://")


def _port_checked_host(address: str, rest: str) -> str:
    """The host part of ``HOST:PORT`` after checking the port."""
    host, _, port = rest.rpartition(":")
    if not host or not port or not (port == "*" or port.isdigit()):
        raise ValueError(f"endpoint {address!r}: missing or bad host or port")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _check_loopback(address: str, rest: str) -> None:
    host = _port_checked_host(address, rest)
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"endpoint {address!r}: host {host!r} is not a loopback address; the plan plane only "
            "listens on and connects to 127.0.0.1 / ::1 (it has no authentication; expose=True overrides)"
        )


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
