"""Specter's metrics, exported through Ray's metrics agent (``ray.util.metrics``).

Prometheus sees each as ``ray_<name>`` (counters with a ``_total`` suffix; histograms as
``_bucket``/``_sum``/``_count``), tagged ``replica`` and ``actor`` (``verifier``, ``transfer``,
``draft``, ``driver``, ``server``). ``METRICS`` is the engine's list (the scrape test checks each is
exported), ``SERVER_METRICS`` the server's; deploy/grafana's dashboard is checked against both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("replica", "actor")
TPOT_BOUNDARIES = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
ACCEPTED_BOUNDARIES = [0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32]


@dataclass(frozen=True)
class Metric:
    """One metric: its Ray name, kind, help text, and its name(s) in Prometheus."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str

    @property
    def prometheus(self) -> str:
        """The base name Prometheus shows (counters gain ``_total``, histograms ``_bucket`` …)."""
        return f"ray_{self.name}" + ("_total" if self.kind == "counter" else "")


METRICS = [
    Metric("specter_tpot_seconds", "histogram", "time per output token of each finished request"),
    Metric("specter_tokens_generated", "counter", "output tokens generated"),
    Metric("specter_requests", "counter", "requests finished"),
    Metric("specter_request_errors", "counter", "requests that raised (bad input, a lost peer, a timeout)"),
    Metric("specter_accepted_length", "histogram", "mean draft tokens accepted per round, per request"),
    Metric("specter_expert_hits", "counter", "needed experts already resident"),
    Metric(
        "specter_expert_inflight", "counter", "needed experts already on their way (prefetched, waited for)"
    ),
    Metric("specter_expert_misses", "counter", "needed experts fetched on demand"),
    Metric("specter_hit_rate", "gauge", "hit rate of the last request"),
    Metric("specter_prediction_recall", "gauge", "prediction recall of the last request"),
    Metric("specter_bytes_moved", "counter", "bytes copied host to device"),
    Metric("specter_link_busy_fraction", "gauge", "fraction of the last request's time the link was busy"),
    Metric("specter_queue_depth", "gauge", "prompts waiting (driver) or in flight (replica)"),
    Metric("specter_draft_rounds", "counter", "rounds drafted by the draft actor"),
    Metric("specter_rounds_ahead", "counter", "rounds drafted ahead, during the verify pass before them (pipelined)"),
    Metric("specter_rounds_ahead_kept", "counter", "rounds drafted ahead that stood (the rest were thrown away)"),
]
# The server's own (``specter serve``, tagged ``actor=server``): exported once requests reach it.
SERVER_METRICS = [
    Metric("specter_ttft_seconds", "histogram", "time to first token of each served request, queue wait excluded"),
    Metric("specter_server_rejected", "counter", "requests answered 429: the server's queue was full"),
    Metric("specter_server_cancelled", "counter", "requests whose client went away before the answer was complete"),
]
ALL_METRICS = METRICS + SERVER_METRICS
BY_NAME = {m.name: m for m in ALL_METRICS}
TTFT_BOUNDARIES = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]


class Recorder:
    """The metrics of one actor of one replica (created lazily: Ray's metric objects need a
    connected worker)."""

    def __init__(self, replica: str, actor: str):
        self.tags = {"replica": replica, "actor": actor}
        self._made: dict[str, Any] = {}

    def _get(self, name: str) -> Any:
        if name not in self._made:
            m = BY_NAME[name]
            if m.kind == "counter":
                self._made[name] = Counter(m.name, m.description, tag_keys=TAGS)
            elif m.kind == "gauge":
                self._made[name] = Gauge(m.name, m.description, tag_keys=TAGS)
            else:
                bounds = {"specter_tpot_seconds": TPOT_BOUNDARIES,
                          "specter_ttft_seconds": TTFT_BOUNDARIES}.get(name, ACCEPTED_BOUNDARIES)
                self._made[name] = Histogram(m.name, m.description, boundaries=bounds, tag_keys=TAGS)
        return self._made[name]

    def inc(self, name: str, value: float = 1.0) -> None:
        if value > 0:  # Ray's counters refuse non-positive increments
            self._get(name).inc(value, tags=self.tags)

    def set(self, name: str, value: float) -> None:
        self._get(name).set(value, tags=self.tags)

    def observe(self, name: str, value: float) -> None:
        self._get(name).observe(value, tags=self.tags)

    def request(self, stats: dict[str, Any]) -> None:
        """Record one finished request's stats (``RequestStats.to_dict``)."""
        self.inc("specter_requests")
        self.inc("specter_tokens_generated", stats.get("new_tokens", 0))
        if stats.get("new_tokens", 0) > 0:
            self.observe("specter_tpot_seconds", stats.get("tpot_s", 0.0))
        if stats.get("rounds"):
            self.observe("specter_accepted_length", stats.get("mean_accepted", 0.0))
        self.inc("specter_expert_hits", stats.get("hits", 0))
        self.inc("specter_expert_inflight", stats.get("inflight", 0))
        self.inc("specter_expert_misses", stats.get("misses", 0))
        self.set("specter_hit_rate", stats.get("hit_rate", 0.0))
        if "recall" in stats:
            self.set("specter_prediction_recall", stats["recall"])
        self.set("specter_link_busy_fraction", stats.get("link_busy_fraction", 0.0))
        self.inc("specter_rounds_ahead", stats.get("ahead_asked", 0))
        self.inc("specter_rounds_ahead_kept", stats.get("ahead_kept", 0))
