"""The batch driver: prompts handed out one at a time to N replicas, results appended as they finish.

Each replica (a trio of actors, ``actors.launcher.launch``) holds at most one request, so a slow
replica never holds the others back. A request that fails because of its input (the verifier
raises ``ValueError``) is recorded in the errors file; one that fails because a replica broke (an
actor died, a peer went silent past its timeout, the request ran past ``request_timeout_s``) gets
the replica torn down and relaunched and is retried, up to ``retries`` times. Ctrl-C, SIGTERM or SIGHUP
stops the loop within its wait (``interrupts``): the running requests are given up with their replicas, and the
report says so (``interrupted``, ``left``, ``running``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray

from actors.launcher import EngineHandle, cluster_link, launch
from actors.metrics import Recorder
from specter.config import LinkConfig, SlotConfig
from specter.eval.jobs import BatchItem, Progress, ResultsFile, append_error, interrupts
from specter.serving.text import until_stop

log = logging.getLogger(__name__)


@dataclass
class BatchOptions:
    """How the replicas are built and requests are made (see ``specter batch --help``)."""

    model: str
    draft: str | None
    budget: SlotConfig
    link: LinkConfig | None  # None: the cluster's (``cuda`` on a GPU cluster, ``launch.cluster_link``)
    policy: str = "demand-lru"
    window: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    eos_token_id: int | None = None
    replicas: int = 1
    request_timeout_s: float = 600.0
    retries: int = 2
    timeout_s: float = 60.0
    host_profile: str | None = None  # the profile whose host computes late experts (``launch``'s)
    pipelined: bool = True  # the draft drafts each next round while this one is verified
    # a K chooser's state each replica's first request starts from ({}: none; None: not asked for):
    # given, the report keeps the latest one of the replica that served most (``specter/plan/window_store.py``)
    chooser: dict[str, Any] | None = None


@dataclass
class BatchReport:
    """What a run did."""

    finished: int = 0
    failed: int = 0
    skipped: int = 0  # already in the results file
    retried: int = 0
    restarts: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    chooser: dict[str, Any] | None = None  # the K chooser's state of most requests (``BatchOptions.chooser``)
    interrupted: int = 0  # the signal that stopped the run (SIGINT: Ctrl-C, SIGTERM, SIGHUP); 0: it ran to its end
    left: int = 0  # prompts not run when it stopped, the running ones included
    running: int = 0  # of them, those given up while running


@dataclass
class _Replica:
    name: str
    placement: dict[str, Any] = field(default_factory=dict)
    handle: EngineHandle | None = None
    busy: tuple[Any, BatchItem, int, float] | None = None  # (ref, item, attempt, started)


Launcher = Callable[..., EngineHandle]


def run_batch(
    items: list[BatchItem],
    results: ResultsFile,
    out: str | Path,
    options: BatchOptions,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    progress: Progress | None = None,
    launcher: Launcher = launch,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> BatchReport:
    """Run every item not yet in ``results`` (Ray must be initialized); returns the report."""
    link = cluster_link(options.link)
    options = replace(options, link=link)
    report = BatchReport(skipped=sum(item.id in results.done for item in items))
    todo: deque[tuple[BatchItem, int]] = deque((item, 0) for item in items if item.id not in results.done)
    driver = Recorder("all", "driver")
    replicas = [_Replica(f"r{i}", placement) for i, placement in enumerate(spread(options.replicas, link))]
    try:
        replicas = _start_all(replicas, options, launcher)
        with interrupts() as stop:
            while (todo or any(r.busy for r in replicas)) and not stop.is_set():
                driver.set("specter_queue_depth", len(todo))
                for replica in replicas:
                    if replica.busy is None and todo:
                        item, attempt = todo.popleft()
                        _submit(replica, item, attempt, options, encode, report, out, driver, progress)
                busy = {r.busy[0]: r for r in replicas if r.busy is not None}
                if not busy:
                    continue
                ready, _ = ray.wait(list(busy), num_returns=1, timeout=1.0)
                for ref in ready:
                    _collect(
                        busy[ref],
                        options,
                        results,
                        out,
                        decode,
                        report,
                        todo,
                        driver,
                        progress,
                        launcher,
                        on_result,
                    )
                for replica in _overdue(replicas, options.request_timeout_s):
                    assert replica.busy is not None
                    _, item, attempt, _ = replica.busy
                    error = TimeoutError(
                        f"request {item.id!r} ran past --request-timeout {options.request_timeout_s:.0f}s")
                    _fault(replica, item, attempt, error, options, out, report, todo, driver, progress, launcher)
            running = sum(r.busy is not None for r in replicas)
            if todo or running:  # Ctrl-C, SIGTERM or SIGHUP (``stop``): what still runs is given up with its replica
                report.interrupted, report.running, report.left = stop.signum, running, len(todo) + running
        driver.set("specter_queue_depth", 0)
    finally:
        for replica in replicas:
            if replica.handle is not None:  # one still running a request (stopped) is killed, not closed
                replica.handle.shutdown(close=replica.busy is None)
    return report


def _start_all(replicas: list[_Replica], options: BatchOptions, launcher: Launcher) -> list[_Replica]:
    """Start the replicas in order; when one finds no room, go on with those that started (none
    started: the error)."""
    for i, replica in enumerate(replicas):
        try:
            _start(replica, options, launcher)
        except TimeoutError as exc:  # no room for this one: go on with those that started
            if i == 0:
                raise
            log.warning("%s; going on with %d replica(s)", exc, i)
            return replicas[:i]
    return replicas


def _overdue(replicas: list[_Replica], timeout_s: float) -> list[_Replica]:
    """The replicas whose request has run past ``timeout_s``."""
    now = time.monotonic()
    return [r for r in replicas if r.busy is not None and now - r.busy[3] > timeout_s]


def spread(replicas: int, link: LinkConfig) -> list[dict[str, Any]]:
    """Where each replica goes: on a ``cuda`` link Ray spreads them (a trio claims one whole GPU,
    ``launch``'s ``placement``), else round-robin over the alive nodes when there are several
    (``launch``'s ``node_ip``)."""
    if link.kind == "cuda":
        return [{} for _ in range(replicas)]
    nodes = sorted(
        n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU")
    )
    if len(nodes) < 2:
        return [{} for _ in range(replicas)]
    return [{"node_ip": nodes[i % len(nodes)]} for i in range(replicas)]


def _start(replica: _Replica, options: BatchOptions, launcher: Launcher, names_free_s: float = 120.0) -> None:
    """Launch the replica's trio; a killed predecessor's actor names are released asynchronously, so
    a launch refused for a taken name is retried until they are free (``names_free_s`` bounds a hang)."""
    deadline = time.monotonic() + names_free_s
    while True:
        try:
            replica.handle = launcher(
                options.model,
                options.draft,
                options.budget,
                options.link,
                options.policy,
                replica=replica.name,
                timeout_s=options.timeout_s,
                host_profile=options.host_profile,
                **replica.placement,
            )
            return
        except ValueError as exc:
            if "already" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _submit(
    replica: _Replica,
    item: BatchItem,
    attempt: int,
    options: BatchOptions,
    encode: Callable[[str], list[int]],
    report: BatchReport,
    out: str | Path,
    driver: Recorder,
    progress: Progress | None,
) -> None:
    try:
        ids = encode(item.prompt)
    except Exception as exc:  # a tokenizer failure is this prompt's, not the replica's
        _failed(item, f"prompt: could not be tokenized ({exc})", out, report, driver, progress)
        return
    assert replica.handle is not None
    ref = replica.handle.verifier.generate.remote(
        ids,
        item.max_new_tokens,
        temperature=item.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=item.seed,
        window=options.window,
        policy=options.policy,
        eos_token_id=options.eos_token_id,
        pipelined=options.pipelined,
        **({} if options.chooser is None else {"chooser": options.chooser}),
        **({"stop": list(item.stop)} if item.stop else {}),
    )
    replica.busy = (ref, item, attempt, time.monotonic())


def _collect(
    replica: _Replica,
    options: BatchOptions,
    results: ResultsFile,
    out: str | Path,
    decode: Callable[[list[int]], str],
    report: BatchReport,
    todo: deque[tuple[BatchItem, int]],
    driver: Recorder,
    progress: Progress | None,
    launcher: Launcher,
    on_result: Callable[[dict[str, Any]], None] | None,
) -> None:
    assert replica.busy is not None
    ref, item, attempt, _ = replica.busy
    try:
        out_ = ray.get(ref)
    except ValueError as exc:  # the request's own fault (Ray re-raises the verifier's ValueError)
        replica.busy = None
        _failed(item, _message(exc), out, report, driver, progress)
        return
    except Exception as exc:  # the replica's fault: an actor died, a peer went silent
        _fault(replica, item, attempt, exc, options, out, report, todo, driver, progress, launcher)
        return
    replica.busy = None
    state = out_.get("chooser")
    if state is not None and (report.chooser is None or state["requests"] >= report.chooser["requests"]):
        report.chooser = state
    tokens, text = until_stop(decode, out_["tokens"], item.stop)
    result = {"id": item.id, "text": text, "tokens": tokens, "stats": out_["stats"]}
    results.append(result)
    report.finished += 1
    report.tokens += len(tokens)
    if progress is not None:
        progress.update(len(tokens))
    if on_result is not None:
        on_result(result)


def _fault(
    replica: _Replica,
    item: BatchItem,
    attempt: int,
    exc: BaseException,
    options: BatchOptions,
    out: str | Path,
    report: BatchReport,
    todo: deque[tuple[BatchItem, int]],
    driver: Recorder,
    progress: Progress | None,
    launcher: Launcher,
) -> None:
    replica.busy = None
    log.warning(
        "replica %s failed on %r (attempt %d): %s; restarting it",
        replica.name,
        item.id,
        attempt + 1,
        _message(exc),
    )
    if replica.handle is not None:
        replica.handle.shutdown(timeout_s=2.0)
    replica.handle = None
    report.restarts += 1
    _start(replica, options, launcher)
    if attempt < options.retries:
        report.retried += 1
        todo.appendleft((item, attempt + 1))
    else:
        _failed(item, f"gave up after {attempt + 1} attempts: {_message(exc)}", out, report, driver, progress)


def _failed(
    item: BatchItem,
    message: str,
    out: str | Path,
    report: BatchReport,
    driver: Recorder,
    progress: Progress | None,
) -> None:
    log.error("prompt %r (line %d): %s", item.id, item.line, message)
    append_error(out, {"id": item.id, "line": item.line, "error": message})
    report.failed += 1
    report.errors.append(f"{item.id}: {message}")
    driver.inc("specter_request_errors")
    if progress is not None:
        progress.update(failed=True)


def _message(exc: BaseException) -> str:
    """The innermost message of a (Ray-wrapped) exception, on one line."""
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
