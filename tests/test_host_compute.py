"""Host compute of late experts: the same math on the same bytes, so output never changes; it is
chosen only when the host finishes first; its time is a timed wait like the link's."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import FAMILIES, noisy_copy
from transformers import AutoModelForCausalLM

from specter.config import HostConfig, LinkConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.experts.host import HostCompute
from specter.experts.store import ExpertShape
from specter.plan import POLICIES, drafts, make_policy
from specter.plan.window import PLAIN_CACHED
from specter.target import OffloadedTarget
from specter.timing.profiles import PROFILES

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 10
SLOW_LINK = LinkConfig(kind="sim", bandwidth=2e8, latency=0.0)  # a tiny expert takes ~0.1 ms
FAST_HOST = HostConfig(bytes_per_s=1e14)  # every late expert: the host is faster
SLOW_HOST = HostConfig(bytes_per_s=1e3)  # never faster than the link


def _load(folder, policy: str, host: HostConfig | None, budget: SlotConfig | None = None) -> OffloadedTarget:
    target = OffloadedTarget.load(folder, budget or SlotConfig(fraction=0.5), SLOW_LINK, policy=policy)
    target.offload.set_host(host)
    return target


@pytest.fixture(scope="module")
def mixtral(tiny_dir, tmp_path_factory):
    folder = tiny_dir("mixtral")
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    draft = ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d"))
    return folder, out[0, len(PROMPT):].tolist(), draft


def _host_cases():
    for name in sorted(POLICIES):
        for variant in (f"{name}+host", f"{name}+fetch"):
            for k in (1, 4) if drafts(name) else (0,):
                yield variant, k


@pytest.mark.parametrize(("policy", "window"), list(_host_cases()))
def test_greedy_with_host_compute_is_token_identical(mixtral, policy, window):
    """Every policy with host compute on (and with host-computed experts fetched for later), plain
    decoding and verify passes of K+1 positions: transformers' greedy tokens."""
    folder, expected, draft = mixtral
    target = _load(folder, policy, FAST_HOST, SlotConfig(experts=2))
    try:
        tokens, stats = Engine(target, draft if window else None, window).generate_fresh(PROMPT, NEW)
    finally:
        target.close()
    assert tokens == expected, (policy, window)
    assert stats.extra["host_experts"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_host_path_logits_equal_slot_path_bit_for_bit(family, tiny_dir):
    """A 12-position pass at the minimum budget: every late expert on the host vs none."""
    folder = tiny_dir(family)
    ids = torch.tensor([PROMPT + [3, 77, 12, 9, 100]])
    got = {}
    for host in (FAST_HOST, None):
        target = _load(folder, "demand-host", host, SlotConfig(experts=2, per_layer=True))
        try:
            got[host is None] = target.forward(ids, target.new_cache())
            used = target.offload.host.experts if host is not None else 0
        finally:
            target.close()
        assert (used > 0) == (host is not None)
    assert torch.equal(got[True], got[False])
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(got[False], ref(ids).logits.float(), rtol=1e-5, atol=1e-5)


def test_host_is_chosen_only_when_it_finishes_first(mixtral):
    folder, expected, _ = mixtral
    for host, used in ((SLOW_HOST, False), (FAST_HOST, True)):
        target = _load(folder, "demand-host", host, SlotConfig(experts=2))
        try:
            tokens, stats = Engine(target).generate_fresh(PROMPT, NEW)
        finally:
            target.close()
        assert tokens == expected
        assert (stats.extra["host_experts"] > 0) == used


def test_existing_baselines_never_compute_on_the_host(mixtral):
    folder, expected, draft = mixtral
    for policy in ("demand-lru", "gate-prefetch", "specmoeoff", "specter-paper", "specter+nohost"):
        target = _load(folder, policy, FAST_HOST, SlotConfig(experts=2))
        try:
            window = 2 if drafts(policy) else 0
            tokens, stats = Engine(target, draft if window else None, window).generate_fresh(PROMPT, NEW)
        finally:
            target.close()
        assert tokens == expected
        assert stats.extra["host_experts"] == 0, policy
    assert make_policy("demand-host").host_compute and make_policy("specter").host_compute
    assert not make_policy("demand-lru").host_compute


def test_host_time_is_a_timed_wait_behind_the_queued_experts():
    host = HostCompute(HostConfig(bytes_per_s=1e6, latency=0.01), ExpertShape(8, 4, torch.float32))
    assert host.expert_s(1) == pytest.approx(0.01 + 384 / 1e6)
    t0 = time.perf_counter()
    first = host.start(1, t0)
    second = host.start(3, t0)  # queued behind the first: the host does one expert at a time
    assert second == pytest.approx(first + host.expert_s(3))
    host.finish()
    assert time.perf_counter() - t0 >= second - t0 - 1e-4
    assert host.experts == 2 and host.wait_s > 0
    host.timed = False
    assert host.expert_s(5) == 0.0


def test_compute_bound_at_many_tokens():
    config = HostConfig(bytes_per_s=1e9, flops_per_s=1e9, latency=0.0)
    assert config.expert_s(1000, 10, 1) == pytest.approx(1e-6)  # memory-bound
    assert config.expert_s(1000, 10, 1000) == pytest.approx(1e-5)  # compute-bound


@pytest.mark.parametrize("name", list(PROFILES))
def test_simulated_host_keeps_the_profiles_host_to_link_ratio(name):
    profile = PROFILES[name]
    expert_bytes, expert_flops, link_bw = 196_608, 98_304, 1.7e6
    host = profile.sim_host(link_bw, expert_bytes, expert_flops)
    for tokens in (1, 4, 40):
        ratio = host.expert_s(expert_bytes, expert_flops, tokens) / (expert_bytes / link_bw)
        assert ratio == pytest.approx(profile.host_expert_s(tokens) / profile.link_expert_s)
    if profile.host.name.startswith("the lent"):  # measured: 16 cores take 0.21 ms where PCIe 5 takes 0.32
        assert 0.5 < profile.eta < 0.9
    else:
        assert 0.2 < profile.eta < 0.4  # a server CPU reads an expert 3-5x faster than PCIe moves it


@pytest.mark.parametrize("caching", [False, True])
def test_specters_plain_step_caches_its_host_experts_only_in_the_caching_arm(mixtral, caching):
    """A plain step with host compute: the caching arm (``window.PLAIN_CACHED``) moves the host's
    experts into slots when the link is idle, the plain arm moves nothing; tokens are the same."""
    folder, expected, draft = mixtral
    target = _load(folder, "specter+cachearm", FAST_HOST, SlotConfig(experts=2))
    chooser = target.offload.policy.window_chooser()
    assert chooser is not None and chooser.cache_arm
    plain = PLAIN_CACHED if caching else 0
    chooser.verify_s = {0: 1.0, PLAIN_CACHED: 1.0, 4: 100.0}  # drafting looks far dearer: plain steps only
    chooser.verify_s[plain] = 1e-6
    chooser.samples = {k: 1 for k in chooser.verify_s}
    try:
        tokens, stats = Engine(target, draft, 4).generate_fresh(PROMPT, NEW)
        assert target.offload.policy.fetches_when_idle() == caching
    finally:
        target.close()
    assert tokens == expected
    assert stats.extra["mean_window"] == 0 and stats.extra["host_experts"] > 0
    assert (stats.bytes_moved > 0) == caching


@pytest.mark.parametrize("paid", [False, True])
def test_specters_plain_step_caches_its_host_experts_when_such_swaps_paid(mixtral, paid):
    """``hindsight_cache``: a plain step offers each host-computed expert as a swap for the expert
    it would evict; it is cached only while such swaps paid (the tally), and every offer is a
    pair the tally decides later by which of the two the routing uses first."""
    folder, expected, draft = mixtral
    target = _load(folder, "specter", FAST_HOST, SlotConfig(experts=2))
    policy = target.offload.policy
    chooser = policy.window_chooser()
    assert chooser is not None and not chooser.cache_arm
    chooser.verify_s = {0: 1e-6, 4: 100.0}  # drafting looks far dearer: plain steps only
    chooser.samples = {0: 1, 4: 1}
    policy.exchange.pays, policy.exchange.costs = (1e9, 0.0) if paid else (0.0, 1e9)  # decay cannot turn them
    try:
        tokens, stats = Engine(target, draft, 4).generate_fresh(PROMPT, NEW)
    finally:
        target.close()
    assert tokens == expected
    assert stats.extra["mean_window"] == 0 and stats.extra["host_experts"] > 0
    assert (stats.bytes_moved > 0) == paid
    decided = policy.exchange.pays + policy.exchange.costs
    assert decided > 1e9 * 0.99**50 or policy.exchange.open > 0  # offers were made
