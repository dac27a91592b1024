"""Continuous batching: every request decoded in a shared step equals itself decoded alone — and
transformers' ``generate`` — whatever joins, leaves or is cancelled around it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.assets import DEFAULT_MODEL
from specter.batch_draft import propose_together
from specter.batching import Batcher
from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.models.decode import LEAN_FAMILIES
from specter.plan import make_policy
from specter.proposer import LocalProposer
from specter.request import BatchRequest
from specter.target import OffloadedTarget
from specter.timing.dispatch import DispatchCount

FAST = LinkConfig(kind="sim", bandwidth=5e9, latency=0.0)
PROMPTS = [[5, 99, 17, 42, 8, 63, 21], [7, 7, 3], [120, 4, 56, 9, 11], [33], [64, 2, 2, 90, 15, 6, 77, 40]]
NEW = [12, 5, 9, 12, 7]


def _target(folder, budget: float = 0.5, policy: str = "demand-lru") -> OffloadedTarget:
    return OffloadedTarget.load(folder, SlotConfig(fraction=budget), FAST, policy, device="cpu")


def _positions_per_pass(target: OffloadedTarget) -> list[list[int]]:
    """From now on, each batched target pass appends the positions each of its requests fed."""
    positions: list[list[int]] = []
    original = target.forward_batch

    def counted(inputs, caches):  # type: ignore[no-untyped-def]
        positions.append([x.shape[1] for x in inputs])
        return original(inputs, caches)

    target.forward_batch = counted  # type: ignore[method-assign]
    return positions


@pytest.mark.parametrize("family", sorted(LEAN_FAMILIES))
def test_each_request_of_a_batch_is_transformers_generate(family, tiny_dir):
    folder = tiny_dir(family)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    expected = [ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p, n in zip(PROMPTS, NEW, strict=True)]
    target = _target(folder)
    try:
        results = Batcher(target, max_batch=3).run([BatchRequest(p, n) for p, n in zip(PROMPTS, NEW, strict=True)])
    finally:
        target.close()
    assert [tokens for tokens, _ in results] == expected
    sizes = [stats.extra["mean_batch"] for _, stats in results]
    assert max(sizes) > 2 and all(s <= 3 for s in sizes)  # they really ran together, never more than 3


@pytest.mark.parametrize(("family", "policy"), [("qwen2_moe", "specter+fixed"), ("mixtral", "specter-paper"),
                                                ("qwen3_moe", "specmoeoff")])
def test_speculative_rounds_batched_are_transformers_generate_and_each_request_alone(family, policy, tiny_dir):
    """Each request drafts with its own draft cache, one pass verifies every window; greedy tokens as
    transformers' and as the engine's one request at a time, sampled tokens as the engine's."""
    folder = tiny_dir(family)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    expected = [ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p, n in zip(PROMPTS, NEW, strict=True)]
    draft = load_draft(folder, device="cpu", mode="dequant-cache")  # the target as its own draft: rounds stand
    target = _target(folder, budget=0.25, policy=policy)
    try:
        batched = Batcher(target, max_batch=4, draft=draft, window=3).run(
            [BatchRequest(p, n) for p, n in zip(PROMPTS, NEW, strict=True)])
        sampling = [SamplingConfig(temperature=0.8, seed=s) for s in range(len(PROMPTS))]
        alone = [Engine(target, draft, window=3, pipelined=False).generate(p, n, q)[0]
                 for p, n, q in zip(PROMPTS, NEW, sampling, strict=True)]
        sampled = Batcher(target, max_batch=4, draft=draft, window=3).run(
            [BatchRequest(p, n, q) for p, n, q in zip(PROMPTS, NEW, sampling, strict=True)])
    finally:
        target.close()
    assert [tokens for tokens, _ in batched] == expected
    assert [tokens for tokens, _ in sampled] == alone
    assert max(stats.extra["mean_accepted"] for _, stats in batched) > 1  # rounds that accepted drafts
    assert max(stats.extra["mean_batch"] for _, stats in batched) > 2


def test_an_adaptive_policy_chooses_k_per_round_per_drafting_count_and_stays_lossless(tiny_dir):
    """``specter`` under batching: each round's K from a chooser per number of drafting requests; the
    policy's round counts every request's drafts; greedy tokens still transformers'."""
    folder = tiny_dir("qwen2_moe")
    new = [48, 20, 36, 48, 28]  # long enough that the choosers measure many rounds on any machine
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    expected = [ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p, n in zip(PROMPTS, new, strict=True)]
    draft = load_draft(folder, device="cpu", mode="dequant-cache")
    target = _target(folder, budget=0.25, policy="specter")
    policy = target.offload.policy
    round_drafts: list[int] = []
    begin_verify = policy.begin_verify

    def spy(round_id: int, positions: int) -> None:
        round_drafts.append(policy.drafts_this_round(0))
        begin_verify(round_id, positions)

    policy.begin_verify = spy
    try:
        batcher = Batcher(target, max_batch=3, draft=draft)
        requests = [BatchRequest(p, n) for p, n in zip(PROMPTS, new, strict=True)]
        results = batcher.run(requests)
    finally:
        target.close()
    assert [tokens for tokens, _ in results] == expected
    assert batcher.choosers is not None and len(batcher.choosers) >= 2 and set(batcher.choosers) <= {1, 2, 3}
    assert sum(sum(c.samples.values()) for c in batcher.choosers.values()) > 3  # they measured rounds
    ks = [k for r in requests for k in r.ks]
    assert len(set(ks)) > 1, ks  # chosen round by round
    assert max(round_drafts) > max(ks)  # a round's drafts are several requests' windows together
    assert all(0 < stats.extra["window"] <= policy.default_window for _, stats in results)


def test_the_awq_draft_drafts_every_request_in_one_forward_and_changes_no_token():
    """The embedded model with its AWQ draft: each draft step is one forward over every drafting
    request (``propose_together``), charged once; the tokens — greedy and sampled — are the engine's
    one request at a time with the same draft."""
    target = OffloadedTarget.load(DEFAULT_MODEL, SlotConfig(fraction=0.5), FAST, "specter+fixed", device="cpu")
    draft = load_draft(f"{DEFAULT_MODEL}-awq", device="cpu", mode="dequant-cache")
    assert draft.batches
    together: list[int] = []  # sequences per batched draft forward
    forward_batch = draft.forward_batch

    def counted(inputs, caches):  # type: ignore[no-untyped-def]
        together.append(len(inputs))
        return forward_batch(inputs, caches)

    draft.forward_batch = counted
    prompts = [[11, 400, 3021, 77], [5, 6, 7], [900, 12, 54, 1, 88, 2]]
    new = [14, 9, 12]
    sampling = [SamplingConfig(temperature=0.7, seed=s) for s in range(len(prompts))]
    try:
        greedy = Batcher(target, max_batch=3, draft=draft, window=4).run(
            [BatchRequest(p, n) for p, n in zip(prompts, new, strict=True)])
        sampled = Batcher(target, max_batch=3, draft=draft, window=4).run(
            [BatchRequest(p, n, q) for p, n, q in zip(prompts, new, sampling, strict=True)])
        alone = [Engine(target, draft, window=4, pipelined=False).generate(p, n)[0] for p, n in zip(prompts, new, strict=True)]
        alone_sampled = [Engine(target, draft, window=4, pipelined=False).generate(p, n, q)[0]
                         for p, n, q in zip(prompts, new, sampling, strict=True)]
    finally:
        target.close()
    assert together and max(together) == 3  # all three requests' draft steps in one forward
    assert [tokens for tokens, _ in greedy] == alone
    assert [tokens for tokens, _ in sampled] == alone_sampled
    assert max(stats.extra["mean_accepted"] for _, stats in greedy) > 1


@pytest.mark.parametrize("route_last", [False, True])
def test_proposing_together_sends_each_request_the_plans_and_drafts_it_would_alone(route_last):
    """``propose_together`` against each proposer's own ``propose``: the same draft tokens, and per
    request the same plan deltas (step, layers, experts, router weights to rounding)."""
    draft = load_draft(f"{DEFAULT_MODEL}-awq", device="cpu", mode="dequant-cache")
    prompts = [[11, 400, 3021, 77], [5, 6, 7], [900, 12, 54, 1, 88, 2]]
    ks = [5, 0, 3]

    def fresh() -> list[LocalProposer]:
        out = [LocalProposer(draft, batched=True) for _ in prompts]
        for proposer, prompt in zip(out, prompts, strict=True):
            proposer.prefill(prompt, SamplingConfig())
        return out

    seqs = [prompt + [42] for prompt in prompts]  # the prompt and the target's first token
    alone_plans: list[list] = [[] for _ in prompts]
    alone = []
    for i, (proposer, seq, k) in enumerate(zip(fresh(), seqs, ks, strict=True)):
        alone.append(proposer.propose(0, seq, k, alone_plans[i].append, route_last)[0] if k else [])
    sent: list = []
    together = propose_together(0, fresh(), seqs, ks, sent.append, route_last)
    assert [drafts for drafts, _ in together] == alone
    assert len(sent) == sum(len(p) for p in alone_plans)
    by_request: list[list] = [[] for _ in prompts]
    cursor = {i: 0 for i, k in enumerate(ks) if k}
    for delta in sent:  # each delta is the next one of some request: match it to its own sequence
        matches = [i for i in cursor if cursor[i] < len(alone_plans[i])
                   and alone_plans[i][cursor[i]].step == delta.step
                   and alone_plans[i][cursor[i]].experts == delta.experts]
        assert matches, delta
        i = matches[0]
        expected = alone_plans[i][cursor[i]]
        assert delta.layers == expected.layers
        assert [pytest.approx(p, abs=1e-5) for p in delta.probs] == expected.probs
        by_request[i].append(delta)
        cursor[i] += 1
    assert [len(b) for b in by_request] == [len(p) for p in alone_plans]


def test_sampled_requests_draw_as_they_would_alone(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    target = _target(folder)
    try:
        samplings = [SamplingConfig(temperature=0.9, top_p=0.95, seed=s) for s in range(len(PROMPTS))]
        alone = [Engine(target).generate(p, n, sampling)[0] for p, n, sampling in zip(PROMPTS, NEW, samplings, strict=True)]
        batched = Batcher(target).run([BatchRequest(p, n, sampling)
                                       for p, n, sampling in zip(PROMPTS, NEW, samplings, strict=True)])
    finally:
        target.close()
    assert [tokens for tokens, _ in batched] == alone


def test_a_joining_prompt_is_fed_a_chunk_per_step_beside_the_running_requests(tiny_dir):
    """A long prompt joins a running request: each step carries at most ``prefill_chunk`` of its tokens
    besides the running request's one, and both come out as they would alone."""
    folder = tiny_dir("qwen3_moe")
    target = _target(folder)
    long_prompt = [(7 * i + 3) % 120 for i in range(40)]
    try:
        alone = [Engine(target).generate(p, 10)[0] for p in (PROMPTS[0], long_prompt)]
        batcher = Batcher(target, max_batch=2, prefill_chunk=6)
        running = batcher.submit(BatchRequest(PROMPTS[0], 10))
        while not running.tokens:
            batcher.step()
        joining = batcher.submit(BatchRequest(long_prompt, 10))
        positions = _positions_per_pass(target)
        while batcher.step():
            pass
    finally:
        target.close()
    assert running.result(0)[0] == alone[0] and joining.result(0)[0] == alone[1]
    fed = [p for p in positions if len(p) == 2]
    assert fed[:7] == [[1, 6]] * 6 + [[1, 4]]  # 40 prompt tokens, 6 a step, beside the running request's one
    assert len(running.tokens) == 10


def test_a_joining_prompt_keeps_pace_with_the_rounds_draft_tokens(tiny_dir):
    """A step whose requests draft more tokens than ``prefill_chunk`` feeds a joining prompt as many
    (a round of K already verifies K + 1 positions a request; a step without drafts feeds the chunk:
    the test above). Every request's tokens stay those it makes alone."""
    folder = tiny_dir("qwen2_moe")
    draft = load_draft(folder, device="cpu", mode="dequant-cache")
    target = _target(folder, budget=0.25, policy="specter+fixed")
    long_prompt = [(7 * i + 3) % 120 for i in range(20)]
    try:
        alone = [Engine(target).generate(p, n)[0] for p, n in ((PROMPTS[0], 40), (long_prompt, 6))]
        batcher = Batcher(target, max_batch=2, prefill_chunk=3, draft=draft, window=4)
        running = batcher.submit(BatchRequest(PROMPTS[0], 40))
        while not running.tokens:
            batcher.step()
        joining = batcher.submit(BatchRequest(long_prompt, 6))
        positions = _positions_per_pass(target)
        while batcher.step():
            pass
    finally:
        target.close()
    assert running.result(0)[0] == alone[0] and joining.result(0)[0] == alone[1]
    assert positions[:5] == [[5, 4]] * 5  # the running request's round of 4 beside 4 prompt tokens, not 3


def test_prompts_join_together_while_they_fit_in_the_last_rounds_draft_tokens(tiny_dir):
    """Waiting prompts join one step while their whole prompts fit in ``prefill_chunk`` or, where more,
    in the draft tokens of the step before: two prompts of 2 join beside a round of 4 (a chunk of 3
    would take one a step), and every request's tokens stay those it makes alone."""
    folder = tiny_dir("qwen2_moe")
    draft = load_draft(folder, device="cpu", mode="dequant-cache")
    target = _target(folder, budget=0.25, policy="specter+fixed")
    short = [[7, 7], [120, 4]]
    try:
        alone = [Engine(target).generate(p, n)[0] for p, n in ((PROMPTS[0], 30), (short[0], 6), (short[1], 6))]
        batcher = Batcher(target, max_batch=3, prefill_chunk=3, draft=draft, window=4)
        running = batcher.submit(BatchRequest(PROMPTS[0], 30))
        while not running.ks:  # until it has drafted a round of 4
            batcher.step()
        joining = [batcher.submit(BatchRequest(p, 6)) for p in short]
        positions = _positions_per_pass(target)
        while batcher.step():
            pass
    finally:
        target.close()
    assert [r.result(0)[0] for r in (running, *joining)] == alone
    assert positions[0] == [5, 2, 2]  # both prompts in the step after a round of 4 drafts


def test_short_prompts_join_together_and_a_step_never_feeds_more_than_a_chunk(tiny_dir):
    """Waiting requests join the same step while their whole prompts fit in one ``prefill_chunk``; a
    longer prompt joins only when no other is being fed, and is fed a chunk a step."""
    folder = tiny_dir("qwen3_moe")
    target = _target(folder)
    prompts = [[7, 7, 3], [33], [120, 4, 56, 9, 11], [(7 * i + 3) % 120 for i in range(25)], [64, 2]]
    try:
        alone = [Engine(target).generate(p, 6)[0] for p in prompts]
        batcher = Batcher(target, max_batch=5, prefill_chunk=10)
        requests = [batcher.submit(BatchRequest(p, 6)) for p in prompts]
        positions = _positions_per_pass(target)
        while batcher.step():
            pass
    finally:
        target.close()
    assert [r.result(0)[0] for r in requests] == alone
    assert positions[0] == [3, 1, 5]  # three short prompts in one step (9 of 10 prompt tokens)
    assert positions[1:3] == [[1, 1, 1, 10]] * 2  # the long one alone, a chunk a step
    assert positions[3] == [1, 1, 1, 5, 2]  # its last 5 tokens leave room for the last prompt's 2
    assert all(sum(p) - len(p) <= 10 for p in positions)  # never more than a chunk of prompt work a step


def test_requests_join_and_leave_mid_run_and_a_cancelled_one_frees_its_place(tiny_dir):
    folder = tiny_dir("mixtral")
    target = _target(folder, budget=0.25)
    try:
        alone = [Engine(target).generate(p, 12)[0] for p in PROMPTS]
        batcher = Batcher(target, max_batch=4)
        streamed: list[int] = []
        first = batcher.submit(BatchRequest(PROMPTS[0], 12, on_tokens=streamed.extend))
        stop_after = {"n": 0}

        def cancel_soon() -> bool:
            stop_after["n"] += 1
            return stop_after["n"] > 3

        doomed = batcher.submit(BatchRequest(PROMPTS[1], 12, cancelled=cancel_soon))
        for _ in range(4):
            batcher.step()
        late = [batcher.submit(BatchRequest(p, 12)) for p in PROMPTS[2:]]  # join a running batch
        while batcher.step():
            pass
    finally:
        target.close()
    assert first.result(0)[0] == alone[0] == streamed  # streamed as it committed, same tokens
    tokens, stats = doomed.result(0)
    assert stats.extra["cancelled"] and 0 < len(tokens) < 12 and tokens == alone[1][:len(tokens)]
    assert [r.result(0)[0] for r in late] == alone[2:]
    assert batcher.idle() and doomed.cache is None


def test_a_step_reads_the_device_once_for_all_its_greedy_tokens(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    target = _target(folder, budget=1.0)
    try:
        batcher = Batcher(target, max_batch=4)
        requests = [batcher.submit(BatchRequest(p, 8)) for p in PROMPTS[:4]]
        while len(batcher.running) < 4 or any(not r.tokens for r in requests):  # the prompts, chunk by chunk
            batcher.step()
        with DispatchCount() as counted:
            assert batcher.step()
        assert len(batcher.running) == 4
        while batcher.step():
            pass
    finally:
        target.close()
    assert counted.reads == 1  # the four tokens (the resident layers' routing rides along)
    assert all(len(r.tokens) == 8 for r in requests)
    assert all(len(r.result(0)[0]) == 8 for r in requests)


def test_bad_requests_and_drafting_policies_are_refused_by_name(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    target = _target(folder)
    try:
        batcher = Batcher(target)
        with pytest.raises(ValueError, match="max_new_tokens"):
            batcher.submit(BatchRequest([1, 2], 0))
        with pytest.raises(ValueError, match="prompt"):
            batcher.submit(BatchRequest([], 3))
        with pytest.raises(ValueError, match="max_batch"):
            Batcher(target, max_batch=0)
        assert batcher.idle()
    finally:
        target.close()
    drafting = _target(folder, policy="specter")
    try:
        with pytest.raises(ValueError, match="give the draft model"):
            Batcher(drafting)
        other = make_policy("specter+last").new_window_chooser().state()  # drafts one more forward a round
        with pytest.raises(ValueError, match="route_last"):
            Batcher(drafting, draft=load_draft(folder, device="cpu", mode="dequant-cache"), choosers={2: other})
    finally:
        drafting.close()
