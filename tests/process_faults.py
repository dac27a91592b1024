"""Fault injection for the roles as plain processes (``specter/remote/processes.py``), without Ray (the
GPU tests use it on a device machine, which has no Ray): kill a role at a known state, never at a time."""

from __future__ import annotations

import os
import signal
import threading
import time

from specter.remote.processes import ProcessEngine


def kill_transfer_after(engine: ProcessEngine, transfers: int = 3, poll_s: float = 0.01) -> threading.Event:
    """SIGKILL ``engine``'s transfer process, from a thread, once it has finished ``transfers`` more
    transfers than now (experts moving for the request running then); the event is set after the kill."""
    pid = engine.transfer.pid
    assert pid is not None
    killed = threading.Event()

    def kill_inside() -> None:
        start = engine.transfer.call("counters")["transfers"]
        while engine.transfer.call("counters")["transfers"] < start + transfers:
            time.sleep(poll_s)
        os.kill(pid, signal.SIGKILL)
        killed.set()

    threading.Thread(target=kill_inside, daemon=True).start()
    return killed
