"""Validated, frozen configuration: one dataclass per concern.

Every check raises ``ValueError`` naming the field and what was expected, so a bad flag or file
fails before any work starts.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_bytes(text: str) -> int:
    """``"24GiB"`` → 25769803776; ``"512MB"`` → 512000000."""
    match = _BYTES.match(text)
    if not match:
        raise ValueError(f"expected a size like 512MiB or 24GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def compute_threads(requested: int | None = None) -> int:
    """torch's intra-op threads for a process that decodes: ``requested``, else ``OMP_NUM_THREADS``,
    else one core fewer than the machine has.

    The link's worker thread (and the host's experts) need a core of their own: measured on this
    project's 2-core machine (``scripts/draft_cost.py``, ``docs/draft.md``), two intra-op threads
    next to the link thread made a draft step inside the round 2.4-3x dearer than one thread did.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads: must be a positive integer, got {requested}")
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) - 1)


@contextlib.contextmanager
def env_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set the environment variables the caller has not set, for the duration only (processes started
    meanwhile keep them)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@dataclass(frozen=True)
class SlotConfig:
    """The device's expert budget.

    Exactly one of ``fraction`` (0 < f ≤ 1 of the routed experts), ``experts`` (a count) or
    ``nbytes`` is set. ``per_layer`` splits it evenly over the MoE layers.
    """

    fraction: float | None = None
    experts: int | None = None
    nbytes: int | None = None
    per_layer: bool = False

    def __post_init__(self) -> None:
        given = [x for x in (self.fraction, self.experts, self.nbytes) if x is not None]
        if len(given) != 1:
            raise ValueError("budget: give exactly one of a fraction, an expert count or a byte size")
        if self.fraction is not None and not (0 < self.fraction <= 1 and math.isfinite(self.fraction)):
            raise ValueError(f"budget: a fraction of the routed experts must be in (0, 1], got {self.fraction}")
        if self.experts is not None and self.experts < 1:
            raise ValueError(f"budget: an expert count must be >= 1, got {self.experts}")
        if self.nbytes is not None and self.nbytes < 1:
            raise ValueError(f"budget: a byte size must be >= 1, got {self.nbytes}")

    @classmethod
    def parse(cls, text: str, per_layer: bool = False) -> SlotConfig:
        """``"0.5"`` (fraction), ``"24"`` (experts) or ``"512MiB"`` (bytes)."""
        text = str(text).strip()
        if re.fullmatch(r"\d+", text):
            return cls(experts=int(text), per_layer=per_layer)
        try:
            return cls(fraction=float(text), per_layer=per_layer)
        except ValueError as exc:
            if "budget" in str(exc):
                raise
        try:
            return cls(nbytes=parse_bytes(text), per_layer=per_layer)
        except ValueError:
            raise ValueError(
                f"budget: expected a fraction in (0, 1], an expert count or a size like 512MiB, got {text!r}"
            ) from None

    def slots(self, layers: int, experts_per_layer: int, expert_bytes: int, top_k: int) -> int:
        """Slots per layer (``per_layer``) or in total, checked against the legal minimum.

        The smallest legal budget is one decode step of one MoE layer: its top-k experts.
        """
        total = layers * experts_per_layer
        if self.fraction is not None:
            count = round(self.fraction * (experts_per_layer if self.per_layer else total))
        elif self.experts is not None:
            count = self.experts
        else:
            count = int(self.nbytes or 0) // expert_bytes
        limit = experts_per_layer if self.per_layer else total
        count = min(count, limit)
        if count < top_k:
            scope = "per layer" if self.per_layer else "in total"
            raise ValueError(
                f"budget: {self.describe()} gives {count} expert slots {scope}, but one decode step of one "
                f"MoE layer needs its top-{top_k} experts resident; the minimum is {top_k} slots"
            )
        return count

    def groups(self, moe_layers: list[int], experts_per_layer: int, expert_bytes: int, top_k: int) -> dict[int, int]:
        """The slot pool's groups: MoE layer -> its slots (``per_layer``), or ``{-1: slots}`` shared by all."""
        count = self.slots(len(moe_layers), experts_per_layer, expert_bytes, top_k)
        return dict.fromkeys(moe_layers, count) if self.per_layer else {-1: count}

    def describe(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of the routed experts"
        if self.experts is not None:
            return f"{self.experts} experts"
        return f"{self.nbytes} bytes"


@dataclass(frozen=True)
class LinkConfig:
    """How experts move: ``cuda`` (copy stream) or a simulated link of set bandwidth/latency."""

    kind: str = "sim"
    bandwidth: float = 10e9
    latency: float = 10e-6

    def __post_init__(self) -> None:
        if self.kind not in ("sim", "cuda"):
            raise ValueError(f"link: kind must be 'sim' or 'cuda', got {self.kind!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"link: bandwidth must be a positive number of bytes/s, got {self.bandwidth}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"link: latency must be >= 0 seconds, got {self.latency}")

    @classmethod
    def parse(cls, text: str) -> LinkConfig:
        """``cuda`` or ``sim:GBPS[,LATENCY_US]`` (e.g. ``sim:10`` or ``sim:25,10``)."""
        text = text.strip()
        if text == "cuda":
            return cls(kind="cuda")
        match = re.fullmatch(r"sim:([0-9.eE+-]+)(?:,([0-9.eE+-]+))?", text)
        if not match:
            raise ValueError(f"link: expected 'cuda' or 'sim:GBPS[,LATENCY_US]', got {text!r}")
        try:
            gbps = float(match.group(1))
            latency_us = float(match.group(2)) if match.group(2) else 10.0
        except ValueError:
            raise ValueError(f"link: expected numbers in 'sim:GBPS[,LATENCY_US]', got {text!r}") from None
        return cls(kind="sim", bandwidth=gbps * 1e9, latency=latency_us * 1e-6)


ACTORS_VIA = ("ray", "processes")  # how the three roles run: Ray actors, or plain processes (remote/processes.py)
MIN_TEMPERATURE = 1e-3  # the smallest sampling temperature (the wire protocol refuses less too)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen: greedy at temperature 0, else sampled with top-k/top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T overflows: every probability NaN
            raise ValueError(f"temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class HostConfig:
    """How fast the host computes one routed expert from its host blob (instead of moving it).

    One expert on ``tokens`` tokens takes ``latency + max(bytes / bytes_per_s, tokens × flops /
    flops_per_s)``: at a few tokens it is memory-bound (the host reads the blob once), at many it
    is compute-bound. ``docs/profiles.md`` derives the figures of a real server CPU.
    """

    bytes_per_s: float
    flops_per_s: float = math.inf
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and math.isfinite(self.bytes_per_s)):
            raise ValueError(f"host: bytes_per_s must be a positive number, got {self.bytes_per_s}")
        if not self.flops_per_s > 0:
            raise ValueError(f"host: flops_per_s must be > 0, got {self.flops_per_s}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"host: latency must be >= 0 seconds, got {self.latency}")

    def expert_s(self, nbytes: float, flops_per_token: float, tokens: int) -> float:
        """Seconds to compute one expert of ``nbytes`` on ``tokens`` tokens."""
        return self.latency + max(nbytes / self.bytes_per_s, tokens * flops_per_token / self.flops_per_s)
