"""How a command ends on a signal.

Ctrl-C (SIGINT) raises ``KeyboardInterrupt``; inside ``terminating`` SIGTERM (``kill``, ``ray job
stop``, a scheduler ending a job, ``timeout``) and SIGHUP (the terminal closed: a window, an ssh
connection that dropped) raise ``Terminated``, a ``KeyboardInterrupt`` too, so every path that stops
cleanly on Ctrl-C — the commands' ``finally`` and ``with`` blocks, a batch's stop between prompts —
stops the same way on them. A command so stopped exits with ``exit_status``, 128 + the signal's
number (130, 143, 129), the status a shell gives a process the signal killed.

``handling`` is how every command installs its handlers: a signal the process was started ignoring
stays ignored (``nohup`` ignores SIGHUP; a shell script's background job ignores SIGINT, so that a
Ctrl-C meant for the foreground does not reach it), and on SIGHUP the standard output and error that
were the closed terminal are pointed at ``/dev/null`` before the handler runs (writing to a hung-up
terminal fails, and a stop's last lines would end the stop in an ``OSError``).

Ray's ``ray.init`` puts its own SIGTERM handling in place of the program's; ``actors.cluster`` hands
the program's back (``_sigterm_kept`` there). It leaves SIGHUP alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C
TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM
HUNG_UP = 128 + signal.SIGHUP  # 129: the terminal closed

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a command
_WORDS: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}
_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP (the terminal closed)"}

Handler = Callable[[int, Any], Any]

_seen = [0]  # the SIGTERM or SIGHUP ``raise_for`` raised for; 0 again when a ``handling`` starts


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (inside ``terminating``); ``signum`` says which."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum


def raise_for(signum: int) -> NoReturn:
    """What a handler raises to stop at once on ``signum``: ``KeyboardInterrupt`` for SIGINT, else
    ``Terminated`` (the signal remembered for ``signal_of``)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    _seen[0] = signum
    raise Terminated(signum)


def raise_terminated(signum: int, frame: Any) -> NoReturn:
    """The handler ``terminating`` installs: stop at once."""
    raise_for(signum)


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: its own for ``Terminated``; for a plain ``KeyboardInterrupt``, the
    SIGTERM or SIGHUP seen before it if one was (Ray's ``ray.get`` turns whatever its wait's signal
    check raised into a plain ``KeyboardInterrupt``), else SIGINT."""
    if isinstance(exc, Terminated):
        return exc.signum
    return _seen[0] or signal.SIGINT


def exit_status(signum: int) -> int:
    return 128 + signum


def stopped_word(signum: int) -> str:
    """What a command says it was: ``interrupted`` (Ctrl-C), ``terminated`` (SIGTERM), ``hung up``."""
    return _WORDS.get(signum, f"stopped by signal {signum}")


def signal_name(signum: int) -> str:
    """How a message names the signal: ``Ctrl-C``, ``SIGTERM``, ``SIGHUP (the terminal closed)``."""
    return _NAMES.get(signum, signal.Signals(signum).name)


@contextlib.contextmanager
def handling(handler: Handler, signals: tuple[int, ...] = STOPS) -> Iterator[None]:
    """Inside, each of ``signals`` calls ``handler(signum, frame)`` — except one the process ignores,
    which stays ignored; on SIGHUP, standard output and error that were a terminal and are one no more
    (hung up) write to ``/dev/null`` from then on. A signal remembered for ``signal_of`` is forgotten
    on the way in. The previous handlers are back afterwards. Outside the main thread, where no handler
    can be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _seen[0] = 0
    terminals = [fd for fd in (1, 2) if _is_terminal(fd)]

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            _leave_hung_up(terminals)
        handler(signum, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise ``Terminated`` (``handling``'s rules: an ignored one stays
    ignored); the previous handlers are back afterwards."""
    with handling(raise_terminated, (signal.SIGTERM, signal.SIGHUP)):
        yield


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _leave_hung_up(fds: list[int]) -> None:
    """Point each of ``fds`` that is no longer a terminal (a hung-up one answers no terminal query)
    at ``/dev/null``. A SIGHUP sent by hand, the terminal still there, changes nothing."""
    gone = [fd for fd in fds if not _is_terminal(fd)]
    if not gone:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in gone:
            os.dup2(null, fd)
    finally:
        os.close(null)
