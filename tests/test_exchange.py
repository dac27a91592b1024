"""The hindsight tally behind caching a host-computed expert: a swap (cache e, evict v) paid when
the routing used e again before v, cost when v came first."""

from __future__ import annotations

import random

from specter.plan.exchange import DECAY, OPEN, PRIOR, ExchangeTally


def test_a_pair_is_decided_by_whichever_expert_is_used_first():
    tally = ExchangeTally()
    tally.propose((0, 1), (2, 5))  # e in layer 0, v in layer 2
    tally.propose((1, 3), (1, 4))
    tally.observe(2, {5})  # v first: the first swap would have cost
    assert tally.costs == DECAY * PRIOR + 1 and tally.pays == DECAY * PRIOR
    tally.observe(0, {1})  # decided already: nothing more
    tally.observe(1, {3, 7})  # e first: the second swap would have paid
    assert tally.pays == DECAY * DECAY * PRIOR + 1 and tally.open == 0


def test_a_pair_both_of_whose_experts_one_layer_uses_is_dropped_undecided():
    tally = ExchangeTally()
    tally.propose((1, 3), (1, 4))
    tally.observe(1, [3, 4])
    assert tally.open == 0 and tally.pays == tally.costs == PRIOR


def test_worth_follows_what_the_routing_did():
    """Against a reference: routing where the cached expert comes back first in 70 % of the pairs
    makes swaps worth it, 30 % does not."""
    for share, expected in ((0.7, True), (0.3, False)):
        rng = random.Random(0)
        tally = ExchangeTally()
        for i in range(400):
            tally.propose((0, 2 * i), (1, 2 * i + 1))
            if rng.random() < share:
                tally.observe(0, {2 * i})
            else:
                tally.observe(1, {2 * i + 1})
        assert tally.worth() is expected


def test_open_pairs_are_bounded():
    tally = ExchangeTally()
    for i in range(OPEN + 100):  # never decided: experts that are not used again
        tally.propose((0, i), (1, i))
    assert tally.open == OPEN
    tally.observe(0, {0, OPEN + 99})  # the oldest was dropped; the newest is still open
    assert tally.pays == DECAY * PRIOR + 1 and tally.open == OPEN - 1
