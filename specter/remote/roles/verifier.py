"""The verifier role: the target's dense parts and the round; the schedule runs in the transfer process.

Its slot pool's storage is the transfer process's ``SharedSlots``. By default (``schedule="transfer"``)
the residency map and the policy live in the transfer process (``specter/remote/scheduler.py``): this
side tells it the round and, per MoE layer, what the pass needs (``ScheduledExperts``, through a
``RemotePolicy``), and reads where each expert is from the shared index and the seq table. With
``schedule="verifier"`` — and always for a policy that reads the target's hidden states
(``gate-prefetch``) — the residency map and the policy are here and the link is a ``RemoteLink``
(copy commands over ZeroMQ, readiness from the seq table). It maps the transfer process's host store
read-only, so a policy with host compute computes a late expert here, from the same blob, exactly
as in process (``specter/remote/shared_store.py`` says why here and not in the transfer process). With a draft process, the engine's proposer
is a ``RemoteProposer``. A request starts with one Ray call (``generate``) and returns tokens and
stats; nothing per token crosses Ray. ``stream`` is the same request handing out each round's
tokens as they commit (the server's streamed responses), and ``cancel`` ends one at its next round.
Streams run continuously batched (``specter/batching.py``): up to ``max_batch`` of them share each
step, on the slot pool as the requests before them left it. A drafting policy's batched rounds are
drafted in the draft process, every drafting request's together (``RemoteDrafter``); without a draft
process its streams run one at a time, each from the initial residency as ``generate``'s.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from specter.batching import Batcher
from specter.config import HostConfig, LinkConfig, SamplingConfig, SlotConfig
from specter.engine import Engine
from specter.experts.slots import SlotPool
from specter.experts.store import ExpertStore
from specter.models.checkpoint import resolve_model_dir
from specter.models.graphed import window_counts
from specter.models.layout import layout_facts
from specter.models.loader import LoadedModel, build_dense
from specter.plan import drafts, make_policy
from specter.plan.window import WindowChooser
from specter.protocol import Shutdown, UsePolicy
from specter.remote.channel import Channel
from specter.remote.counters import SharedCounters
from specter.remote.experts import RemoteExperts, ScheduledExperts
from specter.remote.link import RemoteLink
from specter.remote.policy import RemotePolicy
from specter.remote.proposer import RemoteDrafter, RemoteProposer
from specter.remote.residency import SharedIndex
from specter.remote.roles.base import Metrics, NoMetrics, compute_dtype, role_device
from specter.remote.shared_store import SharedArena, store_name
from specter.remote.shm import SharedSlots, SlotsHandle
from specter.request import BatchRequest
from specter.serving.text import Stops, check_stops
from specter.target import OffloadedTarget, load_tokenizer, slot_groups
from specter.timing.profiles import simulated_host

log = logging.getLogger(__name__)

PIPELINED = True  # a request's default: see docs/actors.md, "Pipelined drafting"
SCHEDULES = ("transfer", "verifier")  # where the policy's schedule runs
CANCELS_KEPT = 1024
MAX_BATCH = 8  # streams decoded together (draft-free policies)


class VerifierRole:
    """The verify side of the engine.

    Requests run one at a time; ``progress`` and ``pid`` may be asked from another thread while a
    request runs (the Ray actor gives them a concurrency group of their own).

    Args:
        model_dir: the target checkpoint.
        budget: the device's expert budget.
        policy: the policy name it starts with.
        timeout_s: transfer, handshake and draft timeouts.
        metrics: where its figures go (``actors/metrics.py: Recorder`` under Ray; default none).
        link: the transfer process's link (a simulated link's rate sets the simulated host's).
        host_profile: the profile whose host computes late experts (None: the default, as in process).
        schedule: where the policy's schedule runs: ``transfer`` (next to the copies; a policy that
            reads the target's hidden states still runs here) or ``verifier``.
        dtype: the compute dtype (None: fp32 on a CPU, the checkpoint's on a GPU); the transfer
            process's must be the same.
    """

    def __init__(self, model_dir: str, budget: SlotConfig, policy: str, timeout_s: float = 60.0,
                 link: LinkConfig | None = None, host_profile: str | None = None, schedule: str = "transfer",
                 metrics: Metrics | None = None, max_batch: int = MAX_BATCH, dtype: torch.dtype | None = None,
                 step: str = "auto"):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.schedule = schedule
        self.metrics: Metrics = metrics or NoMetrics()
        self.model_dir, self.budget, self.policy_name, self.timeout_s = model_dir, budget, policy, timeout_s
        self.link_config, self.host_profile = link or LinkConfig(), host_profile
        self.device = role_device(self.link_config)  # the slots' device: the transfer process's choice too
        self.dtype = dtype  # None: fp32 on a CPU, the checkpoint's on a GPU (``compute_dtype``)
        self.step = step  # how the target's steps run (``OffloadedTarget.load``'s ``step``)
        self._prepared_window = -1  # the widest window whose step shapes ``prepare_steps`` keeps ready
        self._loaded: LoadedModel | None = build_dense(model_dir, compute_dtype(self.device, dtype))
        self.target: OffloadedTarget | None = None
        self.proposer: RemoteProposer | None = None
        self.drafter: RemoteDrafter | None = None  # the batcher's, over the proposer's channel
        self.channels: list[Channel] = []
        self._requests = 0  # requests started since the process started
        self._tokenizer: Any = False  # the model's (None: it has none), for stop strings; False: not loaded yet
        self._cancelled: dict[str, None] = {}  # streamed requests asked to stop (cancel): an ordered set
        self._lock = threading.Lock()
        self._engine_lock = threading.Lock()  # one thread on the target at a time: a request, or a batched step
        self.max_batch = max_batch
        self._batcher: Batcher | None = None
        self._batching: threading.Thread | None = None
        self._batching_stop = threading.Event()
        self._engine: Engine | None = None  # the running (or last) request's engine
        # K choosers by (policy, pipelined): what a chooser measured survives a rebuild (the schedule
        # moved) and is not mixed between the two modes (a round drafted ahead costs no drafting)
        self._choosers: dict[tuple[str, bool], WindowChooser] = {}
        # the batcher's K choosers' states to go on from (``keep_choosers``; a rebuilt batcher's), for a policy
        self._kept: tuple[str, dict[int, dict[str, Any]]] | None = None

    def connect(self, slots_json: str, transfer_endpoint: str, draft_endpoint: str | None,
                layout: dict[str, Any] | None = None) -> int:
        """Attach the shared slots, connect and handshake both channels, fill the initial slots.

        ``layout``: the transfer process's expert layout (``TransferRole.info``'s, read from the
        checkpoint's headers); it must be the one this side's model has.

        Returns the number of slots.
        """
        loaded = self._loaded or build_dense(self.model_dir, compute_dtype(self.device, self.dtype))
        ours = layout_facts(loaded.moe_layers, loaded.num_experts, loaded.top_k, loaded.shape)
        if layout is not None and layout != ours:
            raise RuntimeError(f"{self.model_dir}: the transfer process read the experts' layout {layout} from the "
                               f"checkpoint's tensors, the verifier's model has {ours}")
        handle = msgspec.json.decode(slots_json, type=SlotsHandle)
        self.slots = SharedSlots.attach(handle)
        if self.slots.storage.device.type != self.device.type:
            raise RuntimeError(f"slots: the transfer process made them on {self.slots.storage.device}, "
                               f"the verifier computes on {self.device}")
        self.device = self.slots.storage.device
        self.counters = SharedCounters(handle.prefix, create=False)
        numel = ExpertStore.arena_numel(loaded.moe_layers, loaded.num_experts, loaded.shape)
        self.arena = SharedArena.map_readonly(store_name(handle.prefix), numel, loaded.shape.dtype)
        self.index = SharedIndex(handle.prefix, max(loaded.moe_layers) + 1, loaded.num_experts, create=False)
        link_channel = Channel("push", transfer_endpoint, bind=False, peer="transfer", timeout_s=self.timeout_s)
        self.channels.append(link_channel)
        link_channel.handshake("verifier")
        self.link = RemoteLink(link_channel, self.slots, self.counters, self.link_config)
        if draft_endpoint:
            draft_channel = Channel("pair", draft_endpoint, bind=False, peer="draft", timeout_s=self.timeout_s)
            self.channels.append(draft_channel)
            draft_channel.handshake("verifier")
            self.proposer = RemoteProposer(draft_channel, self.timeout_s)
            self.drafter = RemoteDrafter(self.proposer)
        self._build(self.policy_name)
        return self.slots.num_slots

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
        top_k: int = 0, seed: int = 0, window: int | None = None, policy: str | None = None,
        eos_token_id: int | None = None, untimed_prefill: bool = False, pipelined: bool = PIPELINED,
        schedule: str | None = None, on_tokens: Any = None, cancelled: Any = None,
        chooser: dict[str, Any] | None = None, stop: Any = None,
    ) -> dict[str, Any]:
        """One request from the initial residency (``Engine.generate_fresh``): tokens and stats.

        ``pipelined``: the draft drafts each next round while this one is verified (``specter/engine.py``).
        ``schedule``: where the policy's schedule runs from this request on (``transfer`` or
        ``verifier``; None: as before). ``on_tokens``/``cancelled``: ``Engine.generate``'s (in this
        process; ``stream`` uses them). ``chooser``: a K chooser's state to start from
        (``WindowChooser.state``'s; ``{}``: none) where this verifier's chooser for the request's policy
        has served no request yet; given, the result carries the chooser's state after the request as
        ``chooser`` (``specter generate`` keeps it between runs: ``specter/plan/window_store.py``).
        ``stop``: strings (up to four) that end the request at the step or round whose tokens write one
        (``specter/serving/text.py: Stops``; its figures say ``stop``); the tokens come back whole, and
        the caller cuts them (``until_stop``). Its figures go to the replica's metrics; a request that
        raises counts as an error.
        """
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
        stops = self._stops(stop, on_tokens, cancelled)
        if stops is not None:
            on_tokens, cancelled = stops.on_tokens, stops.cancelled
        self.metrics.set("specter_queue_depth", 1)
        self._requests += 1
        try:
            with self._engine_lock:
                if schedule is not None and schedule != self.schedule:
                    self.schedule = schedule
                    self._build(self.policy_name)
                out = self._generate(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, window, policy,
                                     eos_token_id, untimed_prefill, pipelined, on_tokens, cancelled, chooser)
        except Exception:
            self.metrics.inc("specter_request_errors")
            raise
        finally:
            self.metrics.set("specter_queue_depth", 0)
        if stops is not None:
            stops.mark(out["stats"])
        self.metrics.request(out["stats"])
        return out

    def _stops(self, stop: Any, on_tokens: Any, cancelled: Any) -> Stops | None:
        """A request's stop strings, watched over its commits (None: it has none)."""
        stops = check_stops(stop)
        if not stops:
            return None
        if self._tokenizer is False:  # the first request with stop strings loads it
            self._tokenizer = load_tokenizer(resolve_model_dir(self.model_dir))
        return Stops(self._tokenizer, stops, on_tokens, cancelled)

    def prepare_steps(self, window: int) -> int:
        """Make the target's step shapes of windows up to ``window`` ready now (1 to window + 1 tokens, as
        ``Engine.prepare_steps``), and again whenever a policy change rebuilds the target, so that no
        request pays their first runs and CUDA graph captures. Returns how many token counts were made
        ready (0 where the steps are eager, or were ready)."""
        window_counts(window)  # a bad window is refused before anything is kept
        with self._engine_lock:
            self._prepared_window = max(self._prepared_window, window)
            return self._prepare()

    def _prepare(self) -> int:
        graphed = self.target.graphed if self.target is not None else None
        if graphed is None or self._prepared_window < 0:
            return 0
        return graphed.prepare(window_counts(self._prepared_window))

    def stream(self, request_id: str, prompt_ids: list[int], max_new_tokens: int,
               **options: Any) -> Iterator[dict[str, Any]]:
        """``generate`` as a stream: ``{"tokens": [...]}`` for each step's or round's commits as they
        commit, then ``{"tokens": [], "stats": {...}}`` (``stats["cancelled"]`` when ``cancel`` ended
        it early; ``chooser`` too, as ``generate``'s, where an unbatched request gave one). Batched
        (``batches``), the request joins the batcher's steps; otherwise it runs in a thread of this
        process. A generator closed early (its consumer gone) ends the request at its next step or
        round; unbatched, it waits for that, so the next request starts on a quiet engine."""
        chunks: queue.Queue[tuple[str, Any]] = queue.Queue()
        stop = threading.Event()

        def cancelled() -> bool:
            with self._lock:
                return stop.is_set() or request_id in self._cancelled

        def on_tokens(tokens: list[int]) -> None:
            chunks.put(("tokens", list(tokens)))

        worker: threading.Thread | None = None
        stops: Stops | None = None
        if self.batches(options):
            stops = self._stops(options.get("stop"), on_tokens, cancelled)  # refused before it counts
            self._requests += 1
            sampling = SamplingConfig(options.get("temperature", 0.0), options.get("top_p", 1.0),
                                      options.get("top_k", 0), options.get("seed", 0))
            watched = (on_tokens, cancelled) if stops is None else (stops.on_tokens, stops.cancelled)
            request = BatchRequest(list(prompt_ids), max_new_tokens, sampling, options.get("eos_token_id"),
                                   *watched, on_done=lambda r: chunks.put(("ended", r)))
            try:
                self._batched().submit(request)
            except Exception:
                self.metrics.inc("specter_request_errors")
                raise
        else:
            def run() -> None:
                try:
                    chunks.put(("done", self.generate(prompt_ids, max_new_tokens, on_tokens=on_tokens,
                                                      cancelled=cancelled, **options)))
                except BaseException as exc:  # handed to the consumer, raised there
                    chunks.put(("error", exc))

            worker = threading.Thread(target=run, name=f"request-{request_id}", daemon=True)
            worker.start()
        try:
            while True:
                kind, value = chunks.get()
                if kind == "tokens":
                    yield {"tokens": value}
                    continue
                if kind == "ended":  # a batched request: its figures go to the metrics here
                    if value.error is not None:
                        self.metrics.inc("specter_request_errors")
                        raise value.error
                    value = {"stats": value.stats.to_dict()}
                    if stops is not None:
                        stops.mark(value["stats"])
                    self.metrics.request(value["stats"])
                elif kind == "error":
                    raise value
                yield {"tokens": [], "stats": value["stats"]} | ({"chooser": value["chooser"]} if "chooser" in value else {})
                return
        finally:
            stop.set()
            if worker is not None:
                worker.join()
            with self._lock:
                self._cancelled.pop(request_id, None)

    def batches(self, options: dict[str, Any] | None = None) -> bool:
        """Whether streams run batched: a target with the lean step, a draft process for a drafting
        policy, and no request option that only ``generate`` honours (another policy, a window, a
        schedule)."""
        options = options or {}
        if (options.get("policy") not in (None, self.policy_name) or options.get("window") is not None
                or options.get("schedule") is not None or options.get("untimed_prefill")):
            return False
        target = self.target
        return (self.max_batch > 1 and (self.drafter is not None or not drafts(self.policy_name))
                and target is not None and target.lean is not None and target.lean.fused is not None)

    def concurrency(self) -> int:
        """How many streams the engine decodes at once (1: one at a time)."""
        return self.max_batch if self.batches() else 1

    def keep_choosers(self, states: dict[int, dict[str, Any]]) -> None:
        """Start the streams' K choosers from ``states`` (``chooser_states``' of an earlier server with the
        same setup), by the number of requests drafting together; batched streams take them all, streams
        run one at a time the state of 1. A chooser that has measured rounds here already stays as it is.
        Nothing to do for a policy that does not adapt K.

        Raises:
            ValueError: a state is no chooser's of this policy's kind (checked before any is kept)."""
        policy = make_policy(self.policy_name)
        if policy.window_chooser() is None:
            return
        checked = {int(n): policy.window_chooser_from(state) for n, state in states.items()}
        with self._engine_lock:
            if self.batches():
                batcher = self._batcher
                if batcher is not None and batcher.choosers is not None:
                    for n, chooser in checked.items():
                        if n not in batcher.choosers or not batcher.choosers[n].verify_s:
                            batcher.choosers[n] = chooser
                self._kept = (self.policy_name, {n: c.state() for n, c in checked.items()})
            elif 1 in checked:
                key = (self.policy_name, PIPELINED)
                if key not in self._choosers or not self._choosers[key].requests:
                    self._choosers[key] = checked[1]

    def chooser_states(self) -> dict[int, dict[str, Any]]:
        """The streams' K choosers' states (``WindowChooser.state``'s) by the number of requests drafting
        together — the batcher's that have measured a round or were kept, or the one-at-a-time streams'
        as 1 — for ``keep_choosers`` of a later server; empty for a policy that does not adapt K.
        Answers between steps."""
        with self._engine_lock:
            if self.batches():
                if self._batcher is not None:
                    return self._batcher.chooser_states()
                return dict(self._kept[1]) if self._kept and self._kept[0] == self.policy_name else {}
            chooser = self._choosers.get((self.policy_name, PIPELINED))
            return {1: chooser.state()} if chooser is not None and chooser.verify_s else {}

    def _batched(self) -> Batcher:
        """The batcher of the current target, and the thread that steps it (started on first use)."""
        with self._lock:
            if self._batcher is None:
                assert self.target is not None, "connect() first"
                drafter = self.drafter if drafts(self.policy_name) else None
                kept = self._kept[1] if self._kept and self._kept[0] == self.policy_name else None
                self._batcher = Batcher(self.target, self.max_batch, drafter=drafter, choosers=kept)
                self._batching_stop.clear()
                self._batching = threading.Thread(target=self._batcher.serve, args=(self._batching_stop,
                                                  self._engine_lock), name="batcher", daemon=True)
                self._batching.start()
            return self._batcher

    def _stop_batching(self) -> None:
        """Stop the batcher's thread; requests still in it end with an error naming why."""
        batcher, thread = self._batcher, self._batching
        if batcher is None or thread is None:
            return
        self._batching_stop.set()
        batcher.stop()
        if thread is not threading.current_thread():
            thread.join()
        batcher.abandon(RuntimeError("the verifier rebuilt its target (another policy or schedule, or closing)"))
        if batcher.choosers:  # what its choosers learnt goes on in the next batcher of this policy
            self._kept = (self.policy_name, batcher.chooser_states())
        self._batcher = self._batching = None

    def cancel(self, request_id: str) -> None:
        """Ask the streamed request ``request_id`` to end before its next round (answers while it runs;
        one not started yet ends before its first round). The last ``CANCELS_KEPT`` ids are kept, so a
        cancel for a request that already ended costs nothing lasting."""
        with self._lock:
            self._cancelled[request_id] = None
            while len(self._cancelled) > CANCELS_KEPT:
                del self._cancelled[next(iter(self._cancelled))]

    def pid(self) -> int:
        """This worker's process id (fault injection; answers while a request runs)."""
        return os.getpid()

    def progress(self) -> dict[str, int | bool]:
        """Where the verifier is: ``requests`` started so far, whether one is ``active``, and the tokens
        ``committed`` by the running (or last) request. Answers while a request runs."""
        engine = self._engine
        return {"requests": self._requests, "active": engine is not None and engine.active,
                "committed": engine.committed if engine is not None else 0}

    def _generate(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int,
        window: int | None, policy: str | None, eos_token_id: int | None, untimed_prefill: bool, pipelined: bool,
        on_tokens: Any = None, cancelled: Any = None, chooser: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if policy is not None and policy != self.policy_name:
            self._build(policy)
        assert self.target is not None, "connect() first"
        policy_obj = self.target.offload.policy
        k = policy_obj.default_window if window is None else window
        key = (self.policy_name, pipelined)
        if policy_obj.window_chooser() is not None:
            if chooser and (key not in self._choosers or not self._choosers[key].requests):
                self._choosers[key] = policy_obj.window_chooser_from(chooser)  # checked before any work
            elif key not in self._choosers:
                self._choosers[key] = policy_obj.new_window_chooser()
            policy_obj.use_window_chooser(self._choosers[key])
        if k and self.proposer is None:
            raise ValueError(f"window: K = {k} needs a draft process; this engine was launched without a draft")
        engine = Engine(self.target, window=k, proposer=self.proposer if k else None, untimed_prefill=untimed_prefill,
                        pipelined=pipelined)
        self._engine = engine
        sampling = SamplingConfig(temperature, top_p, top_k, seed)
        tokens, stats = engine.generate_fresh(list(prompt_ids), max_new_tokens, sampling, eos_token_id, on_tokens,
                                              cancelled)
        out: dict[str, Any] = {"tokens": tokens, "stats": stats.to_dict()}
        if chooser is not None and key in self._choosers:
            out["chooser"] = self._choosers[key].state()
        return out

    def close(self) -> None:
        """Tell the peers to stop, close the sockets and unmap the shared memory."""
        self._stop_batching()
        for channel in self.channels:
            try:
                channel.send(Shutdown("verifier closing"), timeout_s=1.0)
            except Exception as exc:  # a peer already gone: nothing more to tell it
                log.info("verifier: %s", exc)
            channel.close()
        if self.target is not None:
            self.target.close()
        if hasattr(self, "slots"):
            self.slots.close()
            self.counters.close()
            self.index.close()
        if hasattr(self, "arena"):
            self.target = None  # its store's blob views hold the mapping
            self.arena.close()

    def _host(self, loaded: LoadedModel) -> HostConfig | None:
        """The host beside the link, as the in-process engine gets it (the GPU path's is not done yet)."""
        if self.link_config.kind != "sim":
            return None
        shape = loaded.shape
        return simulated_host(self.link_config.bandwidth, self.link_config.latency, shape.nbytes, 2 * shape.numel,
                              self.host_profile)

    def _build(self, policy: str) -> None:
        """A fresh offloaded target for ``policy`` (a policy may hook the model: reload the dense
        parts); in-flight transfers of the old pool land first so that none overwrites a new slot."""
        remote = self.schedule == "transfer" and not make_policy(policy).needs_model
        self._stop_batching()
        if self.target is not None:
            old = self.target.offload
            for key in old.pool.loading_keys():
                old.wait(key)
            if isinstance(old, ScheduledExperts) and not remote:
                self.link.channel.send(UsePolicy(""))  # the transfer process stops scheduling
        loaded = self._loaded or build_dense(self.model_dir, compute_dtype(self.device, self.dtype))
        self._loaded = None
        groups = slot_groups(self.budget, loaded)
        if (count := sum(groups.values())) != self.slots.num_slots:
            raise RuntimeError(f"slots: the verifier sizes {count} slots, the transfer process {self.slots.num_slots}")
        pool = SlotPool(loaded.shape, groups, self.device, storage=self.slots.storage)
        store = ExpertStore(loaded.moe_layers, loaded.num_experts, loaded.shape, arena=self.arena.tensor)
        offload: RemoteExperts | ScheduledExperts
        if remote:
            wire = self.proposer.wire_id if self.proposer is not None else None
            stand_in = RemotePolicy(make_policy(policy), self.link.channel, wire)
            offload = ScheduledExperts(store, pool, self.link, stand_in, self.index, policy, self.host_profile,
                                       timeout=self.timeout_s)
        else:
            offload = RemoteExperts(store, pool, self.link, make_policy(policy), timeout=self.timeout_s)
        offload.set_host(self._host(loaded))
        offload.prefill_slots()
        loaded.model.to(self.device)  # type: ignore[arg-type]  # transformers' stub types .to oddly
        self.target = OffloadedTarget(loaded, offload, self.device, self.step)
        self.policy_name = policy
        self._prepare()  # a rebuilt target's steps: as ready as the last one's
        log.info("verifier: policy %s, %d slots over %s, scheduled in the %s", policy, pool.num_slots,
                 self.link.describe(), "transfer process" if remote else "verifier")
