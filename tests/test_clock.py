"""The virtual clock: events in the right order, the cost model's arithmetic, identical tokens,
identical figures run after run, and nothing that sleeps."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from tiny_models import noisy_copy
from transformers import AutoModelForCausalLM

from specter.cli import main
from specter.config import LinkConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.experts.link import DEMAND, PREFETCH, LinkError
from specter.experts.virtual_link import VirtualLink
from specter.plan import POLICIES, drafts
from specter.target import OffloadedTarget
from specter.timing.clock import VirtualClock, make_clock
from specter.timing.costs import cost_model, resolve_timing
from specter.timing.profiles import DENSE_KERNELS, EXPERT_KERNELS, LAUNCH_S, PROFILES, W4_TIME_RATIO

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 12


def _blob(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32), torch.zeros(n)


def test_virtual_link_lands_transfers_one_at_a_time_at_their_virtual_times():
    clock = make_clock("virtual", _costs())  # charges are explicit: no real time counts
    link = VirtualLink(clock, bandwidth=1000.0, latency=0.5)  # 1000 bytes/s
    src, dst = _blob(250)  # 1000 bytes: 0.5 + 1.0 s
    first = link.submit((0, 0), 0, src, dst, PREFETCH)
    second = link.submit((0, 1), 1, *_blob(250), PREFETCH)
    assert link.free_at(clock.now()) == pytest.approx(1.5)
    assert link.wait(second, 1.0) == pytest.approx(3.0)  # behind the first: lands at 1.5 + 1.5
    assert clock.now() == pytest.approx(3.0)
    assert first.done.is_set() and torch.equal(dst, src)
    assert link.busy_s == pytest.approx(3.0) and link.bytes_moved == 2000 and link.transfers == 2


def test_virtual_link_demand_jumps_queued_prefetches_and_cancels_drop_them():
    clock = make_clock("virtual", _costs())
    link = VirtualLink(clock, bandwidth=1000.0)
    moving = link.submit((0, 0), 0, *_blob(250), PREFETCH)  # starts at once: lands at 1.0
    queued = link.submit((0, 1), 1, *_blob(250), PREFETCH)
    dropped = link.submit((0, 2), 2, *_blob(250), PREFETCH)
    urgent = link.submit((0, 3), 3, *_blob(250), DEMAND)
    assert link.cancel(dropped) and not link.cancel(moving)
    assert link.wait(urgent, 1.0) == pytest.approx(2.0)  # after the moving one, before the queued
    assert moving.done.is_set() and not queued.started
    clock.advance(0.25)
    assert link.landing(queued, clock.now()) == pytest.approx(3.0)  # started at 2.0 when the link freed
    link.wait(queued, 1.0)
    assert clock.now() == pytest.approx(3.0)
    with pytest.raises(LinkError, match="cancelled"):
        link.wait(dropped, 1.0)


def test_virtual_link_idle_gap_starts_a_transfer_when_it_is_submitted():
    clock = make_clock("virtual", _costs())
    link = VirtualLink(clock, bandwidth=1000.0)
    link.wait(link.submit((0, 0), 0, *_blob(250), DEMAND), 1.0)  # lands at 1.0
    clock.advance(4.0)  # the device computes; the link is idle
    late = link.submit((0, 1), 1, *_blob(250), PREFETCH)
    assert link.landing(late, clock.now()) == pytest.approx(6.0)
    assert link.wait(late, 1.0) == pytest.approx(1.0)


def _costs():
    return cost_model(PROFILES["mixtral-pcie4"], 4, 2, 1024, 256)


def test_cost_model_is_the_real_models_step_on_its_gpu():
    p = PROFILES["mixtral-pcie4"]
    hbm = 1.555e12 * 0.7
    expert = 3 * 4096 * 14336 * 2
    dense = 12.9e9 * 2 - 64 * expert
    kv = 32 * 8 * 128 * 2 * 2  # the step's own position's keys and values
    # By hand: 32 layers of dense bytes and launches, 64 expert reads and launches.
    step = (dense + kv) / hbm + 32 * DENSE_KERNELS * LAUNCH_S + 64 * (expert / hbm + EXPERT_KERNELS * LAUNCH_S)
    assert p.step_s == pytest.approx(step)
    draft = (dense + kv) / hbm + 32 * DENSE_KERNELS * LAUNCH_S + 64 * (W4_TIME_RATIO * expert / hbm + EXPERT_KERNELS * LAUNCH_S)
    assert p.draft_ratio == pytest.approx(draft / step)
    assert 0.5 < p.draft_ratio < 1.0
    # The small model's 4 layers x top-2 stand for the real 32 x top-2: same step, same rho.
    small = cost_model(p, 4, 2, expert_nbytes=3 * 64 * 32 * 4, expert_numel=3 * 64 * 32)
    assert small.sigma == 8 and small.step_s == pytest.approx(p.step_s)
    assert small.draft_step_s == pytest.approx(p.draft_step_s)
    assert small.rho(small.link()) == pytest.approx(p.miss_s / p.step_s)
    assert small.rho(small.link(rho=3.0)) == pytest.approx(3.0)
    # The host keeps eta: one small expert on the host over its transfer equals the real one's.
    host = small.host()
    link = small.link()
    small_eta = host.expert_s(small.expert_nbytes, small.expert_flops, 1) / (small.expert_nbytes / link.bandwidth)
    assert small_eta == pytest.approx(p.eta)
    # A long prefill is flops-bound: its dense cost grows with the positions.
    assert small.dense_s(2048, 0) > 10 * small.dense_s(1, 0)


def test_the_as_built_clock_charges_the_draft_as_it_computed_its_experts():
    """The ideal engine's draft runs each distinct expert through the int4 kernel once; as built, a
    draft holding bf16 copies reads their bytes, and a gathered int4 step copies each routed pair's
    codes (read and written) before its kernel reads them — per pair, even when two tokens share one."""
    from specter.timing.dispatch import DISPATCH

    p = PROFILES["mixtral-pcie4"]
    hbm = 1.555e12 * 0.7
    one = 3 * 4096 * 14336 * 2 / hbm  # a Mixtral expert's bf16 read; one token's flops are far below it
    int4_bytes = (4 + 2 * 16 / 128) / 16  # 4-bit codes and a 16-bit scale and zero per 128, over 16 bits
    small = dataclasses.replace(cost_model(p, 4, 2, expert_nbytes=3 * 64 * 32 * 4, expert_numel=3 * 64 * 32),
                                launches=False)
    probs = torch.full((1, 2), 0.5)
    step = {0: (torch.tensor([[3, 5]]), probs)}
    dense = small.dense_s(1, 0)
    sigma = small.sigma
    assert small.draft_s(step, 1, 0) == pytest.approx(dense + 2 * sigma * W4_TIME_RATIO * one)
    assert small.draft_s(step, 1, 0, {0: "bf16"}) == pytest.approx(dense + 2 * sigma * one)
    gathered = (W4_TIME_RATIO + 2 * int4_bytes) * one
    assert small.draft_s(step, 1, 0, {0: "int4-gathered"}) == pytest.approx(dense + 2 * sigma * gathered)
    two = {0: (torch.tensor([[3, 5], [5, 3]]), probs.repeat(2, 1))}  # two tokens on the same two experts
    assert small.draft_s(two, 2, 0, {0: "int4-gathered"}) == pytest.approx(small.dense_s(2, 0) + 4 * sigma * gathered)
    assert small.draft_s(two, 2, 0, {0: "int4"}) == pytest.approx(small.dense_s(2, 0) + 2 * sigma * W4_TIME_RATIO * one,
                                                                   rel=1e-3)
    with pytest.raises(ValueError, match="draft compute: expected one of int4, int4-gathered, bf16, dequant, got 'fp8'"):
        small.draft_s(step, 1, 0, {0: "fp8"})
    # The virtual clock is the ideal engine's whatever the draft did; the as-built clock charges what it did.
    ideal, built = VirtualClock(small), VirtualClock(small, dispatch=DISPATCH["h200-graphs"])
    for clock in (ideal, built):
        clock.charge_draft(step, 1, 0, {0: "bf16"})
    assert ideal.draft_charged == pytest.approx(dense + 2 * sigma * W4_TIME_RATIO * one)
    assert built.draft_charged == pytest.approx(dense + 2 * sigma * one)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def setup(request, tiny_dir, tmp_path_factory):
    folder = tiny_dir(request.param)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    draft = ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d"))
    return folder, out[0, len(PROMPT):].tolist(), draft


def _run(folder, draft, policy: str, clock: str, rho: float = 3.0, idle: bool = True):
    timing = dataclasses.replace(resolve_timing(str(folder), clock, "qwen2moe-pcie4", rho=rho, step_s=0.004),
                                 idle=idle)
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.25), timing.link, policy=policy,
                                  clock=timing.make_clock())
    target.offload.set_host(timing.host)
    window = 4 if drafts(policy) else 0
    try:
        return Engine(target, draft if window else None, window, untimed_prefill=True).generate_fresh(PROMPT, NEW)
    finally:
        target.close()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tokens_on_the_virtual_clock_equal_the_wall_clocks_and_transformers(setup, policy):
    folder, expected, draft = setup
    virtual, stats = _run(folder, draft, policy, "virtual")
    assert virtual == expected, policy
    assert stats.extra["clock"] == "virtual" and stats.tpot_s > 0
    wall, wall_stats = _run(folder, draft, policy, "wall", rho=0.05)  # a fast wall link: a quick test
    assert wall == expected and wall_stats.extra["clock"] == "wall"


def test_two_virtual_runs_give_identical_figures_to_the_last_digit(setup):
    folder, _, draft = setup
    for policy in ("specter", "specter-paper", "demand-host"):
        first, second = (_run(folder, draft, policy, "virtual")[1].to_dict() for _ in range(2))
        for figure in ("tpot_s", "wait_s", "link_busy_s", "bytes_moved", "hits", "misses", "draft_s",
                       "verify_s", "host_s", "host_experts"):
            assert first[figure] == second[figure], (policy, figure)


def test_nothing_sleeps_on_the_virtual_clock(setup):
    """A link so slow that the run lasts minutes of virtual time finishes in seconds of wall time."""
    folder, expected, draft = setup
    t0 = time.perf_counter()
    tokens, stats = _run(folder, draft, "demand-lru", "virtual", rho=1e5)
    wall = time.perf_counter() - t0
    assert tokens == expected
    assert stats.decode_s > 60 and stats.wait_s > 60  # the link's time, on the clock
    assert wall < stats.decode_s / 4


def test_measured_clock_charges_compute_as_it_ran(setup):
    """Measured, jumping over its waits: compute at its CPU time (> 0, and no more than the wall
    time it took); no sleeps."""
    folder, expected, draft = setup
    t0 = time.perf_counter()
    tokens, stats = _run(folder, draft, "specter+nohost", "measured", rho=1e4, idle=False)
    wall = time.perf_counter() - t0
    assert tokens == expected and stats.extra["clock"] == "measured"
    assert 0 < stats.extra["draft_s"] < wall
    assert stats.decode_s > wall  # the link's virtual waits are most of it, and took no wall time


def test_measured_clock_idles_through_its_waits_without_counting_them(setup):
    """Measured, idling (the default): the run sleeps about as long as it waits on its clock, and
    the sleep is not counted as compute: a second, jumping run of the same command gives the same
    tokens, the same link figures and about the same clock time."""
    folder, expected, draft = setup
    t0 = time.perf_counter()
    tokens, idle = _run(folder, draft, "demand-lru", "measured", rho=50.0)
    wall = time.perf_counter() - t0
    jumping = _run(folder, draft, "demand-lru", "measured", rho=50.0, idle=False)[1]
    assert tokens == expected
    assert wall > idle.wait_s > 0.5  # it slept through the waits (a 50x link-bound run: seconds)
    assert idle.misses == jumping.misses and idle.bytes_moved == jumping.bytes_moved
    # waits are charged from the event model, not measured: the sleeps' overshoot adds nothing
    assert idle.decode_s < 1.5 * jumping.decode_s + 0.05


def test_cli_virtual_generate_is_repeatable_and_names_its_clock(tiny_dir, capsys):
    folder = tiny_dir("qwen2_moe")
    argv = ["generate", "--model", str(folder), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8", "--clock",
            "virtual", "--profile", "dsv2lite-pcie4", "--rho", "3", "--budget", "0.25", "--json"]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        out = capsys.readouterr()
        runs.append(json.loads(out.out.strip().splitlines()[-1])["stats"])
        assert "clock virtual (profile dsv2lite-pcie4, rho 3.0" in out.err
    assert runs[0]["clock"] == "virtual" and runs[0]["tpot_s"] == runs[1]["tpot_s"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--rho", "3"], "--rho: needs --profile"),
    (["--clock", "virtual", "--address", "local"], "--clock: the actors run on the wall clock"),
    (["--clock", "virtual", "--rho", "3", "--link", "sim:1"], "--rho: sets the link's bandwidth"),
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--rho", "-1", "--profile", "qwen2moe-pcie4"], "expected a positive"),
    (["--link", "mixtral-pcie4", "--profile", "qwen2moe-pcie4"], "names profile 'mixtral-pcie4'"),
])
def test_cli_timing_flags_fail_clearly(tiny_dir, capsys, extra, message):
    folder = tiny_dir("qwen2_moe")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(folder), "--prompt-ids", "5,6", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_virtual_clock_needs_a_cost_model_and_a_simulated_link(tiny_dir):
    with pytest.raises(ValueError, match="cost model"):
        make_clock("virtual")
    with pytest.raises(ValueError, match="clock: expected one of"):
        make_clock("sundial")
    with pytest.raises(ValueError, match="rho: must be > 0"):
        _costs().link(rho=0)
    with pytest.raises(ValueError, match="virtual clock runs a simulated link"):
        OffloadedTarget.load(tiny_dir("mixtral"), SlotConfig(fraction=0.5), LinkConfig(kind="cuda"), clock=VirtualClock(None),
                             device="cpu")


@pytest.mark.parametrize("policy", ["demand-lru", "specter"])
def test_a_prefetch_that_landed_unread_gives_its_slot_up_when_the_next_round_starts(tiny_dir, policy):
    """A prefetched expert no pass waited for stays loading (not a victim) while its round runs, and is
    resident once the next round starts: the least recently used of a full group then, the next demand
    fetches evict it first. (It stayed loading until someone waited for it, and a loading slot is never
    a victim: the budget lost a slot for every such prefetch for good — plain steps after drafting then
    missed every expert at Mixtral's shapes.)"""
    timing = resolve_timing(str(tiny_dir("mixtral")), "virtual", "qwen2moe-pcie4", rho=3.0, step_s=0.004)
    target = OffloadedTarget.load(tiny_dir("mixtral"), SlotConfig(fraction=0.25), timing.link, policy=policy,
                                  clock=timing.make_clock())
    try:
        offload, pool = target.offload, target.offload.pool
        layer = offload.store.layers[0]
        group = [k for k in pool.resident() if pool.group_of(k[0]) == pool.group_of(layer)]
        outside = [(lay, e) for lay in offload.store.layers for e in range(offload.store.num_experts)
                   if pool.group_of(lay) == pool.group_of(layer) and not pool.holds((lay, e))]
        assert len(outside) > len(group), "the test needs more experts outside the group's slots than slots"
        prefetched, *demanded = outside[: len(group) + 1]
        assert offload.fetch(prefetched, PREFETCH, set()) is not None
        offload.clock.advance(10.0)  # it lands; nobody waits for it
        offload.settle_landed()  # as the engine does when the next round starts
        assert pool.is_ready(prefetched) and not pool.loading_keys()
        for key in demanded:  # as many as the group has slots, each waited for (a plain step's misses)
            assert offload.fetch(key, DEMAND, set()) is not None
            offload.wait(key)
        assert all(pool.is_ready(key) for key in demanded)  # the slots hold what the steps asked for
        assert not pool.holds(prefetched)
    finally:
        target.close()


def test_every_round_starts_with_no_landed_prefetch_still_loading(tiny_dir, tmp_path):
    """Through the engine, end to end: when the policy hears of a round, no transfer that landed unread
    is still counted as loading, and some rounds did find such prefetches to settle (the case above
    happens in a real run: a drafting round's prefetches the verify pass did not use)."""
    timing = resolve_timing(str(tiny_dir("mixtral")), "virtual", "qwen2moe-pcie4", rho=3.0, step_s=0.004)
    target = OffloadedTarget.load(tiny_dir("mixtral"), SlotConfig(fraction=0.25), timing.link, policy="specter",
                                  clock=timing.make_clock())
    target.offload.set_host(timing.host)
    offload, policy = target.offload, target.offload.policy

    def landed_unread() -> list:
        now = offload.clock.now()
        return [k for k in offload.pool.loading_keys() if not offload.pool.is_pinned(k) and offload._landed(k, now)]

    found, at_rounds = [], []
    settle, begin = offload.settle_landed, policy.begin_round

    def settle_counting() -> None:
        found.append(len(landed_unread()))
        settle()

    def begin_looking(round_id: int) -> None:
        at_rounds.append(landed_unread())
        begin(round_id)

    offload.settle_landed, policy.begin_round = settle_counting, begin_looking  # type: ignore[method-assign]
    draft = ResidentDraft(noisy_copy(tiny_dir("mixtral"), tmp_path / "draft"))
    try:
        Engine(target, draft, 4, untimed_prefill=True).generate_fresh(PROMPT, 24)
    finally:
        target.close()
    assert len(at_rounds) > 3 and not any(at_rounds)
    assert sum(found) > 0, "no round found a landed, unread prefetch: the run does not exercise the case"
