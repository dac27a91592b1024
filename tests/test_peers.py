"""A role's wait on a peer ends soon after the peer's process is gone (``specter/remote/peers.py``)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from specter.remote.counters import PID, SharedCounters
from specter.remote.link import _IDLE_S, nap
from specter.remote.peers import CHECK_S, Peer, PeerGone, running
from specter.remote.proposer import DraftError, RemoteProposer
from specter.remote.segments import new_prefix

BOUND_S = 30.0  # the waits' own timeout here: only a wait that missed the exit runs into it


def _exited_unreaped() -> subprocess.Popen:
    """A child that has exited and is not reaped yet (a zombie: its pid still in the process table)."""
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    return child


def test_running_is_false_for_an_exited_process_reaped_or_not() -> None:
    assert running(os.getpid())
    child = _exited_unreaped()
    try:
        assert os.path.exists(f"/proc/{child.pid}")  # still in the table: kill(pid, 0) alone would say alive
        assert not running(child.pid)
    finally:
        child.wait()
    assert not running(child.pid)


def test_a_peer_is_looked_at_no_more_than_every_check_s_and_named_when_gone() -> None:
    child = _exited_unreaped()
    try:
        peer = Peer("draft", child.pid)
        peer.check("x")  # looked at only CHECK_S after it was made
        time.sleep(CHECK_S)
        with pytest.raises(PeerGone, match=rf"^the draft process \(pid {child.pid}\) has exited while round 3 was"):
            peer.check("round 3 was awaited")
        Peer("draft", 0).check("x")  # an unknown pid is never looked at
    finally:
        child.wait()


def test_the_verifier_waiting_on_a_dead_draft_is_told_so_not_at_its_timeout() -> None:
    class Silent:  # a channel on which nothing ever comes
        peer_hello = None

        def recv(self, timeout_s: float) -> None:
            time.sleep(timeout_s)

    child = _exited_unreaped()
    try:
        proposer = RemoteProposer(Silent(), timeout_s=BOUND_S)  # type: ignore[arg-type]
        proposer.peer = Peer("draft", child.pid)  # what the handshake's Hello.pid gives
        with pytest.raises(DraftError, match=rf"draft: the draft process \(pid {child.pid}\) has exited while round 7"):
            proposer._wait(7, "answer")
    finally:
        child.wait()


def test_the_verifier_waiting_for_an_expert_is_told_when_the_transfer_process_is_gone() -> None:
    prefix = new_prefix()
    writer = SharedCounters(prefix, create=True)
    try:
        assert SharedCounters(prefix, create=False).writer.pid == os.getpid()  # the creator's, read by an attacher
        child = _exited_unreaped()
        try:
            writer._words[PID] = child.pid  # as though that process had made the counters
            reader = SharedCounters(prefix, create=False)
            end, idle = time.perf_counter() + BOUND_S, _IDLE_S
            with pytest.raises(PeerGone, match=rf"^the transfer process \(pid {child.pid}\) has exited while an expert"):
                while time.perf_counter() < end:
                    idle = nap(reader, end, idle)
        finally:
            child.wait()
    finally:
        writer.close()
