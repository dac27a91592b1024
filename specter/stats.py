"""Counters and per-request statistics. No Ray import: the actors export these as metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class OffloadCounters:
    """What the slot pool saw: hits, misses and the time the compute waited on the link.

    Attributes:
        hits: needed experts already in their slot when the layer asked.
        inflight: needed experts already on their way (a prefetch); the layer waited for the rest.
        misses: needed experts that were absent and fetched on demand.
        wait_s: seconds the compute blocked on transfers.
        layers: MoE layer calls executed.
    """

    hits: int = 0
    inflight: int = 0
    misses: int = 0
    wait_s: float = 0.0
    layers: int = 0

    def snapshot(self) -> OffloadCounters:
        return OffloadCounters(**asdict(self))

    def since(self, before: OffloadCounters) -> OffloadCounters:
        return OffloadCounters(**{k: getattr(self, k) - getattr(before, k) for k in asdict(self)})

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.inflight + self.misses
        return self.hits / total if total else 1.0


@dataclass
class RequestStats:
    """One request's figures, as ``generate`` returns them and ``--json`` prints them."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tpot_s: float = 0.0
    hits: int = 0
    inflight: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    wait_s: float = 0.0
    bytes_moved: int = 0
    link_busy_s: float = 0.0
    link_busy_fraction: float = 0.0
    transfers: int = 0
    bound_tpot_s: float | None = None  # no schedule of these rounds beats it (virtual clock only; specter/bound.py)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data
