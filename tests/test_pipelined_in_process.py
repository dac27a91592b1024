"""Pipelined drafting in process (``+pipe``, ``specter.proposer.IdleProposer``): the next round is
drafted in the verify pass's waits, and output stays exactly the unpipelined engine's and
transformers' — greedy for every drafting policy, sampled for a seed — whether the rounds drafted
ahead stand or are thrown away."""

from __future__ import annotations

import pytest
import torch
from tiny_models import noisy_copy
from transformers import AutoModelForCausalLM

import specter.request as request_module
from specter.bound import lower_bound
from specter.config import SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.plan import DRAFT_POLICIES
from specter.proposer import IdleProposer
from specter.target import OffloadedTarget
from specter.timing.costs import resolve_timing

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 24


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def setup(request, tiny_dir, tmp_path_factory):
    folder = tiny_dir(request.param)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    close = ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("close") / "d", scale=0.02))
    wrong = ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("wrong") / "d", scale=1.5))
    return folder, out[0, len(PROMPT):].tolist(), close, wrong


def _run(folder, draft, policy: str, window: int, pipelined: bool | None, sampling: SamplingConfig | None = None):
    """On the virtual clock at ρ = 30: the verify pass waits on the link, so there is idle time."""
    timing = resolve_timing(str(folder), "virtual", "qwen2moe-pcie4", rho=30.0)
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.25), timing.link, policy=policy,
                                  clock=timing.make_clock())
    target.offload.set_host(timing.host)
    try:
        engine = Engine(target, draft, window, untimed_prefill=True, pipelined=pipelined)
        tokens, stats = engine.generate_fresh(PROMPT, NEW, sampling)
        return tokens, stats, engine.proposer
    finally:
        target.close()


@pytest.mark.parametrize("policy", sorted(DRAFT_POLICIES))
def test_every_drafting_policy_pipelined_in_process_equals_transformers(setup, policy: str) -> None:
    folder, expected, close, _ = setup
    tokens, stats, proposer = _run(folder, close, f"{policy}+fixed+pipe", 4, pipelined=None)  # via +pipe
    assert isinstance(proposer, IdleProposer)
    assert tokens == expected, policy
    assert stats.extra["pipelined"] and stats.extra["ahead_asked"] > 0
    # drafting in the waits takes the device too (one clock): the bound still holds
    assert stats.bound_tpot_s is not None and 0 < stats.bound_tpot_s <= stats.tpot_s


def test_rounds_drafted_in_the_waits_stand_and_save_time(setup) -> None:
    folder, expected, close, _ = setup
    plain, plain_stats, _ = _run(folder, close, "specter+fixed", 4, pipelined=False)
    piped, stats, proposer = _run(folder, close, "specter+fixed", 4, pipelined=True)
    assert plain == piped == expected
    assert proposer.ahead_steps > 0 and stats.extra["ahead_kept"] > 0  # the waits were used, rounds stood
    assert stats.tpot_s < plain_stats.tpot_s  # a step drafted in a wait is not drafted after the pass


def test_a_wrong_draft_throws_its_rounds_away_and_output_is_unchanged(setup) -> None:
    folder, expected, _, wrong = setup
    tokens, stats, proposer = _run(folder, wrong, "specter+fixed", 4, pipelined=True)
    assert tokens == expected
    assert stats.extra["ahead_kept"] < stats.extra["ahead_asked"]


def test_sampled_output_pipelined_equals_unpipelined_for_a_seed(setup) -> None:
    folder, _, close, _ = setup
    sampling = SamplingConfig(temperature=1.0, top_k=8, seed=3)
    plain, _, _ = _run(folder, close, "specter+fixed", 4, pipelined=False, sampling=sampling)
    piped, stats, proposer = _run(folder, close, "specter+fixed", 4, pipelined=True, sampling=sampling)
    assert piped == plain
    assert proposer.ahead_steps > 0  # the generator was drawn from ahead and restored where thrown away


def test_the_bound_leaves_out_the_drafting_of_rounds_thrown_away(setup, monkeypatch) -> None:
    # A draft so wrong that no round drafted ahead stands makes the same rounds and passes as the
    # unpipelined run; what it drafted in the waits was thrown away and no round's drafting could
    # have overlapped the host's work, so the bound is the same.
    traces = []

    def recording(trace, *args):
        traces.append(trace)
        return lower_bound(trace, *args)

    monkeypatch.setattr(request_module, "lower_bound", recording)
    folder, _, _, wrong = setup
    _, plain = _run(folder, wrong, "specter+fixed", 4, pipelined=False)[:2]
    _, piped, proposer = _run(folder, wrong, "specter+fixed", 4, pipelined=True)
    assert piped.extra["ahead_kept"] == 0 and proposer.ahead_steps > 0 and proposer.thrown_s > 0
    (unpiped_trace, piped_trace) = traces
    assert unpiped_trace.ahead_s == 0 and piped_trace.ahead_s == pytest.approx(0, abs=1e-12)
    assert piped_trace.draft_s == pytest.approx(unpiped_trace.draft_s, rel=1e-9)
    assert piped.bound_tpot_s == pytest.approx(plain.bound_tpot_s, rel=1e-9)


def test_specter_pipelines_by_default_and_an_explicit_choice_wins(setup) -> None:
    folder, expected, close, _ = setup
    _, default, by_default = _run(folder, close, "specter+fixed", 4, pipelined=None)
    _, off, plain = _run(folder, close, "specter+fixed+nopipe", 4, pipelined=None)
    _, forced, forced_proposer = _run(folder, close, "specter+fixed+pipe", 4, pipelined=False)
    assert isinstance(by_default, IdleProposer) and default.extra.get("pipelined")
    assert not isinstance(plain, IdleProposer) and not off.extra.get("pipelined")
    assert not isinstance(forced_proposer, IdleProposer) and not forced.extra.get("pipelined")
