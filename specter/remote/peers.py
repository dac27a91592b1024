"""Whether a peer's process still runs: a wait on a peer ends soon after that process is gone.

A replica's three roles always share one machine (their slots, counters and expert store are shared
memory), so each knows its peers by pid: the verifier knows the draft's from the pair handshake
(``Hello.pid``) and the transfer process's from the shared counters that process made
(``SharedCounters.writer``). A wait that has heard nothing for a while looks at the peer's process
(at most every ``CHECK_S``); one that has exited — or exited and is not reaped yet, a zombie — ends
the wait with ``PeerGone`` naming it, where the wait would otherwise run to its timeout (60 s by
default: a killed draft or transfer process held its request that long before the replica was
restarted).
"""

from __future__ import annotations

import os
import time

CHECK_S = 0.1  # a waiting role looks at its peer's process at most this often
_PROC = os.path.isdir("/proc/self")


class PeerGone(RuntimeError):
    """A peer role's process has exited while this role waited on it."""


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie — exited, not reaped yet — does not)."""
    if not _PROC:  # no /proc: whether the pid exists (a zombie passes)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True  # PermissionError included: it exists, another user's
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except FileNotFoundError:
        return False
    return line[line.rfind(b")") + 2:][:1] not in (b"Z", b"X")  # the state follows the (name)


class Peer:
    """A peer role's process, looked at by ``check`` at most every ``CHECK_S``.

    Args:
        role: what the peer is (``draft``, ``transfer``): the error names it.
        pid: its process (0: unknown, never looked at).
    """

    def __init__(self, role: str, pid: int):
        self.role, self.pid = role, int(pid)
        self._looked = time.monotonic()

    def check(self, waiting_for: str) -> None:
        """Raise ``PeerGone`` if the peer's process has exited (looked at no more than every ``CHECK_S``).

        Args:
            waiting_for: what this role waits for (the error says it).
        """
        now = time.monotonic()
        if self.pid <= 0 or now - self._looked < CHECK_S:
            return
        self._looked = now
        if not running(self.pid):
            raise PeerGone(f"the {self.role} process (pid {self.pid}) has exited while {waiting_for}")
