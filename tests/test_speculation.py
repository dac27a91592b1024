"""Speculation is lossless for every policy, window and budget; sampling keeps the target's law."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import noisy_copy
from transformers import AutoModelForCausalLM

from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.plan import DRAFT_POLICIES, POLICIES
from specter.target import OffloadedTarget
from specter.verify.accept import accept_sampled
from specter.verify.sampling import coupled_draw

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 14
LINK = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)




@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def setup(request, tiny_dir, tmp_path_factory):
    folder = tiny_dir(request.param)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    draft = ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d"))
    return folder, ref.config.num_experts_per_tok, out[0, len(PROMPT):].tolist(), draft


def _cases():
    for policy in sorted(POLICIES):
        for k in (1, 4, 8) if policy in DRAFT_POLICIES else (0,):
            yield policy, k


@pytest.mark.parametrize(("policy", "window"), list(_cases()))
def test_greedy_is_token_identical_for_every_policy_window_budget(setup, policy, window):
    folder, top_k, expected, draft = setup
    for budget in (SlotConfig(experts=top_k), SlotConfig(fraction=0.5)):
        target = OffloadedTarget.load(folder, budget, LINK, policy=policy)
        try:
            tokens, stats = Engine(target, draft if window else None, window).generate_fresh(PROMPT, NEW)
        finally:
            target.close()
        assert tokens == expected, (policy, window, budget)
        if window:
            assert stats.extra["rounds"] > 0 and 0 <= stats.extra["recall"] <= 1


@pytest.mark.parametrize(("policy", "window"), [("specter", 4), ("specter-paper", 8), ("demand-lru", 0)])
def test_the_pieces_a_gpu_graphs_are_token_identical_too(setup, policy, window):
    """Target and draft steps after the prompt through ``models/graphed.py``'s static pieces (what a GPU
    replays as CUDA graphs), run eagerly: verify passes of K+1 positions and one-token steps decode
    transformers' tokens."""
    folder, top_k, expected, draft = setup
    target = OffloadedTarget.load(folder, SlotConfig(experts=top_k), LINK, policy=policy, step="static")
    try:
        tokens, _ = Engine(target, draft if window else None, window).generate_fresh(PROMPT, NEW)
    finally:
        target.close()
    assert tokens == expected, (policy, window)
    assert target.graphed is not None and len(target.graphed.pieces) >= (2 if window else 1)


def test_a_round_that_paid_a_one_off_cost_does_not_teach_the_window_chooser(setup, monkeypatch):
    """On a GPU a token count's first step runs eagerly and its second captures the CUDA graphs: a
    one-off many times a step (the H200's ``specter`` went plain after measuring its first K's capture).
    Here such steps (``GraphedStep.cold``, the static pieces run eagerly) are made to sleep 50 ms;
    the chooser's verify times must not see it — and do, when the engine does not tell it."""
    from specter.models.graphed import GraphedStep

    folder, top_k, expected, draft = setup
    call = GraphedStep.__call__

    def slow_when_cold(self, input_ids):  # type: ignore[no-untyped-def]
        cold = self.cold
        out = call(self, input_ids)
        if self.cold > cold:
            time.sleep(0.05)
        return out

    monkeypatch.setattr(GraphedStep, "__call__", slow_when_cold)

    def learnt(tell: bool) -> dict[int, float]:
        if not tell:
            monkeypatch.setattr(Engine, "cold_steps", lambda self: 0)
        target = OffloadedTarget.load(folder, SlotConfig(experts=top_k), LINK, policy="specter", step="static")
        try:
            engine = Engine(target, draft, 8)
            chooser = engine.policy.window_chooser()
            assert chooser is not None
            chooser.verify_s[0] = 1.0  # plain steps priced out (1 s): the run drafts, at several K
            tokens, _ = engine.generate_fresh(PROMPT, NEW)
            assert tokens == expected
            engine.generate_fresh(PROMPT[:3], 40)
            assert target.graphed is not None and target.graphed.cold >= 3
            assert (chooser.summary()["cold"] >= 1) == tell  # the rounds it was told of, and measured nothing in
            return {k: v for k, v in chooser.verify_s.items() if chooser.samples.get(k)}
        finally:
            target.close()

    told = learnt(True)
    assert told and max(told.values()) < 0.04, told
    assert max(learnt(False).values()) >= 0.05  # the same runs with the engine silent about it


def test_steps_made_ready_up_front_decode_the_same_and_are_never_cold(setup, tmp_path_factory):
    """``Engine.prepare_steps``: every token count a round of K <= window can use is made ready first
    (on a GPU captured: ``GraphedStep.prepare``; here the static pieces' warm-up), so no step of the
    requests after it is cold, and the tokens are transformers' (the warm-up wrote only past the
    cache's length)."""
    from specter.draft.loading import load_draft
    from specter.draft.quantize.model import quantize_model

    folder, top_k, expected, _ = setup
    out = tmp_path_factory.mktemp("prepared") / "draft"
    quantize_model(str(folder), str(out), method="rtn", group_size=32, progress=False)
    draft = load_draft(out, device="cpu", mode="dequant-cache", step="static")
    target = OffloadedTarget.load(folder, SlotConfig(experts=top_k), LINK, policy="specter-paper", step="static")
    try:
        engine = Engine(target, draft, 8)
        assert engine.prepare_steps() == 9 + 10  # target 1..9 tokens, draft 1..10
        assert engine.prepare_steps() == 0  # ready already
        assert target.graphed is not None and draft.graphed is not None
        before = (target.graphed.cold, draft.graphed.cold)
        for _ in range(2):
            tokens, stats = engine.generate_fresh(PROMPT, NEW)
            assert tokens == expected
        assert (target.graphed.cold, draft.graphed.cold) == before == (0, 0)
        assert stats.extra["rounds"] > 0  # rounds of K 8 (the last ones shorter), drafted and verified
    finally:
        target.close()
    with pytest.raises(ValueError, match="counts: expected token counts of at least 1"):
        target.graphed.prepare([0, 1])


def test_draft_equal_to_target_accepts_every_draft_token(setup):
    folder, _, expected, _ = setup
    same = ResidentDraft(folder)
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK, policy="specter")
    try:
        tokens, stats = Engine(target, same, 4).generate_fresh(PROMPT, NEW)
    finally:
        target.close()
    assert tokens == expected
    assert stats.extra["drafted"] > 0
    assert sum(i * c for i, c in enumerate(stats.extra["accepted_hist"])) == stats.extra["drafted"]


def test_oracle_has_no_demand_misses_when_a_verify_pass_fits(setup):
    folder, top_k, expected, draft = setup
    window = 1
    per_layer = (window + 1) * top_k  # a verify pass touches at most this many experts per layer
    target = OffloadedTarget.load(folder, SlotConfig(experts=per_layer, per_layer=True), LINK, policy="oracle")
    try:
        tokens, stats = Engine(target, draft, window).generate_fresh(PROMPT, NEW)
    finally:
        target.close()
    assert tokens == expected
    assert stats.extra["decode_misses"] == 0
    # Not vacuous: demand-lru in the same budget does miss.
    target = OffloadedTarget.load(folder, SlotConfig(experts=per_layer, per_layer=True), LINK, policy="demand-lru")
    try:
        _, lru = Engine(target).generate_fresh(PROMPT, NEW)
    finally:
        target.close()
    assert lru.extra["decode_misses"] > 0


def test_rejection_sampling_first_token_follows_the_target_exactly():
    gen = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 3, 30000
    p = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k,))
    counts = torch.zeros(vocab)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        n, nxt = accept_sampled(p, q, drafts, gen)
        first = drafts[0] if n > 0 else nxt
        counts[first] += 1
    assert _pvalue(counts, p[0]) > 1e-3
    # A wrong rule (always accept) is detected by the same test.
    wrong = torch.bincount(torch.multinomial(q[0], trials, replacement=True, generator=gen), minlength=vocab)
    assert _pvalue(wrong, q[0] * 0 + p[0]) < 1e-6


@pytest.mark.parametrize(("policy", "window"), [("specter", 2), ("specter+fixed", 1)])
def test_sampled_speculation_matches_the_targets_own_sampling(tiny_dir, tmp_path, policy, window):
    """Joint law of the first two new tokens (top-k 4) against the exact law from transformers.
    ``specter+fixed`` at K = 1 drafts the second token in the first round, so a fully accepted
    round's bonus token (``coupled_draw``) is the second token whenever the draft is accepted."""
    folder = tiny_dir("mixtral")
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    sampling = dict(temperature=1.0, top_k=4)
    with torch.no_grad():
        p1 = _warped(ref(torch.tensor([PROMPT])).logits[0, -1], **sampling)
        joint = {}
        for a in torch.nonzero(p1).flatten().tolist():
            p2 = _warped(ref(torch.tensor([PROMPT + [a]])).logits[0, -1], **sampling)
            for b in torch.nonzero(p2).flatten().tolist():
                joint[(a, b)] = float(p1[a] * p2[b])
    draft = ResidentDraft(noisy_copy(folder, tmp_path / "d", scale=0.4))
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK, policy=policy)
    cells = sorted(joint)
    counts = dict.fromkeys(cells, 0)
    trials = 400
    try:
        engine = Engine(target, draft, window)
        for seed in range(trials):
            tokens, _ = engine.generate(PROMPT, 2, SamplingConfig(seed=seed, **sampling))
            counts[tuple(tokens)] += 1
    finally:
        target.close()
    observed = torch.tensor([counts[c] for c in cells])
    assert observed.sum() == trials
    assert _pvalue(observed, torch.tensor([joint[c] for c in cells])) > 1e-3


def test_a_coupled_draw_follows_its_distribution_and_agrees_with_a_close_one():
    vocab, trials = 6, 20000
    torch.manual_seed(1)
    p = torch.distributions.Dirichlet(torch.ones(vocab)).sample()
    p[4] = 0.0  # a token top-p or top-k removed is never drawn
    p /= p.sum()
    draws = [coupled_draw(p, seed=7, position=i) for i in range(trials)]
    counts = torch.bincount(torch.tensor(draws), minlength=vocab)
    assert counts[4] == 0
    nonzero = p > 0
    assert _pvalue(counts[nonzero], p[nonzero]) > 1e-3
    # the same noise: equal distributions always agree, a close one nearly always, where
    # independent draws agree only with probability sum(p * q)
    q = 0.9 * p + 0.1 * torch.distributions.Dirichlet(torch.ones(vocab)).sample()
    agree = sum(coupled_draw(q, 7, i) == d for i, d in enumerate(draws[:2000])) / 2000
    tv = 0.5 * float((p - q).abs().sum())
    assert all(coupled_draw(p.clone(), 7, i) == d for i, d in enumerate(draws[:500]))
    assert agree >= (1 - tv) / (1 + tv) - 0.03 and agree > float((p * q).sum()) + 0.2
    # other seeds or positions draw afresh
    assert sum(coupled_draw(p, 8, i) == d for i, d in enumerate(draws[:2000])) / 2000 < float((p * p).sum()) + 0.05


def _pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts against a distribution: Pearson's statistic, and its p-value
    from the chi-square distribution's survival function with ``bins - 1`` degrees of freedom, the
    regularized upper incomplete gamma Q(dof / 2, stat / 2) (scipy's ``chisquare`` to 2e-9 relative over
    300 random cases of 2-200 bins; scipy is not installed: transformers imports ``scipy.optimize``
    whenever it is, ~1 s of every process that imports it)."""
    obs = observed.double()
    exp = probs.double() / probs.double().sum() * obs.sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))


def _warped(logits, temperature, top_k):
    from specter.verify.sampling import probabilities

    return probabilities(logits.unsqueeze(0), SamplingConfig(temperature=temperature, top_k=top_k))[0]


@pytest.mark.parametrize(("policy", "window"), [("demand-lru", 0), ("specter+fixed", 4), ("specter", 4)])
def test_streamed_chunks_are_the_tokens_and_a_cancelled_request_ends_at_a_round(setup, policy, window):
    """``on_tokens`` gets each step's or round's commits as they commit (together: the returned tokens,
    which are transformers'); ``cancelled`` ends the request before the next round, keeping what it
    committed."""
    folder, top_k, expected, draft = setup
    target = OffloadedTarget.load(folder, SlotConfig(experts=top_k), LINK, policy=policy)
    try:
        engine = Engine(target, draft if window else None, window)
        chunks: list[list[int]] = []
        tokens, stats = engine.generate_fresh(PROMPT, NEW, on_tokens=chunks.append)
        assert [t for chunk in chunks for t in chunk] == tokens == expected
        assert len(chunks) == 1 + (stats.extra.get("rounds", 0) + stats.extra.get("plain_rounds", 0) if window
                                   else NEW - 1) and not stats.extra["cancelled"]
        seen: list[int] = []
        tokens, stats = engine.generate_fresh(PROMPT, NEW, on_tokens=seen.extend, cancelled=lambda: len(seen) >= 3)
        assert stats.extra["cancelled"] and 3 <= len(tokens) < NEW and tokens == seen == expected[: len(tokens)]
        assert stats.new_tokens == len(tokens)
    finally:
        target.close()


@pytest.mark.parametrize("resident", [True, False])
def test_plain_greedy_decoding_ends_at_eos_with_transformers_tokens_streamed_one_by_one(setup, resident):
    """Plain greedy steps keep each token on the device and read it with the next step's reads, so the host
    learns it a step late: a request that ends by EOS is still transformers' tokens up to that EOS, each
    streamed to ``on_tokens`` on its own, and it runs one step past the EOS (whose token is dropped).
    EOS as the first token runs no step; as the last token the request allows, none past it."""
    folder, top_k, expected, _ = setup
    eos = expected[5]
    want = expected[: expected.index(eos) + 1]  # its first occurrence ends the request
    assert len(want) < NEW
    budget = SlotConfig(fraction=1.0) if resident else SlotConfig(experts=top_k)
    target = OffloadedTarget.load(folder, budget, LINK, policy="demand-lru")
    try:
        engine = Engine(target)
        chunks: list[list[int]] = []
        tokens, stats = engine.generate_fresh(PROMPT, NEW, eos_token_id=eos, on_tokens=chunks.append)
        assert tokens == want and chunks == [[t] for t in want]
        assert stats.new_tokens == len(want) and not stats.extra["cancelled"]
        assert stats.extra["plain_rounds"] == len(want)  # len(want) - 1 steps made its tokens, one read the EOS
        tokens, stats = engine.generate_fresh(PROMPT, NEW, eos_token_id=expected[0])
        assert tokens == expected[:1] and stats.extra["plain_rounds"] == 0
        tokens, stats = engine.generate_fresh(PROMPT, len(want), eos_token_id=eos)
        assert tokens == want and stats.extra["plain_rounds"] == len(want) - 1
    finally:
        target.close()


def test_a_round_that_ends_at_eos_counts_only_the_tokens_it_returns(setup):
    """A round whose accepted drafts run past the EOS commits up to the EOS; the stats' token count and
    TPOT are over the tokens returned (the round's tokens after the EOS used to be counted)."""
    folder, _, expected, _ = setup
    same = ResidentDraft(folder)  # accepts every draft: an EOS inside a round, tokens after it
    eos = expected[4]
    want = expected[: expected.index(eos) + 1]
    target = OffloadedTarget.load(folder, SlotConfig(fraction=1.0), LINK, policy="specter+fixed")
    try:
        tokens, stats = Engine(target, same, 8).generate_fresh(PROMPT, NEW, eos_token_id=eos)
    finally:
        target.close()
    assert tokens == want
    assert stats.new_tokens == len(want)
