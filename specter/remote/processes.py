"""An engine replica's three roles as plain processes, without Ray (``specter generate --processes``).

Ray cannot travel to every machine (its wheel is larger than what a lent GPU machine takes), and a
user may want the three processes without a cluster. Each role (``specter/remote/roles/``) runs in a
process of its own, started with ``multiprocessing``'s forkserver context and built from its arguments
there: the driver's first launch starts a server process that imports the roles' modules once (torch,
transformers, Specter: ~5 s of a CPU here) and forks every role from it, so a role is up in a fraction
of a second instead of importing them again (spawn: ~7 s for a replica's three on two cores, and as
long again to exit). The server only imports — it never touches CUDA — so a forked role initializes
CUDA itself, as a spawned one would (PyTorch supports CUDA under spawn and forkserver, not fork); each
role takes the driver's environment as it is at the role's start. The driver calls its control methods over a pipe —
``RoleProcess.call``: the method's name and arguments out, its result or its exception back. Between
the roles everything is as under Ray: ZeroMQ sockets and shared memory, wired and sealed by the same
code (``wiring.py``).

While a call waits, the driver watches the other roles' processes: one that ends (killed, crashed)
is reported at once as ``RoleGone``, naming the role, its pid and how it ended, and ``shutdown``
stops what is left (a role that does not answer ``close`` within its time is terminated, then
killed) and sweeps the replica's shared memory and ipc directory.

Ctrl-C: a terminal sends SIGINT to every process of its group, so the roles and the fork server
ignore it (the server from its start: it inherits the driver's ``SIG_IGN``, set while it is started)
and the driver, interrupted, terminates the roles (``ProcessEngine.shutdown``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import check_draft_matches
from specter.models.checkpoint import read_config_dict
from specter.remote.segments import unlink_prefix
from specter.remote.wiring import seal, wire

log = logging.getLogger(__name__)

ROLES = {"transfer": "specter.remote.roles.transfer.TransferRole",
         "verifier": "specter.remote.roles.verifier.VerifierRole",
         "draft": "specter.remote.roles.draft.DraftRole"}
PRELOAD = sorted({path.rsplit(".", 1)[0] for path in ROLES.values()})  # what the fork server imports once
_POLL_S = 0.05  # how often a waiting call looks at the other processes
_STREAM = "_stream_tokens"  # a call's keyword: the role's method hands its tokens back over the pipe as they come


class RoleGone(ConnectionError):
    """A role's process ended while the replica was in use."""


class RoleError(RuntimeError):
    """A role's method raised an exception that could not be sent back as itself."""


class RoleProcess:
    """One role in a process of its own, called over a pipe.

    Args:
        role: ``transfer`` | ``verifier`` | ``draft``.
        args, kwargs: the role's constructor arguments (built in the child).
    """

    def __init__(self, role: str, *args: Any, **kwargs: Any):
        if role not in ROLES:
            raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # read when the server starts: this process's first role
        _start_fork_server()
        self.role = role
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(ROLES[role], args, kwargs, child, dict(os.environ)),
                                       name=f"specter-{role}", daemon=True)
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        self.pid = self.process.pid
        self.started = False  # it said it was built
        self.awaiting: str | None = None  # a call whose answer is unread (its caller interrupted): the pipe's next

    def ready(self, timeout_s: float, watch: Sequence[RoleProcess] = ()) -> None:
        """Wait until the role is built (loading a model takes a while)."""
        kind, value = self._receive(timeout_s, watch, "start")
        if kind != "ready":
            raise RoleError(f"{self.role} process could not start: {value}")
        self.started = True

    def call(self, method: str, *args: Any, timeout: float | None = None, watch: Sequence[RoleProcess] = (),
             on_tokens: Callable[[list[int]], None] | None = None, **kwargs: Any) -> Any:
        """``role.method(*args, **kwargs)`` in the process; its exception is raised here (as a watched
        role's ``RoleGone`` where one of them has ended: the exception followed from that).
        ``on_tokens``: given, the method gets an ``on_tokens`` of its own that sends each list of
        tokens it is handed over the pipe, and this one is called with them here as they come
        (``timeout`` then bounds each wait for the next message).

        Raises:
            RoleError: an earlier call's answer is still due (it timed out or was interrupted): the
                pipe's next message is that answer, not this call's, so the role takes no more calls.
        """
        with self.lock:
            if self.awaiting is not None:
                raise RoleError(f"{self.role} process: the answer to {self.awaiting} is still due (that call timed "
                                f"out or was interrupted); it takes no more calls: stop this engine")
            self.awaiting = method
            try:
                self.conn.send((method, args, kwargs | ({_STREAM: True} if on_tokens is not None else {})))
            except (BrokenPipeError, OSError):
                raise self._gone(f"before {method}") from None
            kind, value = self._receive(timeout, watch, method)
            while kind == "tokens" and on_tokens is not None:
                on_tokens(value)
                kind, value = self._receive(timeout, watch, method)
            self.awaiting = None
        if kind == "ok":
            return value
        if isinstance(value, BaseException):
            for other in watch:  # the role's wait saw a peer's process gone (``peers``): say how it ended
                if not other.alive():
                    raise other._gone(f"while {self.role} ran {method}") from value
            raise value
        raise RoleError(f"{self.role}.{method}: {value}")

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout_s: float, close: bool = True) -> None:
        """``close`` the role and end the process (terminated, then killed, if it does not end in time).
        Without ``close``, or where the role is still being built or runs a call whose caller stopped
        waiting (Ctrl-C), it is terminated at once: it would answer ``close`` only once that work is done."""
        if close and self.alive() and self.started and self.awaiting is None:
            try:
                self.call("close", timeout=timeout_s)
            except Exception as exc:  # busy, gone or failing: ended below all the same
                log.info("%s: close: %s", self.role, exc)
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(None)
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)
        self.conn.close()

    def _receive(self, timeout_s: float | None, watch: Sequence[RoleProcess], what: str) -> tuple[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.conn.poll(_POLL_S):
            if not self.alive():
                raise self._gone(f"during {what}")
            for other in watch:
                if not other.alive():
                    raise other._gone(f"while {self.role} ran {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} process: no answer to {what} within {timeout_s:.0f}s")
        try:
            return self.conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            raise self._gone(f"during {what}") from None

    def _gone(self, when: str) -> RoleGone | RoleError:
        """What to raise for this process having ended: why it could not start, when it said so
        before it exited (seen by another role's wait as much as by its own), else how it ended."""
        self.process.join(0.5)
        if not self.started:
            with contextlib.suppress(EOFError, OSError):
                if self.conn.poll(0):
                    kind, value = self.conn.recv()
                    if kind == "error":
                        return RoleError(f"{self.role} process could not start: {value}")
        code = self.process.exitcode
        how = "is gone" if code is None else (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        return RoleGone(f"the {self.role} process (pid {self.pid}) {how} {when}")


def _start_fork_server() -> None:
    """Start the fork server (where none runs) with SIGINT ignored, which it inherits: it sets its own
    handlers only once it has imported ``PRELOAD`` (seconds), and a Ctrl-C in those seconds printed a
    ``KeyboardInterrupt`` traceback from inside transformers. Outside the main thread no handler can be
    set, and the server starts as before."""
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve(path: str, args: tuple[Any, ...], kwargs: dict[str, Any], conn: Connection, env: dict[str, str]) -> None:
    """The child: build the role, then answer calls until told to stop or the driver is gone."""
    from specter.remote.roles.base import setup_process

    os.environ.clear()  # the driver's, not the fork server's (which has the driver's of its own start)
    os.environ.update(env)
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hangup reaches the whole group: the driver stops us
        signal.signal(sig, signal.SIG_IGN)
    setup_process()
    module, name = path.rsplit(".", 1)
    try:
        role = getattr(import_module(module), name)(*args, **kwargs)
    except BaseException as exc:
        with contextlib.suppress(BrokenPipeError, OSError):  # the driver gone: nobody to tell
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    try:
        conn.send(("ready", os.getpid()))
    except (BrokenPipeError, OSError):  # the driver gone while the role was built (Ctrl-C): free what it holds
        role.close()
        return
    closed = False
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone: free what the role holds
            break
        if message is None:
            break
        method, call_args, call_kwargs = message
        closed = closed or method == "close"
        if call_kwargs.pop(_STREAM, False):
            call_kwargs["on_tokens"] = lambda tokens: conn.send(("tokens", list(tokens)))
        try:
            conn.send(("ok", getattr(role, method)(*call_args, **call_kwargs)))
        except BaseException as exc:
            _send_error(conn, exc)
    if not closed:
        role.close()


def _send_error(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send(("error", exc))
    except Exception:  # not picklable: its text
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclass
class ProcessEngine:
    """A replica's roles as processes: ``generate`` per request, ``shutdown`` at the end."""

    transfer: RoleProcess
    verifier: RoleProcess
    draft: RoleProcess | None
    prefix: str
    policy: str
    ipc_dir: str = ""
    closed: bool = False
    roles: list[RoleProcess] = field(default_factory=list)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, on_tokens: Callable[[list[int]], None] | None = None,
                 **options: Any) -> dict[str, Any]:
        """``{"tokens", "stats"}`` for one prompt (``VerifierRole.generate``'s options); ``on_tokens``:
        given, called with each step's or round's tokens as the verifier commits them."""
        return self.call(self.verifier, "generate", list(prompt_ids), max_new_tokens, on_tokens=on_tokens,  # type: ignore[no-any-return]
                         **options)

    def prepare_steps(self, window: int, timeout_s: float | None = None) -> dict[str, int]:
        """Make every step shape of windows up to ``window`` ready before a request runs one (the
        verifier's target and the draft process's steps: ``Engine.prepare_steps`` across the processes;
        the verifier keeps them ready across a policy change). Returns each role's count of token counts
        made ready (0 where its steps are eager)."""
        out = {"verifier": int(self.call(self.verifier, "prepare_steps", window, timeout=timeout_s))}
        if self.draft is not None:
            out["draft"] = int(self.call(self.draft, "prepare_steps", window, timeout=timeout_s))
        return out

    def link_counters(self) -> dict[str, float]:
        """The transfer role's link counters."""
        return self.call(self.transfer, "counters")  # type: ignore[no-any-return]

    def pids(self) -> dict[str, int | None]:
        return {role.role: role.pid for role in self.roles}

    def call(self, role: RoleProcess, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """A role's method, watching the other roles' processes meanwhile."""
        others = [r for r in self.roles if r is not role]
        return role.call(method, *args, timeout=timeout, watch=others, **kwargs)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every role (the verifier first: it tells the peers), sweep shared memory and the
        ipc directory; safe to call twice. Where a call was cut short (Ctrl-C while a role ran it), every
        role is terminated instead: they are inside a request, and a role closed alone waits for peers
        that will not answer."""
        if self.closed:
            return
        self.closed = True
        cut_short = any(role.awaiting is not None for role in self.roles)
        for role in (self.verifier, self.draft, self.transfer):
            if role is not None:
                role.stop(timeout_s, close=not cut_short)
        if self.ipc_dir and os.path.isdir(self.ipc_dir):
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        unlink_prefix(self.prefix)

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def launch_processes(
    model: str | Path, draft: str | Path | None, budget: SlotConfig, link: LinkConfig, policy: str = "specter",
    timeout_s: float = 60.0, startup_timeout_s: float = 300.0, sealed: bool = True, host_profile: str | None = None,
    draft_mode: str = "auto", dtype: torch.dtype | None = None, step: str = "auto",
) -> ProcessEngine:
    """Start and wire the roles of one replica as plain processes (``actors/launcher.py: launch``'s
    arguments, without the cluster's).

    A ``cuda`` link puts the replica on this machine's current CUDA device: the transfer process's
    slots (shared with the verifier by CUDA IPC), copy stream and pinned store, the verifier's and the
    draft's compute. ``dtype``: the target's compute dtype (None: fp32 on a CPU, the checkpoint's on a
    GPU). ``step``: how the target's and the draft's steps run (``OffloadedTarget.load``'s: ``auto``
    graphs them on CUDA; ``ProcessEngine.prepare_steps`` makes them ready before the first request).

    Raises:
        ValueError: the draft does not match the target (checked before any process starts).
        RoleError: a role could not be built (its exception's text, from its process).
        RoleGone, TimeoutError: a role ended or did not answer while starting.
    """
    if draft is not None and Path(draft, "config.json").is_file() and Path(model, "config.json").is_file():
        check_draft_matches(read_config_dict(Path(draft)), read_config_dict(Path(model)))
    prefix = f"specter-p{os.getpid()}-{secrets.token_hex(4)}"
    roles: list[RoleProcess] = []
    try:
        roles.append(RoleProcess("transfer", str(model), budget, link, prefix, timeout_s, dtype=dtype))
        roles.append(RoleProcess("verifier", str(model), budget, policy, timeout_s, link, host_profile, dtype=dtype,
                                 step=step))
        if draft is not None:
            roles.append(RoleProcess("draft", str(draft), timeout_s, draft_mode, link=link, step=step))
    except BaseException:  # Ctrl-C while the first waited for the fork server: end those already started
        for role in roles:
            role.stop(0.0, close=False)
        raise
    transfer, verifier, draft_role = roles[0], roles[1], roles[2] if draft is not None else None
    engine = ProcessEngine(transfer, verifier, draft_role, prefix, policy, roles=roles)
    try:
        for role in roles:
            role.ready(startup_timeout_s, [r for r in roles if r is not role])

        def call(role: RoleProcess, method: str, *args: Any, timeout: float) -> Any:
            return engine.call(role, method, *args, timeout=timeout)

        engine.ipc_dir, slots = wire(call, transfer, verifier, draft_role, startup_timeout_s)
        if sealed:
            seal(call, transfer, draft_role is not None, startup_timeout_s)
    except BaseException:
        engine.shutdown()
        raise
    log.info("processes: %d slots, pids %s", slots, engine.pids())
    return engine
