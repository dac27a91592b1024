"""The lower bound: its fewest misses against a brute force over every slot schedule, its
arithmetic by hand, and no policy beating it on real runs."""

from __future__ import annotations

import itertools
import random

import pytest
from tiny_models import noisy_copy

from specter.bound import LayerUse, Trace, fewest_misses, lower_bound
from specter.config import SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.plan import POLICIES, drafts
from specter.target import OffloadedTarget
from specter.timing.costs import resolve_timing

PROMPT = [5, 99, 17, 42, 8, 63, 21]


def _brute_force_misses(trace: Trace) -> int:
    """The fewest misses over every choice of what the slots keep after each layer (one group)."""
    capacity = trace.capacity[0]
    best = {frozenset(trace.initial): 0}
    for use in trace.layers:
        keys = {(use.layer, e) for e in use.experts}
        nxt: dict[frozenset, int] = {}
        for held, misses in best.items():
            misses += len(keys - held)
            pool = sorted(held | keys)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    state = frozenset(keep)
                    if nxt.get(state, 1 << 30) > misses:
                        nxt[state] = misses
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("seed", range(12))
def test_fewest_misses_matches_a_brute_force_over_every_slot_schedule(seed):
    rng = random.Random(seed)
    layers, experts, capacity = 2, 5, rng.choice([1, 2, 3])
    uses = [LayerUse(i % layers, 0.0, {e: 1 for e in rng.sample(range(experts), rng.choice([1, 2, 3]))})
            for i in range(8)]
    initial = set(rng.sample([(lay, e) for lay in range(layers) for e in range(experts)], capacity))
    trace = Trace(capacity={0: capacity}, group_of={0: 0, 1: 0}, initial=initial, layers=uses)
    assert len(fewest_misses(trace)) == _brute_force_misses(trace)


def test_slot_groups_are_separate_caches():
    uses = [LayerUse(0, 0.0, {0: 1}), LayerUse(1, 0.0, {0: 1}), LayerUse(0, 0.0, {0: 1}), LayerUse(1, 0.0, {0: 1})]
    shared = Trace(capacity={0: 1}, group_of={0: 0, 1: 0}, initial=set(), layers=uses)
    per_layer = Trace(capacity={0: 1, 1: 1}, group_of={0: 0, 1: 1}, initial=set(), layers=uses)
    assert len(fewest_misses(shared)) == 3  # one slot: keep one of the two, the other misses again
    assert len(fewest_misses(per_layer)) == 2  # one slot each: only the first uses miss


def test_lower_bound_arithmetic_by_hand():
    # two layers of 1 ms dense, two experts each on one token; nothing resident, 4 slots
    uses = [LayerUse(0, 1e-3, {0: 1, 1: 1}), LayerUse(1, 1e-3, {0: 1, 1: 1})]
    trace = Trace(capacity={0: 4}, group_of={0: 0, 1: 0}, initial=set(), layers=uses, draft_s=2e-3)
    bound = lower_bound(trace, lambda t: 0.5e-3 * t, transfer_s=3e-3)
    assert bound.misses == 4
    assert bound.device_s == pytest.approx(2e-3 + 2e-3 + 4 * 0.5e-3)
    assert bound.link_host_s == pytest.approx(4 * 3e-3) and bound.decode_s == pytest.approx(12e-3)
    # a host at 2 ms per expert (ratio 4): j on the host costs the timeline max(A - H/4, H) over the
    # 4 ms of drafts and dense parts, the link (4 - j) x 3 ms; j = 2 gives max(4 + 4, 6) = 8 ms
    with_host = lower_bound(trace, lambda t: 0.5e-3 * t, transfer_s=3e-3, host_s=lambda t: 2e-3 * t)
    assert with_host.decode_s == pytest.approx(8e-3)
    assert with_host.decode_s <= bound.decode_s
    # pipelined, a round drafted ahead that stood may have drafted while the host computed: with
    # all 2 ms of drafting so, the passes' 2 ms of dense parts plus the host's work,
    # max(6 - H/4, 2 + H); j = 2 gives max(5, 6) and the link 6 ms. With 1 ms so, max(6 - H/4,
    # 3 + H): j = 2 gives 7 (the link 6), j = 3 gives 9
    host = dict(transfer_s=3e-3, host_s=lambda t: 2e-3 * t)
    trace.ahead_s = 2e-3
    assert lower_bound(trace, lambda t: 0.5e-3 * t, **host).decode_s == pytest.approx(6e-3)
    trace.ahead_s = 1e-3
    assert lower_bound(trace, lambda t: 0.5e-3 * t, **host).decode_s == pytest.approx(7e-3)


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    folder = tiny_dir("qwen2_moe")
    return folder, ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d"))


@pytest.mark.parametrize(("rho", "budget", "temperature"), [(2.0, 0.25, 0.0), (30.0, 0.25, 0.0), (30.0, 0.5, 0.8)])
def test_no_policy_beats_its_bound(models, rho, budget, temperature):
    folder, draft = models
    timing = resolve_timing(str(folder), "virtual", "qwen2moe-pcie4", rho=rho)
    sampling = SamplingConfig(temperature=temperature, top_p=0.95 if temperature else 1.0)
    for name in [*POLICIES, "specter+fixed", "specter+fetch", "specter+pipe", "specter-paper+host+pipe"]:
        target = OffloadedTarget.load(folder, SlotConfig(fraction=budget), timing.link, policy=name,
                                      clock=timing.make_clock())
        target.offload.set_host(timing.host)
        window = 4 if drafts(name) else 0
        try:
            engine = Engine(target, draft if window else None, window, untimed_prefill=True)
            stats = [engine.generate_fresh(PROMPT, 16, sampling)[1] for _ in range(2)]
        finally:
            target.close()
        for s in stats:
            assert s.bound_tpot_s is not None and 0 < s.bound_tpot_s <= s.tpot_s, (name, s.bound_tpot_s, s.tpot_s)


def test_no_bound_off_the_virtual_clock(models):
    folder, _ = models
    timing = resolve_timing(str(folder), "measured", "qwen2moe-pcie4", rho=3.0, step_s=0.004)
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.25), timing.link, policy="demand-lru",
                                  clock=timing.make_clock())
    try:
        _, stats = Engine(target).generate_fresh(PROMPT, 4)
    finally:
        target.close()
    assert stats.bound_tpot_s is None and stats.tpot_s > 0
