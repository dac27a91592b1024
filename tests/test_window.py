"""The adaptive window: K per round from measured acceptance, draft cost and verify cost.

The chooser is driven here by synthetic rounds whose true cost per token is known in closed form,
so where it settles can be checked against the brute-force best K.
"""

from __future__ import annotations

import random

import pytest

from specter.plan import make_policy
from specter.plan.window import CANDIDATES, START, WindowChooser


def _true_cost(k: int, alpha: float, draft: float, verify) -> float:  # type: ignore[no-untyped-def]
    tokens = sum(alpha**i for i in range(k + 1))
    return (k * draft + verify(k)) / tokens


def _drive(chooser: WindowChooser, rounds: int, alpha: float, draft: float, verify, seed: int = 0) -> list[int]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    played = []
    for _ in range(rounds):
        k = chooser.choose(16)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        chooser.record(k, k * draft, verify(k), accepted)
        played.append(k)
    return played


def test_expected_tokens_is_the_geometric_sum():
    chooser = WindowChooser()
    chooser.accepted, chooser.tried = 3.0, 4.0  # alpha = 0.75
    for k in (0, 1, 4, 16):
        assert chooser.expected_tokens(k) == pytest.approx(sum(0.75**i for i in range(k + 1)))


def test_first_a_plain_step_then_the_start_window_until_a_drafting_round_is_measured():
    chooser = WindowChooser()
    assert chooser.choose(16) == 0
    chooser.record(0, 0.0, 1.0, 0)
    assert chooser.choose(16) == START
    chooser.record(START, 0.5, 2.0, 2)  # after a plain step: not settled, not measured
    assert START not in chooser.verify_s and chooser.draft_s is None
    assert chooser.choose(16) == START
    chooser.record(START, 0.5, 2.0, 2)
    assert chooser.verify_s[START] == 2.0 and chooser.draft_s == pytest.approx(0.5 / START)


def test_never_more_than_the_limit():
    chooser = WindowChooser()
    _drive(chooser, 20, 0.95, 0.01, lambda k: 1.0 + 0.01 * k)  # drafting pays: large K wanted
    assert all(chooser.choose(limit) <= limit for limit in (0, 1, 2, 5))


@pytest.mark.parametrize(("name", "alpha", "draft", "verify"), [
    # a fast link: drafting costs about a target step and buys nothing; plain decoding wins
    ("fast link", 0.9, 0.95, lambda k: 1.0 + 0.3 * k),
    # a slow link: a plain step waits for its misses, drafting hides them; a long window wins
    ("slow link", 0.9, 0.95, lambda k: 20.0 if k == 0 else 6.0 + 0.5 * k),
    # a poor draft on a slow link: a short window wins
    ("poor draft", 0.5, 0.95, lambda k: 12.0 if k == 0 else 4.0 + 0.8 * k),
])
def test_settles_where_the_true_cost_per_token_is_least(name, alpha, draft, verify):
    chooser = WindowChooser()
    played = _drive(chooser, 300, alpha, draft, verify)
    costs = {k: _true_cost(k, alpha, draft, verify) for k in CANDIDATES if k <= 16}
    best = min(costs.values())
    late = played[100:]
    # what the chooser spent per token over its last 200 rounds, against always playing the best K
    spent = sum(_true_cost(k, alpha, draft, verify) for k in late) / len(late)
    assert spent <= 1.03 * best, (name, sorted(costs.items(), key=lambda kv: kv[1])[:3], late[-20:])


def test_specter_adapts_its_window_and_the_oracle_and_fixed_variants_do_not():
    assert make_policy("specter").window_chooser() is not None
    assert make_policy("specter+fixed").window_chooser() is None
    assert make_policy("oracle").window_chooser() is None
    assert make_policy("specter-paper").window_chooser() is None
    assert make_policy("specter-paper+adapt").window_chooser() is not None
    # one chooser per policy, kept across requests (what was measured stays learnt)
    policy = make_policy("specter")
    assert policy.window_chooser() is policy.window_chooser()
    assert make_policy("specter").window_chooser().forwards(4) == 4  # type: ignore[union-attr]
    assert make_policy("specter+last").window_chooser().forwards(4) == 5  # type: ignore[union-attr]
