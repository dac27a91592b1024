"""Every Ray this project starts or joins: on loopback, with token authentication, connected in bounded time.

* ``start_local`` — the embedded Ray (``--address local``, tests, scripts): every Ray process binds
  127.0.0.1 and requires a token; unless ``RAY_AUTH_TOKEN`` is already set, a fresh random token is
  made for this process and handed to Ray's processes through the environment (nothing is written
  to ``~/.ray``).
* ``attach`` — a running cluster (``auto``, ``HOST:PORT``): the address is probed first, so an
  unreachable one fails at once with one line naming it; Ray's own connect is bounded by the same
  budget; token authentication is on unless the caller's environment says otherwise (the token comes
  from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, as Ray looks for it).

Ray starts its worker processes at niceness 15 (``worker_niceness``) so that tasks yield to the
driver. Specter's workers are the engine itself (the verify pass, the copy thread, the draft), so
the embedded Ray runs them at 0: at 15, any ordinary load on the machine starves them (the test
suite under ``stress-ng --cpu 2`` got through 15 tests in 30 minutes). A cluster's own ``ray start``
decides for its nodes (set ``RAY_worker_niceness=0`` there too).

Ray replaces a loopback address (``127.0.0.1``, ``localhost``) by the machine's interface address
before it binds or connects (``ray._private.services.resolve_ip_for_localhost``); ``_loopback_kept``
leaves loopback as given while ``ray.init`` runs, so a one-machine Ray stays off the network and the
address the user gave is the one used.

``ray.init`` also puts its own SIGTERM handling in place of the program's: first a Python handler that
calls ``sys.exit(15)`` (an embedded Ray's shutdown at exit then took 28–31 s here, with two of its
agents outliving the command), then, once its core worker is up, a C++ one that prints a stack dump
and aborts the process (status −6, ``/dev/shm`` segments of a starting replica left behind).
``_sigterm_kept`` gives a program that has a SIGTERM handler of its own (``specter``'s commands:
stop cleanly, status 143) that handler back, and hands it a SIGTERM Ray's Python handler took
meanwhile; a program without one keeps Ray's.

The embedded Ray's processes (GCS, raylet and, under it, the workers that run the actors) start in a
process group of their own (``_own_process_group``), as Ray does on Windows. In the driver's group a
signal to the whole group — ``timeout``, systemd's stop, Slurm's, ``kill -- -PGID`` — killed them
together with the driver, whose clean stop then waited on a dead GCS: ``specter serve`` took 60.8 s
and ended with status 1 and Ray's C++ errors. Now only the driver gets it, and it stops Ray. Ray's
processes still end with the driver when it is killed (the kernel's parent-death signal, Ray's
``fate_share``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch
from ray._private import services
from ray._raylet import AuthenticationTokenLoader, Config, GcsClient  # type: ignore[attr-defined]
from ray.exceptions import AuthenticationError

from specter.config import LinkConfig, env_defaults

DEFAULT_CONNECT_TIMEOUT_S = 30.0
LOOPBACK = "127.0.0.1"


class ConnectError(ConnectionError):
    """No Ray cluster could be reached or joined at an address (the message says what to check)."""


def check_local_gpu(address: str | None, link: LinkConfig | None) -> None:
    """Raise ``ValueError`` (one line, what to do) where a ``cuda`` link would run its actors on an
    embedded Ray (``address`` ``"local"``/None) and this machine's torch sees no CUDA device: said
    before Ray starts, where the cluster's own check (``require_gpu``) would come after it."""
    if address in (None, "local") and link is not None and link.kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("link: cuda puts the actors on a GPU, and this machine has none that torch can use "
                         "(--address local runs them here); use --link sim:GBPS, or --address a cluster with GPUs")


def init_ray(address: str | None, num_cpus: int = 2, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
    """``"local"``/None: start an embedded Ray; ``"auto"``/``HOST:PORT``/``ray://…``: attach to a cluster."""
    if address in (None, "local"):
        start_local(num_cpus)
    else:
        attach(address, connect_timeout_s)


def start_local(num_cpus: int = 2, **options: Any) -> None:
    """Start a Ray on this machine, bound to loopback, with token authentication (``options`` go to
    ``ray.init``; the dashboard stays off unless they turn it on)."""
    _token_auth(os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32))
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet this starts (see above)
    options.setdefault("include_dashboard", False)
    with _loopback_kept(), _sigterm_kept(), _own_process_group():
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, **options)


def attach(address: str, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
    """Join the cluster at ``address`` within ``timeout_s`` or raise ``ConnectError``.

    Raises:
        ConnectError: no cluster found (``auto``), the address does not answer, or Ray refused or
            did not finish the connection in time (wrong or missing token, not a Ray head).
        ValueError: ``address`` is not ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``.
    """
    if timeout_s <= 0:
        raise ValueError(f"connect timeout: must be > 0 seconds, got {timeout_s}")
    target = resolve(address)
    deadline = time.monotonic() + timeout_s
    host, port = _host_port(target)
    _probe(address, host, port, timeout_s)
    if os.environ.get("RAY_AUTH_MODE", "token") == "token":
        # Ray aborts the process (a C++ check, no exception) where token mode finds no token, and a
        # head without token authentication lets a driver with one connect and then kills its
        # actors: both are told here, before Ray is asked anything with this driver's token.
        if "://" not in target and not _head_checks_tokens(target):
            raise ConnectError(_tokenless(address, target, "runs without token authentication"))
        if not _token_found():
            raise ConnectError(_tokenless(address, target, "needs a token and this driver has none (RAY_AUTH_TOKEN, "
                                          "RAY_AUTH_TOKEN_PATH and ~/.ray/auth_token are unset or empty)"))
        _token_auth(os.environ.get("RAY_AUTH_TOKEN"))
    if "://" not in target:
        _check_token(address, target, timeout_s)
    # Ray retries its GCS connection once a second this many times (20 by default).
    left = max(1, int(deadline - time.monotonic()))
    env = {"RAY_gcs_server_port_wait_time_s": str(left)}
    try:
        with _loopback_kept(), env_defaults(env), _sigterm_kept():
            ray.init(address=target)
    except (ConnectionError, RuntimeError, AuthenticationError) as exc:
        refused = "token" in str(exc).lower() or isinstance(exc, AuthenticationError)
        what = "the cluster refused this driver's token (missing or not the cluster's)" if refused \
            else f"Ray did not finish connecting ({_first_line(exc)})"
        raise ConnectError(_failure(address, target, what, timeout_s)) from None


def resolve(address: str) -> str:
    """The ``HOST:PORT`` (or ``ray://…``) that ``address`` names; ``auto`` reads ``RAY_ADDRESS``, else
    the newest ``ray start`` head recorded on this machine."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    found = services.find_bootstrap_address(None)
    if not found:
        raise ConnectError("ray: --address auto found no running cluster on this machine (no RAY_ADDRESS, no "
                           "`ray start --head` recorded); start one, or give --address HOST:PORT or local")
    return found


def node_address() -> str:
    """The address this driver's Ray node registered with (``127.0.0.1`` for the embedded Ray)."""
    return str(ray.get_runtime_context().worker.node.node_ip_address)  # type: ignore[union-attr]


def _token_auth(token: str | None) -> None:
    """Token authentication for this process and the Ray processes it starts (``token``: put in the
    environment; None: Ray finds the token where it looks for one)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    if token:
        os.environ["RAY_AUTH_TOKEN"] = token
    _refresh_auth()


def _refresh_auth() -> None:
    """Ray caches the auth mode and token when it is imported: refresh them, as its ``ray.init`` does."""
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _token_found() -> bool:
    """Whether Ray would find a token for this driver where it looks (the environment, then files)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    paths = [os.environ.get("RAY_AUTH_TOKEN_PATH", ""), os.path.expanduser("~/.ray/auth_token")]
    return any(p and os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths)


def _head_checks_tokens(target: str) -> bool:
    """Whether the head refuses a token that cannot be its own (a fresh random one): a head started
    without token authentication takes any. Anything but a clean answer counts as checking (the
    connection that follows reports it)."""
    saved = os.environ.get("RAY_AUTH_TOKEN")
    _token_auth(secrets.token_hex(32))
    try:
        GcsClient(address=target)
    except Exception:  # AuthenticationError: it checks; anything else: ray.init reports it
        return True
    finally:
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN", None)
        else:
            os.environ["RAY_AUTH_TOKEN"] = saved
        _refresh_auth()
    return False


def _tokenless(address: str, target: str, what: str) -> str:
    given = target if address == target else f"{address} = {target}"
    return (f"ray: the cluster at {given} {what}; Specter joins clusters with token authentication only. "
            f"Start it with one (README, \"Through Ray actors\"): `ray stop`, `ray get-auth-token --generate && "
            f"chmod 600 ~/.ray/auth_token`, then `RAY_AUTH_MODE=token ray start --head`")


def _check_token(address: str, target: str, timeout_s: float) -> None:
    """Ask the GCS once (it answers at once): a token it refuses fails here, named as such."""
    try:
        GcsClient(address=target)
    except AuthenticationError:
        raise ConnectError(_failure(address, target, "the cluster refused this driver's token (missing or not "
                                    "the cluster's)", timeout_s)) from None
    except Exception:  # anything else: ray.init below reports it, within the same budget
        return


def _probe(address: str, host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise ConnectError(_failure(address, f"{host}:{port}", f"nothing answers there ({reason})",
                                    timeout_s)) from None


def _failure(address: str, target: str, what: str, timeout_s: float) -> str:
    given = target if address == target else f"{address} = {target}"
    return (f"ray: could not join a cluster at {given} within {timeout_s:.0f}s: {what}. Check that `ray start "
            f"--head` runs there, the node IP it was started with (--node-ip-address), and the token "
            f"(RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, the "
            f"cluster's own)")


def _host_port(target: str) -> tuple[str, int]:
    rest = target.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {target!r}: expected auto, local, HOST:PORT or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@contextlib.contextmanager
def _loopback_kept() -> Iterator[None]:
    """While it runs, Ray keeps a loopback host as given instead of swapping in the interface address."""
    original = services.resolve_ip_for_localhost

    def keep(host: str) -> str:
        return host if _is_loopback(host) else original(host)

    services.resolve_ip_for_localhost = keep
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


@contextlib.contextmanager
def _own_process_group() -> Iterator[None]:
    """While it runs, the processes ``ray.init`` starts (``services.ConsolePopen``) lead process groups
    of their own, where the kernel ends them with their parent (Linux: Ray's ``fate_share``); without
    that, Ray's reaper must share their group, and they stay in it."""
    if not ray._private.utils.detect_fate_sharing_support() or sys.platform == "win32":
        yield
        return
    original = services.ConsolePopen

    class OwnGroupPopen(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen  # type: ignore[misc]
    try:
        yield
    finally:
        services.ConsolePopen = original  # type: ignore[misc]


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Keep the program's own SIGTERM handler across ``ray.init`` (the module's docstring says what
    Ray puts there); a ``SystemExit(15)`` from Ray's handler inside is handed to it. A program whose
    SIGTERM has no Python handler (the default), or a call outside the main thread, keeps Ray's."""
    mine = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(mine):
        yield
        return
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        signal.signal(signal.SIGTERM, mine)
        mine(signal.SIGTERM, None)  # the program's own answer (``specter``: raise ``Terminated``)
        raise
    finally:
        signal.signal(signal.SIGTERM, mine)  # at the C level too: the abort handler is gone
