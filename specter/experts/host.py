"""The host as a second place to run a routed expert: compute it from its host blob, not move it.

Fiddler-style: when a needed expert is not resident and its transfer would land later than the
host could finish computing it, the host computes it (same math, same dtype, from the store's
blob) while the device runs the resident experts; the layer ends at max(device part, host part).

On a CPU the host's time is simulated as the link's is: the math runs at once, and the layer then
waits until the host's deadline, ``HostConfig.expert_s`` after the host was free. One expert at a
time (experts share the host's memory bandwidth), so deadlines queue. Deadlines are in the run's
clock (``specter/timing/clock.py``): on the wall clock the layer sleeps until one, on a virtual clock
waiting moves the clock to it.
"""

from __future__ import annotations

from specter.config import HostConfig
from specter.experts.store import ExpertShape
from specter.timing.clock import WallClock


class HostCompute:
    """Timing and counters of expert compute on the host.

    Args:
        config: the host's rate (bytes/s, flops/s, per-expert latency).
        shape: the routed experts' shape (bytes read and flops per token of one expert).
        clock: the run's clock (default: the wall clock).
    """

    def __init__(self, config: HostConfig, shape: ExpertShape, clock: WallClock | None = None):
        self.config = config
        self.clock = clock or WallClock()
        self.nbytes = shape.nbytes
        self.flops_per_token = 2 * shape.numel  # one multiply-add per weight per token
        self.timed = True
        self.free_at = 0.0  # clock time at which the host finishes its queued experts
        self.experts = 0  # experts computed on the host
        self.busy_s = 0.0  # simulated host compute time
        self.wait_s = 0.0  # time the layer waited for the host after the device part was done

    def expert_s(self, tokens: int) -> float:
        """Seconds the host takes for one expert on ``tokens`` tokens (0 while untimed)."""
        return self.config.expert_s(self.nbytes, self.flops_per_token, tokens) if self.timed else 0.0

    def finish_time(self, tokens: int, now: float, free_at: float | None = None) -> float:
        """When an expert started now (behind whatever the host has queued) would be done."""
        return max(now, self.free_at if free_at is None else free_at) + self.expert_s(tokens)

    def start(self, tokens: int, now: float) -> float:
        """Queue one expert on the host; returns its deadline."""
        cost = self.expert_s(tokens)
        self.free_at = max(now, self.free_at) + cost
        self.experts += 1
        self.busy_s += cost
        return self.free_at

    def finish(self) -> float:
        """Block until the host's queued experts are done; returns the seconds waited."""
        waited = self.clock.wait_until(self.free_at)
        self.wait_s += waited
        return waited

    def snapshot(self) -> tuple[int, float, float]:
        return self.experts, self.busy_s, self.wait_s
