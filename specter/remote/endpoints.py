"""Where the plan plane's sockets live: private (0700) ``ipc://`` directories and endpoints that are
``ipc://`` or loopback ``tcp://`` unless a caller exposes them on purpose (docs/security.md)."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

MAX_IPC_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
