"""How a command ends on a signal.

Ctrl-C (SIGINT) raises ``KeyboardInterrupt``; inside ``terminating`` SIGTERM (``kill``, ``ray job
stop``, a scheduler ending a job, ``timeout``) raises ``Terminated``, a ``KeyboardInterrupt`` too, so
every path that stops cleanly on Ctrl-C — the commands' ``finally`` and ``with`` blocks, a batch's
stop between prompts — stops the same way on it. A command so stopped exits with ``exit_status``,
128 + the signal's number (130, 143), the status a shell gives a process the signal killed.

Ray's ``ray.init`` puts its own SIGTERM handling in place of the program's; ``actors.cluster`` hands
the program's back (``_sigterm_kept`` there).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C
TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM


_sigterm_seen = threading.Event()  # set by ``raise_terminated``; cleared when ``terminating`` starts


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (inside ``terminating``)."""


def raise_terminated(signum: int, frame: Any) -> NoReturn:
    _sigterm_seen.set()
    raise Terminated


def raise_for(signum: int) -> NoReturn:
    """What a handler raises to stop at once on ``signum``: ``Terminated`` for SIGTERM (remembered for
    ``signal_of``), else ``KeyboardInterrupt``."""
    if signum == signal.SIGTERM:
        raise_terminated(signum, None)
    raise KeyboardInterrupt


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: SIGTERM for ``Terminated``, and for a ``KeyboardInterrupt`` once a
    SIGTERM was seen (Ray's ``ray.get`` turns whatever its wait's signal check raised into a plain
    ``KeyboardInterrupt``); else SIGINT."""
    return signal.SIGTERM if isinstance(exc, Terminated) or _sigterm_seen.is_set() else signal.SIGINT


def exit_status(signum: int) -> int:
    return 128 + signum


def stopped_word(signum: int) -> str:
    """What a command says it was: ``interrupted`` (Ctrl-C) or ``terminated`` (SIGTERM)."""
    return "terminated" if signum == signal.SIGTERM else "interrupted"


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    """Inside, SIGTERM raises ``Terminated``; the previous handler is back afterwards. Outside the main
    thread, where no handler can be set, SIGTERM keeps what it had."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _sigterm_seen.clear()
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
