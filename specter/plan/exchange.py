"""Whether caching an expert the host just computed pays, judged in hindsight on the true routing.

Caching a host-computed expert ``e`` (moving it into a slot for later) gives up a slot: the
expert ``v`` the policy would evict for it. By the exchange argument behind Belady's rule the swap
pays when ``e`` is used again before ``v`` is, and costs when ``v`` comes first. Which comes first
does not depend on what was cached: the routing is the model's, so the comparison can be made for
every such decision whether or not the swap was made — no arm has to be played to be measured, and
a change of text moves both sides of a comparison alike (a per-arm cost, measured on other tokens,
is moved by the text more than by the arm).

``ExchangeTally`` keeps the open pairs and the decayed counts of swaps that would have paid (e came
first) and cost (v came first); ``worth`` says whether the next swap is expected to pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specter.experts.slots import Key

DECAY = 0.99  # per decided pair, on both counts (about the last hundred decisions weigh in)
PRIOR = 1.0  # pays and costs each start at this: even odds
OPEN = 4096  # pairs kept open at most (the oldest are dropped undecided)


@dataclass
class ExchangeTally:
    """Open pairs (cached, evicted) and how often such a swap paid, decided by first use."""

    pays: float = PRIOR
    costs: float = PRIOR
    _pairs: dict[int, tuple[Key, Key]] = field(default_factory=dict)  # open, oldest first
    _waiting: dict[Key, list[int]] = field(default_factory=dict)  # expert → the open pairs naming it
    _next: int = 0

    def propose(self, cached: Key, evicted: Key) -> None:
        """A swap considered now: ``cached`` into the slot of ``evicted``."""
        if len(self._pairs) >= OPEN:
            del self._pairs[next(iter(self._pairs))]
            if sum(map(len, self._waiting.values())) > 4 * OPEN:  # drop what names closed pairs
                self._waiting = {k: live for k, ids in self._waiting.items()
                                 if (live := [i for i in ids if i in self._pairs])}
        self._pairs[self._next] = (cached, evicted)
        for key in (cached, evicted):
            self._waiting.setdefault(key, []).append(self._next)
        self._next += 1

    def observe(self, layer: int, used: set[int] | list[int]) -> None:
        """``layer`` ran with experts ``used``: decide every open pair one of whose experts it is
        (a pair both of whose experts it used is dropped undecided)."""
        hit: dict[int, set[bool]] = {}  # pair → which roles this layer used (True: the cached one)
        for expert in used:
            key = (layer, expert)
            for i in self._waiting.pop(key, ()):
                pair = self._pairs.get(i)
                if pair is not None:
                    hit.setdefault(i, set()).add(pair[0] == key)
        for i, roles in hit.items():
            del self._pairs[i]
            if len(roles) == 1:
                self._decide(pays=roles.pop())

    def worth(self) -> bool:
        """Whether a swap is expected to pay: it paid more often than it cost lately."""
        return self.pays > self.costs

    @property
    def open(self) -> int:
        """Pairs not decided yet."""
        return len(self._pairs)

    def _decide(self, pays: bool) -> None:
        self.pays = DECAY * self.pays + pays
        self.costs = DECAY * self.costs + (not pays)
