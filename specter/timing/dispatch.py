"""Dispatch: the ops a step issues and the reads of device data it makes, counted as it runs.

On a GPU every op that reaches a kernel is a launch (host time, ~5–10 µs in eager PyTorch) and
every read of device data into Python a sync that stops the host from running ahead. A step's
time there is its kernels' time *and* this dispatch (``docs/benchmark.md``), so both are counted:

* ``host_read(tensor)`` — the one way the hot path reads device data into Python: it counts the
  read in ``READS`` (the process-wide total the engine's stats report per request) and returns
  the values as a list.
* ``defer_read(tensor, then)`` — device data the host wants to know but need not wait for (a fully
  resident layer's routing: for the counters, the trace, the policy): it is read together with the
  next ``host_read`` of the same dtype, in the same sync, and ``then`` gets its values (numpy) then;
  ``flush_reads()`` reads what is left (the end of a request).
* ``replay()`` — ops issued inside count as one launch: a captured CUDA graph's replay. On a CPU the
  graphed steps' pieces (``models/graphed.py``) run eagerly inside it, so the counts and the as-built
  clock see what a GPU's replay of them issues.
* ``once_per_step`` — ops, kernels and reads issued inside are a step's own, not a layer's (the token
  embedding, the mask and rotation, the final norm and the LM head, the step's token and routing
  read): the as-built clock charges them once where a small model's layer stands for several real
  ones (``DispatchCount.step_ops``), and everything else once per real layer.
* ``DispatchCount`` — a ``TorchDispatchMode`` that counts the ops reaching a kernel (views,
  allocations and other metadata-only ops excluded), every ``tolist``, ``item``, ``int(t)``,
  ``float(t)`` or ``bool(t)`` made while it is active (``reads``: through ``host_read`` or not, so
  a read that bypasses it still shows), and
  the ops that sync on a GPU by themselves (``nonzero``, boolean indexing, ``unique``: their output
  shape needs the device's data). Used by tests and ``scripts/dispatch_count.py`` to count through
  the public API; the hot path does not run under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel: allocation, metadata, aliasing.
_FREE = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
    "set_", "resize_", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "is_same_size",
    "_local_scalar_dense",  # a read (counted as one), not a kernel
}
# Ops whose result (shape or value) the host needs from the device: each is a sync on a GPU.
_SYNCING = {"nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "masked_select"}


@dataclass(frozen=True)
class Dispatch:
    """What the host spends per op and per read on a GPU, as the engine issues them.

    Attributes:
        name: the calibration's name.
        op_s: host seconds per op reaching a kernel (the launch and the eager Python around it); a CUDA
            graph's replay is one op.
        read_s: seconds per read of device data (the sync and the copy back), after the device drained.
        kernel_s: device seconds every kernel takes at least (inside a graph too), beside the roofline
            time the cost model charges: what bounds a graphed step of many tiny kernels.
        source: where the figures come from.
    """

    name: str
    op_s: float
    read_s: float
    source: str = ""
    kernel_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.op_s >= 0 and self.read_s >= 0 and self.kernel_s >= 0):
            raise ValueError(f"dispatch {self.name}: op_s, read_s and kernel_s must be >= 0, got {self.op_s}, "
                             f"{self.read_s}, {self.kernel_s}")

    def describe(self) -> str:
        floor = f", {self.kernel_s * 1e6:.1f} us/kernel on the device" if self.kernel_s else ""
        return f"dispatch {self.name}: {self.op_s * 1e6:.1f} us/op, {self.read_s * 1e6:.1f} us/read{floor}"


# Calibrations (docs/benchmark.md, "The as-built clock"). ``h200-eager``: the lent H200 running the engine
# at commit d141f91 (shared NOTES, "First run on a GPU", 2026-12-04). ``op_s`` is fitted on the three
# all-resident runs there (scripts/validate_dispatch.py: 93 and 63 ops per MoE layer per token at
# Qwen1.5-MoE and Mixtral shapes, counted on the CPU), ``read_s`` set to a sync and a small copy back;
# the offloaded runs are then predicted, not fitted (docs/results/validate-dispatch). An op here is
# the launch *and* the eager Python around it in that code (26.99 us, where a bare launch is ~5 us).
DISPATCH: dict[str, Dispatch] = {
    d.name: d
    for d in (
        Dispatch("h200-eager", op_s=27e-6, read_s=15e-6,
                 source="H200 runs of d141f91 (2026-12-04), fitted by scripts/validate_dispatch.py"),
        # ``h200-graphs``: the engine with CUDA graphs (fa408d0, 2026-12-04). The same run's eager resident
        # step (7.18 ms per 4 layers, 179 ops) gives ~40 us an op; the graphed draft step (1.21 ms, ~4
        # launches and ~180 kernels, its bytes ~0.2 ms at 4.8 TB/s) ~5.5 us a kernel.
        Dispatch("h200-graphs", op_s=40e-6, read_s=15e-6, kernel_s=5.5e-6,
                 source="H200 run of fa408d0 (2026-12-04): eager and graphed rows of one bench run"),
    )
}
DEFAULT_DISPATCH = "h200-eager"


class _Reads:
    """The process-wide count of ``host_read`` calls (the engine reports its growth per request)."""

    def __init__(self) -> None:
        self.count = 0


READS = _Reads()
_ACTIVE: list[DispatchCount] = []
_REPLAYING = [0]  # depth of ``replay()`` blocks


class _OncePerStep(threading.local):
    """``with once_per_step:`` — what is issued inside is the step's own, whatever its layers
    (``DispatchCount.step_ops``). A plain context object (on the per-step path, cheaper than a
    generator's); its depth is per thread (another thread's step is not this one's)."""

    depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


once_per_step = _OncePerStep()


_DEFERRED: list[tuple[torch.Tensor, Callable[[np.ndarray], None]]] = []


def host_read(tensor: torch.Tensor) -> Any:
    """``tensor``'s values in Python (``tolist``: a list, or a number for a 0-d tensor): one counted read of
    device data (a sync on a GPU), which also reads the deferred ones of its dtype (``defer_read``)."""
    pending = [d for d in _DEFERRED if d[0].dtype == tensor.dtype and d[0].device == tensor.device]
    if not pending:
        READS.count += 1
        return tensor.tolist()
    _DEFERRED[:] = [d for d in _DEFERRED if not any(d is p for p in pending)]
    values = _read_together([tensor, *(t for t, _ in pending)])
    for (_, then), value in zip(pending, values[1:], strict=True):
        then(value)
    return values[0].tolist()


def defer_read(tensor: torch.Tensor, then: Callable[[np.ndarray], None]) -> None:
    """Read ``tensor`` with the next read of device data (no sync of its own); ``then`` gets its values."""
    _DEFERRED.append((tensor, then))


def flush_reads() -> None:
    """Read every deferred tensor now (one read per dtype) and hand each its values."""
    while _DEFERRED:
        dtype = _DEFERRED[0][0].dtype
        pending = [d for d in _DEFERRED if d[0].dtype == dtype]
        _DEFERRED[:] = [d for d in _DEFERRED if d[0].dtype != dtype]
        for (_, then), value in zip(pending, _read_together([t for t, _ in pending]), strict=True):
            then(value)


def drop_deferred() -> None:
    """Forget the deferred reads (a request that failed: nobody waits for them)."""
    _DEFERRED.clear()


def _read_together(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Several tensors of one dtype in one counted read, each back in its shape."""
    READS.count += 1
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
    values = np.asarray(flat.tolist())
    out, start = [], 0
    for t in tensors:
        out.append(values[start : start + t.numel()].reshape(tuple(t.shape)))
        start += t.numel()
    return out


@contextmanager
def replay(per_step: bool = False) -> Iterator[None]:
    """The ops inside are one CUDA graph's replay: counted as one op (``graph_replay``), not each;
    ``per_step``: the launch is the step's own (a whole step in one graph), its kernels the layers'."""
    _REPLAYING[0] += 1
    try:
        yield
    finally:
        _REPLAYING[0] -= 1
        if not _REPLAYING[0]:
            for counter in _ACTIVE:
                counter.ops += 1
                counter.step_ops += per_step or once_per_step.depth > 0
                counter.by_name["graph_replay"] = counter.by_name.get("graph_replay", 0) + 1


class DispatchCount(TorchDispatchMode):
    """Counts ops that reach a kernel (``ops``), implicit syncs (``syncs``) and reads of tensor values
    into Python (``reads``) while active; ``by_name`` breaks the ops down by aten name, ``kernels_by_name``
    the kernels (a replay's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0  # host launches (a graph's replay is one)
        self.kernels = 0  # kernels the device runs (inside a replay too)
        self.syncs = 0
        self.reads = 0
        # of those, issued inside ``once_per_step``: the step's own, not its layers'
        self.step_ops = self.step_kernels = self.step_reads = 0
        self.by_name: dict[str, int] = {}
        self.kernels_by_name: dict[str, int] = {}

    def __enter__(self) -> DispatchCount:
        if not _ACTIVE:
            _patch_reads()
        _ACTIVE.append(self)
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _unpatch_reads()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        once = once_per_step.depth > 0
        if name == "_local_scalar_dense":  # item(), int(t), float(t), bool(t): a read of one value
            self.reads += 1
            self.step_reads += once
        if name in _SYNCING:
            self.syncs += 1
        out = func(*args, **(kwargs or {}))
        if not (name in _FREE or func.is_view and not _copied(args, out)):
            self.kernels += 1
            self.step_kernels += once
            self.kernels_by_name[name] = self.kernels_by_name.get(name, 0) + 1
            if not _REPLAYING[0]:
                self.ops += 1
                self.step_ops += once
                self.by_name[name] = self.by_name.get(name, 0) + 1
        return out


def _copied(args: Any, out: Any) -> bool:
    """Whether an op whose schema may alias its input (``is_view``) made a new tensor instead: under
    ``torch.inference_mode`` a dtype or device change arrives as ``aten.to`` itself (annotated as
    aliasing: it returns its input where nothing changes), not as the ``_to_copy`` it runs — a kernel."""
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if source is None or not isinstance(out, torch.Tensor) or not out.numel():
        return False
    return bool(out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr())


_ORIGINAL: list[Any] = []  # Tensor.tolist while a counter patches it


def _patch_reads() -> None:
    """Count ``Tensor.tolist`` (which does not pass the dispatcher) while counting."""
    original = torch.Tensor.tolist
    _ORIGINAL.append(original)

    def counted(self: torch.Tensor, *args: Any) -> Any:
        for counter in _ACTIVE:
            counter.reads += 1
            counter.step_reads += once_per_step.depth > 0
        return original(self, *args)

    torch.Tensor.tolist = counted  # type: ignore[method-assign, assignment]


def _unpatch_reads() -> None:
    torch.Tensor.tolist = _ORIGINAL.pop()  # type: ignore[method-assign]
