"""Fault injection for drills and tests: kill one actor of a replica, by Ray or by signal, at a known state.

A kill is tied to what the replica is doing, never to a clock: ``KillInRequest`` watches the
verifier's ``progress`` (answered from its control thread while a request runs) and kills once the
replica's ``nth`` request has committed tokens, so the kill lands inside that request on a quiet
machine and on a loaded one alike.
"""

from __future__ import annotations

import os
import signal
import threading
import time
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


class KillInRequest:
    """Kill ``role`` of ``replica`` once its verifier is inside request ``nth`` (or a later one) with at least
    ``min_committed`` tokens committed, from a watcher thread (``start`` before the batch runs).

    After ``join``: ``fired`` is the verifier's progress as last seen before the kill (None if it
    never fired) and ``error`` says why not.

    Args:
        role: ``transfer``, ``draft`` or ``verifier``.
        how: ``"ray.kill"`` or a signal name.
        nth: the request (counted from the replica's start, 1-based) to kill inside.
        replica: the replica's name.
        min_committed: tokens of that request committed before the kill.
        bound_s: give up after this long (only a real hang reaches it).
        poll_s: how often the verifier's progress is read.
    """

    def __init__(self, role: str, how: str, nth: int = 2, replica: str = "r0", min_committed: int = 1,
                 bound_s: float = 120.0, poll_s: float = 0.005):
        self.role, self.how, self.nth, self.replica = role, how, nth, replica
        self.min_committed, self.bound_s, self.poll_s = min_committed, bound_s, poll_s
        self.fired: dict[str, Any] | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._watch, name="specter-fault", daemon=True)

    def start(self) -> KillInRequest:
        self._thread.start()
        return self

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.bound_s
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            seen = self._progress()
            if self._inside(seen):
                try:
                    kill_actor(self.replica, self.role, self.how)
                except Exception as exc:  # reported to the caller, who asserts on it
                    self.error = f"kill of {self.role} by {self.how} failed at {seen}: {exc}"
                    return
                self.fired = seen
                return
            time.sleep(self.poll_s)
        self.error = f"replica {self.replica} never reached request {self.nth} within {self.bound_s:.0f}s: {seen}"

    def _inside(self, seen: dict[str, Any]) -> bool:
        return bool(seen.get("active")) and seen.get("requests", 0) >= self.nth \
            and seen.get("committed", 0) >= self.min_committed

    def _progress(self) -> dict[str, Any]:
        try:
            verifier = ray.get_actor(f"specter-{self.replica}-verifier")
            return dict(ray.get(verifier.progress.remote(), timeout=10))
        except Exception as exc:  # not launched yet, or being relaunched
            return {"unavailable": type(exc).__name__}
