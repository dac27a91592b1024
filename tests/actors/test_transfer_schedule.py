"""The schedule in the transfer actor, in one process (no Ray): the transfer server with its policy,
the draft server sending its plans to it, the verifier's ``ScheduledExperts`` reading residency from
shared memory. Every policy gives transformers' tokens; the plans reach the policy there."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import msgspec
import pytest
import torch
from tiny_models import noisy_copy
from transformers import AutoModelForCausalLM

from specter.assets import DEFAULT_MODEL
from specter.batching import Batcher
from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.experts.slots import SlotPool
from specter.models.loader import build_dense, load_store
from specter.plan import make_policy
from specter.plan.base import Policy
from specter.proposer import Draft
from specter.protocol import LayerNeeds, PlanDelta, RoundStart, UsePolicy
from specter.remote.channel import Channel
from specter.remote.counters import SharedCounters
from specter.remote.draft_server import DraftServer
from specter.remote.endpoints import private_ipc_dir
from specter.remote.experts import ScheduledExperts
from specter.remote.link import RemoteLink
from specter.remote.policy import RemotePolicy
from specter.remote.proposer import RemoteDrafter, RemoteProposer
from specter.remote.residency import SharedIndex
from specter.remote.scheduler import TransferExperts
from specter.remote.segments import new_prefix, unlink_prefix
from specter.remote.shm import SharedSlots
from specter.remote.transfer_server import NO_POLICY, OUT_OF_RANGE, SlotWriterLink, TransferServer
from specter.request import BatchRequest
from specter.target import OffloadedTarget, slot_groups
from specter.timing.profiles import simulated_host

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 12
LINK = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)
BUDGET = SlotConfig(fraction=0.25)
HANG_S = 30.0


@contextmanager
def _serve(name: str, target, *args) -> Iterator[threading.Event]:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    thread = threading.Thread(target=target, args=(*args, stop), name=name, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(5)


class Replica:
    """Transfer server + draft server in threads, the verifier's target in this thread."""

    def __init__(self, folder: Path, draft: Path | Draft | None, stack: ExitStack):
        host = build_dense(folder, torch.float32)
        self.store = load_store(host)
        groups = slot_groups(BUDGET, host)
        self.prefix = prefix = new_prefix("spt-sched")
        slots = SharedSlots.create(prefix, sum(groups.values()), self.store.shape.numel, self.store.shape.dtype)
        counters = SharedCounters(prefix, create=True)
        index = SharedIndex(prefix, max(self.store.layers) + 1, self.store.num_experts, create=True)
        ipc = private_ipc_dir()
        pull = Channel("pull", ipc.endpoint("transfer"), bind=True, peer="verifier")
        self.server = TransferServer(self.store, slots, counters, LINK, pull, index, groups, timeout_s=HANG_S)
        stack.callback(self._cleanup, slots, counters, index, ipc, pull)

        def transfer(stop: threading.Event) -> None:
            pull.handshake("transfer", 10)
            self.server.serve(stop, poll_s=0.01)

        stack.enter_context(_serve("transfer", transfer))
        push = stack.enter_context(_closing(Channel("push", pull.address, bind=False, peer="transfer")))
        push.handshake("verifier", 10)
        self.proposer = None
        if draft is not None:
            pair = stack.enter_context(_closing(Channel("pair", ipc.endpoint("draft"), bind=True, peer="verifier")))
            plans = stack.enter_context(_closing(Channel("push", pull.address, bind=False, peer="transfer")))
            plans.handshake("draft", 10)
            self.draft_server = DraftServer(ResidentDraft(draft) if isinstance(draft, Path) else draft, pair,
                                            plans=plans)

            def drafting(stop: threading.Event) -> None:
                pair.handshake("draft", 10)
                self.draft_server.serve(stop, poll_s=0.01)

            stack.enter_context(_serve("draft", drafting))
            near = stack.enter_context(_closing(Channel("pair", pair.address, bind=False, peer="draft")))
            near.handshake("verifier", 10)
            self.proposer = RemoteProposer(near, HANG_S)
        self.reader = SharedSlots.attach(slots.handle)
        stack.callback(self.reader.close)
        self.remote = RemoteLink(push, self.reader, SharedCounters(prefix, create=False), LINK)
        self.index = SharedIndex(prefix, max(self.store.layers) + 1, self.store.num_experts, create=False)
        stack.callback(self.index.close)
        self.folder, self.groups = folder, groups

    def target(self, policy: str, step: str = "auto") -> OffloadedTarget:
        loaded = build_dense(self.folder, torch.float32)
        pool = SlotPool(loaded.shape, self.groups, torch.device("cpu"), storage=self.reader.storage)
        wire = self.proposer.wire_id if self.proposer is not None else None
        stand_in = RemotePolicy(make_policy(policy), self.remote.channel, wire)
        offload = ScheduledExperts(self.store, pool, self.remote, stand_in, self.index, policy, timeout=HANG_S)
        shape = self.store.shape  # the host beside the link, as the verifier actor sets it
        offload.set_host(simulated_host(LINK.bandwidth, LINK.latency, shape.nbytes, 2 * shape.numel))
        offload.prefill_slots()
        return OffloadedTarget(loaded, offload, torch.device("cpu"), step=step)

    def _cleanup(self, slots, counters, index, ipc, pull) -> None:  # type: ignore[no-untyped-def]
        self.server.close()
        pull.close()
        ipc.cleanup()
        index.close()
        slots.close()
        slots.unlink()
        counters.close()
        assert unlink_prefix(self.prefix) == []


@contextmanager
def _closing(channel: Channel) -> Iterator[Channel]:
    try:
        yield channel
    finally:
        channel.close()


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    folder = tiny_dir("mixtral")
    return folder, noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d")


@pytest.fixture(scope="module")
def replica(models) -> Iterator[Replica]:
    with ExitStack() as stack:
        yield Replica(*models, stack)


@pytest.fixture(scope="module")
def same_replica(models) -> Iterator[Replica]:
    """The target as its own draft: every round drafted ahead stands."""
    with ExitStack() as stack:
        yield Replica(models[0], models[0], stack)


@pytest.fixture(scope="module")
def awq_replica() -> Iterator[Replica]:
    """The embedded model, its AWQ draft (which drafts several sequences in one forward) in the draft server."""
    with ExitStack() as stack:
        yield Replica(Path(DEFAULT_MODEL), load_draft(f"{DEFAULT_MODEL}-awq", device="cpu", mode="dequant-cache"), stack)


def _reference(folder: Path) -> list[int]:
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize(
    ("policy", "window"),
    [("demand-lru", 0), ("demand-host", 0), ("specmoeoff", 3), ("specter-paper", 4), ("specter-paper+host", 4),
     ("specter", 4), ("specter+fixed", 4), ("oracle", 4)],
)
def test_scheduled_in_the_transfer_actor_is_token_identical(replica, models, policy, window) -> None:
    target = replica.target(policy)
    proposer = replica.proposer if window else None
    tokens, stats = Engine(target, window=window, proposer=proposer).generate_fresh(PROMPT, NEW)
    assert tokens == _reference(models[0])
    assert stats.misses > 0 and stats.transfers > 0
    schedule = replica.server.schedule
    assert schedule is not None and schedule.policy.name == make_policy(policy).name
    assert replica.server.rejected == 0


@pytest.mark.parametrize(("policy", "window"), [("demand-lru", 0), ("specter-paper+host", 4), ("specter", 4)])
def test_scheduled_steps_in_static_pieces_compute_their_slots_in_slot_graphs(replica, models, policy, window) -> None:
    """The pieces a GPU captures (``step="static"``), over the transfer actor's slots: each layer's
    experts pinned in the seq table are computed by the layer's slot graph (run eagerly here), the
    host's into the same pair outputs; transformers' tokens."""
    target = replica.target(policy, step="static")
    proposer = replica.proposer if window else None
    tokens, stats = Engine(target, window=window, proposer=proposer).generate_fresh(PROMPT, NEW)
    assert tokens == _reference(models[0])
    assert stats.misses > 0 and stats.transfers > 0
    graphed = target.graphed
    assert graphed is not None and graphed.pieces and all(p.inside for p in graphed.pieces.values())
    assert not graphed.whole  # never whole: the seq table, not the pool, says what is in a slot


def test_a_new_policy_never_sees_the_old_passes_experts_as_done(replica) -> None:
    # The done table outlives a policy switch; a verifier for the new policy that numbered its layer
    # visits from 0 again would, on the same prompt, meet the old pass's numbers: the transfer side
    # would read an expert the pass still waits for as done and give its slot up (a wait that timed
    # out: "placed in no slot", seen through the processes under a loaded CPU).
    first = replica.target("demand-lru")
    Engine(first, window=0).generate_fresh(PROMPT, NEW)
    assert replica.index.last_visit() > 0
    second = replica.target("demand-host")
    offload = second.offload
    assert isinstance(offload, ScheduledExperts)
    layers, experts = replica.index.shape
    for visit in range(offload.visit + 1, offload.visit + 50):
        assert not any(replica.index.done((layer, e), visit) for layer in range(layers) for e in range(experts))
    pool = replica.server.schedule.shared  # and the schedule protects an expert of the running layer
    layer = replica.store.layers[0]
    pool.running, pool.visit = frozenset({(layer, 0)}), offload.visit + 1
    assert pool.holds((layer, 0)) and pool.in_use((layer, 0))


def test_the_plans_reach_the_policy_in_the_transfer_actor(replica) -> None:
    target = replica.target("specter+fixed")
    seen: list[PlanDelta] = []
    schedule = replica.server.schedule
    assert schedule is not None
    on_plan, on_plans = schedule.policy.on_plan, schedule.policy.on_plans
    schedule.policy.on_plan = lambda delta: (seen.append(delta), on_plan(delta))  # type: ignore[method-assign]
    # a delta that overtakes its round's RoundStart (two sockets into one: a loaded machine reorders
    # them) is held, then handed over with the round's start in one on_plans call
    schedule.policy.on_plans = lambda deltas: (seen.extend(deltas), on_plans(deltas))  # type: ignore[method-assign]
    _, stats = Engine(target, window=4, proposer=replica.proposer, pipelined=False).generate_fresh(PROMPT, NEW)
    rounds, drafted = stats.extra["rounds"], stats.extra["drafted"]
    deadline = time.monotonic() + 5.0  # plans travel asynchronously: the last may land after the request
    while len(seen) < drafted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rounds > 0 and len(seen) == drafted, (len(seen), drafted, schedule.plans_dropped)  # one delta per draft step
    assert {d.round for d in seen} == set(range(rounds))  # the engine's round ids, not the wire's
    assert schedule.plans_dropped == 0


def test_plans_of_a_round_drafted_ahead_are_held_for_it(same_replica, models) -> None:
    target = same_replica.target("specter+fixed")
    schedule = same_replica.server.schedule
    assert schedule is not None
    held: list[int] = []  # plan deltas that came before their round started, handed over together
    on_plans = schedule.policy.on_plans
    schedule.policy.on_plans = lambda deltas: (held.append(len(deltas)), on_plans(deltas))  # type: ignore[method-assign]
    seen: list[int] = []
    on_plan = schedule.policy.on_plan
    schedule.policy.on_plan = lambda delta: (seen.append(1), on_plan(delta))  # type: ignore[method-assign]
    engine = Engine(target, window=4, proposer=same_replica.proposer, pipelined=True)
    tokens, stats = engine.generate_fresh(PROMPT, NEW)
    assert tokens == _reference(models[0])
    assert stats.extra["ahead_kept"] == stats.extra["ahead_asked"] > 0  # every round drafted ahead stood
    # each step's plan reached the policy: at once, or (drafted before its round started) held for it
    assert len(seen) + sum(held) == stats.extra["drafted"] and schedule.plans_dropped == 0


class _Spy(Policy):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def on_plan(self, delta: PlanDelta) -> None:
        self.calls.append(("plan", [delta.round]))

    def on_plans(self, deltas: list[PlanDelta]) -> None:
        self.calls.append(("plans", [d.round for d in deltas]))


@contextmanager
def _lone_schedule(store, name: str, policy: Policy | None = None) -> Iterator[TransferExperts]:  # type: ignore[no-untyped-def]
    """A transfer schedule (``policy``, default demand-lru) over 4 shared slots, no server around it."""
    prefix = new_prefix(name)
    slots = SharedSlots.create(prefix, 4, store.shape.numel, store.shape.dtype)
    counters = SharedCounters(prefix, create=True)
    index = SharedIndex(prefix, max(store.layers) + 1, store.num_experts, create=True)
    link = SlotWriterLink(slots, counters, LINK.bandwidth, LINK.latency)
    try:
        yield TransferExperts(store, slots, index, link, {-1: 4}, policy or make_policy("demand-lru"), None)
    finally:
        link.close()
        index.close()
        slots.close()
        slots.unlink()
        counters.close()
        unlink_prefix(prefix)


def test_the_schedule_holds_plans_a_few_rounds_ahead_and_drops_passed_ones(replica) -> None:
    store = replica.store
    spy = _Spy()
    with _lone_schedule(store, "spt-hold", spy) as schedule:
        schedule.begin_round(RoundStart(0, 10, 4))  # wire ids = engine ids + 10
        delta = PlanDelta(10, 0, [store.layers[0]], [[1]], [[0.5]])
        schedule.on_plan(delta)  # the running round: at once, with the engine's id
        schedule.on_plan(msgspec.structs.replace(delta, round=11))  # the next round: held
        schedule.on_plan(msgspec.structs.replace(delta, round=11, step=1))
        schedule.on_plan(msgspec.structs.replace(delta, round=12))  # drafted ahead, then thrown away
        schedule.on_plan(msgspec.structs.replace(delta, round=99))  # too far ahead: dropped
        schedule.on_plan(msgspec.structs.replace(delta, round=9))  # a round that has passed: dropped
        assert spy.calls == [("plan", [0])] and schedule.plans_dropped == 2
        schedule.begin_round(RoundStart(1, 11, 4))
        assert spy.calls[-1] == ("plans", [1, 1])  # held ones together, with the engine's id
        schedule.begin_round(RoundStart(3, 13, 4))  # round 2 (wire 12) never started
        assert schedule.plans_dropped == 3 and not schedule.early


def test_a_prefetch_the_verifier_read_is_resident_again_for_the_schedule(replica) -> None:
    # In process the executor's wait on an expert in flight makes it resident (evictable once the
    # layer is done); here the verifier reads a landed prefetch from its slot and says so in
    # LayerNeeds.ready, or waits for it: either way the transfer actor must stop treating its slot
    # as loading, or every prefetch used keeps a slot out of the schedule's reach for good.
    store = replica.store
    first, second = store.layers[0], store.layers[1]
    with _lone_schedule(store, "spt-reap") as schedule:
        schedule.begin_round(RoundStart(0, 0, 4))
        read, waited = (first, 1), (first, 2)
        for key in (read, waited):
            transfer = schedule.fetch(key, 1, set())
            assert transfer is not None
            transfer.wait(10.0)
        pool = schedule.pool
        assert pool.is_loading(read) and pool.is_loading(waited)
        schedule.layer(LayerNeeds(first, 0, [waited[1]], [read[1]]))
        assert not pool.is_loading(read) and not pool.is_loading(waited)
        assert read not in pool.evictable(first)  # the pass is at its layer and not done with it
        schedule.layer(LayerNeeds(second, 1, []))
        assert {read, waited} <= set(pool.evictable(first))


def test_a_prefetch_the_verifier_never_used_is_resident_again_when_the_next_round_starts(replica) -> None:
    # A landed prefetch no pass read or waited for stays loading through its round (a later visit may
    # read it), and is resident once the next round starts: before that, it kept its slot for good.
    store = replica.store
    first, second = store.layers[0], store.layers[1]
    with _lone_schedule(store, "spt-unused") as schedule:
        schedule.begin_round(RoundStart(0, 0, 4))
        unused = (first, 3)
        transfer = schedule.fetch(unused, 1, set())
        assert transfer is not None
        transfer.wait(10.0)
        schedule.layer(LayerNeeds(first, 0, []))  # the pass goes by its layer without it
        schedule.layer(LayerNeeds(second, 1, []))
        pool = schedule.pool
        assert pool.is_loading(unused) and unused not in pool.evictable(first)
        schedule.begin_round(RoundStart(1, 1, 4))
        assert not pool.is_loading(unused) and unused in pool.evictable(first)


def test_pipelined_through_the_transfer_schedule_is_exact_and_sampling_matches_in_process(replica, models) -> None:
    target = replica.target("specter+fixed")
    tokens, stats = Engine(target, window=4, proposer=replica.proposer, pipelined=True).generate_fresh(PROMPT, NEW)
    assert tokens == _reference(models[0])
    assert stats.extra["ahead_asked"] > 0
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=3)
    got, _ = Engine(target, window=4, proposer=replica.proposer, pipelined=False).generate_fresh(PROMPT, NEW, sampling)
    local = OffloadedTarget.load(models[0], BUDGET, LINK, policy="specter+fixed")
    try:
        expected, _ = Engine(local, ResidentDraft(models[1]), 4).generate_fresh(PROMPT, NEW, sampling)
    finally:
        local.close()
    assert got == expected


def test_schedule_messages_that_name_nothing_are_refused(replica) -> None:
    server = replica.server
    before = dict(server.rejections)
    server.handle(UsePolicy("no-such-policy"))
    server.handle(UsePolicy("gate-prefetch"))  # reads hidden states: schedules in the verifier
    assert server.rejections[NO_POLICY] == before[NO_POLICY] + 2
    replica.target("demand-lru")
    server.handle(LayerNeeds(99, 1, [0]))
    server.handle(LayerNeeds(replica.store.layers[0], 1, [replica.store.num_experts]))
    assert server.rejections[OUT_OF_RANGE] == before[OUT_OF_RANGE] + 2
    server.handle(RoundStart(0, 0, 0))  # in range: handled
    assert server.rejections[OUT_OF_RANGE] == before[OUT_OF_RANGE] + 2


BATCH_PROMPTS = [[11, 400, 3021, 77], [5, 6, 7], [900, 12, 54, 1, 88, 2]]
BATCH_NEW = [14, 9, 12]


@pytest.mark.parametrize("policy", ["specter", "specter-paper"])
def test_batched_rounds_are_drafted_together_in_the_draft_process(awq_replica, policy) -> None:
    """The batcher's rounds through the draft server (``RemoteDrafter``): every drafting request's step
    in one draft forward there, the plans of them all reaching the schedule in the transfer server (its
    round counts them all), greedy tokens those of the target decoding each request alone."""
    replica = awq_replica
    draft = replica.draft_server.draft
    together: list[int] = []
    forward_batch = draft.forward_batch

    def counted(inputs, caches):  # type: ignore[no-untyped-def]
        together.append(len(inputs))
        return forward_batch(inputs, caches)

    target = replica.target(policy)
    schedule = replica.server.schedule
    assert schedule is not None
    drafts_seen: list[int] = []
    begin_round = schedule.policy.begin_round
    schedule.policy.begin_round = lambda r: (drafts_seen.append(schedule.policy.drafts_this_round(4)),  # type: ignore[method-assign]
                                             begin_round(r))
    draft.forward_batch = counted
    try:
        results = Batcher(target, max_batch=3, drafter=RemoteDrafter(replica.proposer), window=4).run(
            [BatchRequest(p, n) for p, n in zip(BATCH_PROMPTS, BATCH_NEW, strict=True)])
    finally:
        draft.forward_batch = forward_batch
    plain = OffloadedTarget.load(DEFAULT_MODEL, BUDGET, LINK, "demand-lru", device="cpu")
    try:
        alone = [Engine(plain, window=0).generate(p, n)[0] for p, n in zip(BATCH_PROMPTS, BATCH_NEW, strict=True)]
    finally:
        plain.close()
    assert [tokens for tokens, _ in results] == alone
    assert together and max(together) == 3  # all three requests' draft steps in one forward, in the draft process
    assert max(drafts_seen) > 4  # a round's plans are several requests' drafts, and the transfer side knew
    assert max(stats.extra["mean_accepted"] for _, stats in results) > 1
    assert replica.server.rejected == 0 and not replica.draft_server.rejections["failed"]
    deadline = time.monotonic() + 10.0  # each request ended on the draft too (EndRequest): no cache left held
    while replica.draft_server.batched and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not replica.draft_server.batched


def test_batched_sampling_through_the_draft_process_equals_in_process(awq_replica) -> None:
    """Sampled, K fixed: the draft process's batched rounds draw what the in-process batcher draws."""
    replica = awq_replica
    sampling = [SamplingConfig(temperature=0.7, seed=s) for s in range(len(BATCH_PROMPTS))]
    requests = lambda: [BatchRequest(p, n, q) for p, n, q in zip(BATCH_PROMPTS, BATCH_NEW, sampling, strict=True)]  # noqa: E731
    remote = Batcher(replica.target("specter+fixed"), max_batch=3, drafter=RemoteDrafter(replica.proposer),
                     window=3).run(requests())
    local_target = OffloadedTarget.load(DEFAULT_MODEL, BUDGET, LINK, "specter+fixed", device="cpu")
    try:
        local = Batcher(local_target, max_batch=3, draft=replica.draft_server.draft, window=3).run(requests())
    finally:
        local_target.close()
    assert [tokens for tokens, _ in remote] == [tokens for tokens, _ in local]
