"""Fault injection for the roles as plain processes (``specter/remote/processes.py``), without Ray (the
GPU tests use it on a device machine, which has no Ray): kill a role at a known state, never at a time."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from specter.remote.processes import ProcessEngine


def after_transfers(engine: ProcessEngine, act: Callable[[], None], transfers: int = 3,
                    poll_s: float = 0.01) -> threading.Event:
    """``act()``, from a thread, once ``engine``'s transfer process has finished ``transfers`` more
    transfers than now (experts moving for the request running then); the event is set after it."""
    done = threading.Event()

    def inside() -> None:
        start = engine.transfer.call("counters")["transfers"]
        while engine.transfer.call("counters")["transfers"] < start + transfers:
            time.sleep(poll_s)
        act()
        done.set()

    threading.Thread(target=inside, daemon=True).start()
    return done


def kill_transfer_after(engine: ProcessEngine, transfers: int = 3, poll_s: float = 0.01) -> threading.Event:
    """SIGKILL ``engine``'s transfer process once it has finished ``transfers`` more transfers than now
    (``after_transfers``); the event is set after the kill."""
    pid = engine.transfer.pid
    assert pid is not None
    return after_transfers(engine, lambda: os.kill(pid, signal.SIGKILL), transfers, poll_s)
