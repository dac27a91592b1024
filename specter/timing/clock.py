"""Whose seconds a run is measured in: the wall clock's, or a virtual clock's.

``WallClock``: real time. Compute takes what it takes, the simulated link and host sleep until
their transfers and experts are done. Figures then depend on this machine and its load.

``VirtualClock``: a discrete-event clock with three resources — the device's compute, the link
(``specter.experts.virtual_link.VirtualLink``: one transfer at a time, priorities and cancels as on the
wall clock) and the host's expert compute (``specter.experts.host.HostCompute``). Every forward
still runs for real (tokens, routing and acceptance are the model's), but nothing sleeps: a wait
advances the clock to when the transfer lands or the host is done. How long compute takes is

* ``costs`` given (clock name ``virtual``): *charged* from a cost model
  (``specter.timing.costs.CostModel``): a GPU's proportions, the same on any machine and under any load;
* ``costs`` and ``dispatch`` given (clock name ``as-built``): the same kernel times (the draft's
  experts as the draft computed them: ``DraftModel.last_compute``, where the ideal draft runs int4), and the
  dispatch of the ops and reads the step actually issues (``specter.timing.dispatch``), counted as
  it runs: the host issues each op in ``dispatch.op_s`` and the device runs the charged kernels
  behind it, never before the host has issued them; a read of device data waits for the device to
  drain and costs ``dispatch.read_s``. So a step whose kernels are short takes its dispatch, one
  whose kernels are long its kernels — the engine as built on that GPU, where ``virtual`` is the
  ideal engine (the cost model's fixed launches per layer and expert, no host work);
* no ``costs`` (clock name ``measured``): the compute's measured duration on this CPU — the main
  thread's real time between two readings of the clock, less the link's bookkeeping — which is
  the wall clock with its waits charged by the event model (``docs/benchmark.md`` validates it
  against the wall clock). It idles through each wait as the wall clock does, without counting
  it: on this CPU compute right after an idle stretch runs 2–4× slower than back to back (caches
  and predictors gone cold), so a clock that jumped would time its compute warmer than a real
  run's. ``VirtualClock(None, idle=False)`` jumps instead (the gap that makes is in the same doc).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Protocol

from specter.timing import CLOCKS
from specter.timing.dispatch import Dispatch, DispatchCount

if TYPE_CHECKING:
    from specter.models.routing import DraftCompute, Routing
SPIN_S = 5e-4  # the wall clock stops sleeping this long before a deadline and yields instead


class Costs(Protocol):
    """What the virtual clock charges compute by (``specter.timing.costs.CostModel``)."""

    def dense_s(self, positions: int, context: int) -> float: ...

    def expert_s(self, tokens: int) -> float: ...

    def draft_s(self, routing: Routing, positions: int, context: int, compute: DraftCompute | None = None) -> float: ...

    def describe(self) -> str: ...


class WallClock:
    """Real time (``time.perf_counter``); charges are no-ops, waits sleep."""

    name = "wall"
    virtual = False

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, deadline: float) -> float:
        """Block until ``deadline``; returns the seconds waited."""
        start = time.perf_counter()
        if deadline <= start:
            return 0.0
        if deadline - start > SPIN_S:
            time.sleep(deadline - start - SPIN_S)
        while time.perf_counter() < deadline:  # the last stretch yielding, not sleeping: a sleep
            time.sleep(0)  # overshoots by ~0.3 ms on this machine
        return time.perf_counter() - start

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Work that is not the device's (the virtual link's copies); on the wall clock it counts."""
        yield

    def charge_dense(self, positions: int, context: int) -> float:
        """One MoE layer's dense part (attention, norms, router) over ``positions`` positions;
        returns the seconds charged (none here: real time passes by itself)."""
        return 0.0

    def charge_expert(self, tokens: int) -> None:
        """One routed expert of the target on ``tokens`` tokens, from a device slot."""

    def charge_draft(
        self, routing: Routing, positions: int, context: int, compute: DraftCompute | None = None,
    ) -> None:
        """One draft forward over ``positions`` positions with ``routing`` per MoE layer, its experts
        computed as ``compute`` says (``DraftModel.last_compute``)."""

    def counting(self) -> AbstractContextManager[object]:
        """Around a request: where the clock charges dispatch, the ops and reads are counted in it."""
        return nullcontext()

    def describe(self) -> str:
        return "wall"


class VirtualClock(WallClock):
    """Virtual seconds, starting at 0; compute charged from ``costs`` (None: measured).

    Args:
        costs: the cost model; None charges each stretch of compute its measured duration.
        idle: measured only: sleep through each wait (uncounted) as the wall clock would, so that
            the compute after it is timed in the state a real run computes it in.
    """

    virtual = True

    def __init__(self, costs: Costs | None = None, idle: bool = True, dispatch: Dispatch | None = None):
        if dispatch is not None and costs is None:
            raise ValueError("dispatch: charged on the virtual clock only (give a cost model)")
        self.costs = costs
        self.dispatch = dispatch
        self.name = "measured" if costs is None else "as-built" if dispatch is not None else "virtual"
        self.idle = idle and costs is None
        self._t = 0.0  # the device's timeline: when the work charged so far is done
        self._host = 0.0  # the host's (as-built): when it has issued the ops counted so far
        self._issued = 0.0  # the host's time at the previous flush: where the work charged since was issued
        self._mark = time.perf_counter()
        self._counter: DispatchCount | None = None
        self._counted = (0, 0, 0, 0, 0, 0)  # ops, reads, kernels (then the step's own of each) turned into time
        self.draft_charged = 0.0  # seconds charged to draft forwards so far (the bound's device part)
        self.dispatch_s = 0.0  # host seconds of dispatch charged so far (ops and reads)

    def now(self) -> float:
        if self.costs is None:  # the compute since the last reading took what it took
            mark = time.perf_counter()
            self._t += mark - self._mark
            self._mark = mark
        self._flush()
        return max(self._t, self._host)

    def counting(self) -> AbstractContextManager[object]:
        if self.dispatch is None:
            return nullcontext()
        return self._count()

    @contextmanager
    def _count(self) -> Iterator[None]:
        self._flush()
        counter = DispatchCount()
        self._counter, self._counted = counter, (0, 0, 0, 0, 0, 0)
        try:
            with counter:
                yield
        finally:
            self._flush()
            self._counter = None

    def _flush(self) -> None:
        """Turn the ops and reads counted since the last flush into host time (``as-built``)."""
        counter, dispatch = self._counter, self.dispatch
        if counter is None or dispatch is None:
            return
        now = (counter.ops, counter.reads, counter.kernels, counter.step_ops, counter.step_reads,
               counter.step_kernels)
        if now == self._counted:
            return
        new = [a - b for a, b in zip(now, self._counted, strict=True)]
        self._counted = now
        # each layer of the small model stands for ``layer_scale`` real ones, and so do its ops and reads;
        # a step's own (``once_per_step``: the embedding, the LM head, the step's read) stay one each
        scale = getattr(self.costs, "layer_scale", 1.0)
        ops, reads, kernels = ((new[i] - new[i + 3]) * scale + new[i + 3] for i in range(3))
        op_s, read_s = ops * dispatch.op_s, reads * dispatch.read_s
        self._issued = self._host
        self._host += op_s
        if kernels and dispatch.kernel_s:  # the device's floor per kernel, from when they were issued
            self._t = max(self._t, self._issued) + kernels * dispatch.kernel_s
        self.dispatch_s += op_s + read_s
        if reads:  # the host waits for the device to drain, then for the copy back
            self._host = self._t = max(self._t, self._host) + read_s
            self._issued = self._host

    def _device(self, cost: float) -> None:
        """Device work of ``cost`` seconds, issued by the host since the last flush."""
        self._flush()
        self._t = max(self._t, self._issued) + cost

    def wait_until(self, deadline: float) -> float:
        now = self.now()
        if deadline <= now:
            return 0.0
        self._t = self._host = deadline
        if self.idle:
            time.sleep(deadline - now)
            self._mark = time.perf_counter()  # the sleep is the wait already charged, not compute
        return deadline - now

    @contextmanager
    def excluded(self) -> Iterator[None]:
        self.now()
        try:
            yield
        finally:
            self._mark = time.perf_counter()

    def advance(self, seconds: float) -> None:
        self._device(seconds)

    def charge_dense(self, positions: int, context: int) -> float:
        cost = self.costs.dense_s(positions, context) if self.costs is not None else 0.0
        self._device(cost)
        return cost

    def charge_expert(self, tokens: int) -> None:
        if self.costs is not None:
            self._device(self.costs.expert_s(tokens))

    def charge_draft(
        self, routing: Routing, positions: int, context: int, compute: DraftCompute | None = None,
    ) -> None:
        if self.costs is not None:  # the ideal engine's draft computes int4; as built, the draft's own path
            as_built = compute if self.dispatch is not None else None
            cost = self.costs.draft_s(routing, positions, context, as_built)
            self._device(cost)
            self.draft_charged += cost

    def describe(self) -> str:
        if self.costs is not None and self.dispatch is not None:
            return f"as-built ({self.costs.describe()}; {self.dispatch.describe()})"
        if self.costs is not None:
            return f"virtual ({self.costs.describe()})"
        return f"measured (virtual link and host{', idling through waits' if self.idle else ''})"


def make_clock(name: str, costs: Costs | None = None, idle: bool = True, dispatch: Dispatch | None = None) -> WallClock:
    """``wall`` | ``virtual`` (needs ``costs``) | ``as-built`` (``costs`` and ``dispatch``) |
    ``measured`` (``idle``: see ``VirtualClock``)."""
    if name == "wall":
        return WallClock()
    if name in ("virtual", "as-built"):
        if costs is None:
            raise ValueError(f"clock: {name!r} charges compute from a cost model; give a profile")
        if name == "as-built" and dispatch is None:
            raise ValueError("clock: 'as-built' charges dispatch; give its per-op and per-read costs")
        return VirtualClock(costs, dispatch=dispatch if name == "as-built" else None)
    if name == "measured":
        return VirtualClock(None, idle=idle)
    raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {name!r}")
