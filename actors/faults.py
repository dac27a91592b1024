"""Fault injection for drills and tests: kill one actor of a replica, by Ray or by signal."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import ray


def kill_actor(replica: str, role: str, how: str) -> None:
    """Kill ``specter-<replica>-<role>``: ``how`` is ``"ray.kill"`` or a signal name (``"SIGKILL"``)."""
    actor = ray.get_actor(f"specter-{replica}-{role}")
    if how == "ray.kill":
        ray.kill(actor, no_restart=True)
    else:
        pid = int(ray.get(actor.pid.remote()))  # type: ignore[call-overload]
        os.kill(pid, getattr(signal, how))


def kill_after_first(role: str, how: str, delay_s: float, replica: str = "r0") -> Callable[[dict[str, Any]], None]:
    """A batch ``on_result`` hook: after the first result, kill ``role`` of ``replica`` ``delay_s``
    later (while it runs its next prompt), from a thread so the batch goes on meanwhile."""
    fired = threading.Event()

    def kill() -> None:
        time.sleep(delay_s)
        kill_actor(replica, role, how)

    def hook(result: dict[str, Any]) -> None:
        if not fired.is_set():
            fired.set()
            threading.Thread(target=kill, daemon=True).start()

    return hook
