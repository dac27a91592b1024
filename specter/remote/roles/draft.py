"""The draft role: the draft model and its KV cache, serving rounds to the verifier over ZeroMQ."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from specter.config import LinkConfig
from specter.draft.loading import load_draft
from specter.models.graphed import window_counts
from specter.remote.channel import Channel
from specter.remote.draft_server import DraftServer
from specter.remote.roles.base import Metrics, NoMetrics, role_device

log = logging.getLogger(__name__)


class DraftRole:
    """Holds the draft; ``bind`` opens its pair socket and serves in a background thread.

    Args:
        draft_dir: a packed AWQ draft folder or a full-precision checkpoint.
        timeout_s: the handshake timeout.
        metrics: where its figures go (``actors/metrics.py: Recorder`` under Ray; default none).
        mode: how a quantized draft computes its experts (``load_draft``'s; ``auto`` times the modes here).
        link: the replica's link; the draft computes where the replica does (``role_device``: the CUDA
            device for a ``cuda`` link, else the CPU).
        step: how the draft's steps run (``load_draft``'s: ``auto`` graphs them on CUDA).
    """

    def __init__(self, draft_dir: str, timeout_s: float = 60.0, mode: str = "auto", metrics: Metrics | None = None,
                 link: LinkConfig | None = None, step: str = "auto"):
        self.metrics: Metrics = metrics or NoMetrics()
        self.draft = load_draft(draft_dir, device=role_device(link), mode=mode, step=step)
        self.timeout_s = timeout_s
        self.handshake_timeout_s = timeout_s
        self.channel: Channel | None = None
        self.plans: Channel | None = None  # push to the transfer process (its schedule runs on the plans)
        self.server: DraftServer | None = None
        self._stop = threading.Event()  # the process's lifetime: the round loop and the metrics thread
        self._pause = threading.Event()  # the round loop only (``serving_paused``)
        self._thread: threading.Thread | None = None

    def bind(self, endpoint: str, handshake_timeout_s: float | None = None) -> str:
        """Bind the pair socket at ``endpoint`` and serve (after the verifier's handshake, which may
        come as late as ``handshake_timeout_s``)."""
        if handshake_timeout_s is not None:
            self.handshake_timeout_s = handshake_timeout_s
        self.channel = Channel("pair", endpoint, bind=True, peer="verifier")
        self.server = DraftServer(self.draft, self.channel)
        self._thread = threading.Thread(target=self._serve, name="specter-draft", daemon=True)
        self._thread.start()
        threading.Thread(target=self._publish, name="specter-draft-metrics", daemon=True).start()
        return self.channel.address

    def connect_plans(self, endpoint: str) -> None:
        """Send each plan delta to the transfer process's socket at ``endpoint`` too (after ``bind``)."""
        assert self.server is not None, "bind() first"
        channel = Channel("push", endpoint, bind=False, peer="transfer", timeout_s=self.timeout_s)
        channel.handshake("draft", self.handshake_timeout_s)
        self.plans = channel
        self.server.plans = channel

    def wire_counters(self) -> dict[str, Any]:
        """Frames received on the pair socket, dropped per reason, refused per reason."""
        if self.channel is None or self.server is None:
            return {"received": 0, "dropped": {}, "refused": {}}
        return {"received": self.channel.received, "dropped": dict(self.channel.dropped),
                "refused": dict(self.server.rejections)}

    def prepare_steps(self, window: int) -> int:
        """Make the draft's step shapes of windows up to ``window`` ready now (1 to window + 2 tokens: a
        round's first step feeds what the last round committed; ``Engine.prepare_steps``), the round
        loop paused meanwhile. Returns how many token counts were made ready (0 where steps are eager)."""
        counts = window_counts(window, draft=True)
        graphed = getattr(self.draft, "graphed", None)
        if graphed is None:
            return 0
        with self.serving_paused(self.timeout_s) if self._thread is not None else nullcontext():
            return int(graphed.prepare(counts))

    def cold_steps(self) -> int:
        """The draft's steps so far that ran a token count first or captured its CUDA graphs (0 where
        its steps are eager): a request's one-offs, which ``prepare_steps`` takes out of requests."""
        graphed = getattr(self.draft, "graphed", None)
        return int(graphed.cold) if graphed is not None else 0

    def pid(self) -> int:
        """This worker's process id (fault-injection tests)."""
        return os.getpid()

    def rounds(self) -> int:
        """Rounds drafted so far."""
        return self.server.rounds if self.server else 0

    @contextmanager
    def serving_paused(self, timeout_s: float) -> Iterator[Channel]:
        """Stop the round loop and hand out the pair socket's channel (a pair socket has one user
        at a time), then serve again; the metrics thread runs on. For the wire fuzzer, which runs
        inside the process."""
        assert self.channel is not None and self._thread is not None
        self._pause.set()
        self._thread.join(timeout=timeout_s)
        try:
            yield self.channel
        finally:
            self._pause = threading.Event()
            self._thread = threading.Thread(target=self._serve, args=(False,), name="specter-draft", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket (removes its ipc file)."""
        self._stop.set()
        self._pause.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.channel is not None:
            self.channel.close()
        if self.plans is not None:
            self.plans.close()

    def _publish(self, every_s: float = 1.0) -> None:
        last = 0
        while not self._stop.wait(every_s):
            rounds = self.rounds()
            self.metrics.inc("specter_draft_rounds", rounds - last)
            last = rounds

    def _serve(self, handshake: bool = True) -> None:
        assert self.channel is not None and self.server is not None
        try:
            if handshake:
                self.channel.handshake("draft", self.handshake_timeout_s)
            self.server.serve(self._pause)
        except Exception:
            log.exception("draft: the round loop stopped")
