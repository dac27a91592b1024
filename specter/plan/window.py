"""Adaptive speculation: each round's window K, chosen from what the run has measured so far.

For a candidate K the expected time per committed token is

    (c + f(K) · d + v(K)) / E(K),        E(K) = 1 + α + α² + … + α^K

where ``α`` is the per-position acceptance rate (one estimate serves every K), ``f(K)`` the draft
forwards a round of K makes (K, plus one when the policy routes the last draft token), ``c + f(K)·d``
a round's drafting time — a fixed part ``c`` (the first step feeds the tokens the last round
committed; through the actors a request message, and a draft process waking from the verify
pass) and ``d`` per forward — and ``v(K)`` the verify pass's time at K — its compute and whatever
it waited for the link or the host, so the link's backlog and the prefetch the drafting bought
are in it. ``c`` and ``d`` are a least-squares line through the rounds' (forwards, drafting
seconds), weighted like the other estimates; while the rounds measured hardly differ in K the
line is unknown and ``c`` is 0 (``d`` the seconds per forward). Folding ``c`` into ``d`` instead
makes a short window look dearer per forward than it is and a long one cheaper: where ``c`` is
large the chooser then drafts too little, which raises the per-forward figure further.
K = 0 is plain decoding: no draft forward, one committed token, ``v(0)`` one decode step
(with nothing prefetched, so it is measured on its own, never interpolated with drafting K).
With ``cache_arm`` (a policy computing late experts on the host) plain decoding comes in two arms:
K = 0 leaves the slots as they are (``demand-host``'s step: a host-computed expert is not cached),
``PLAIN_CACHED`` also moves each host-computed expert into a slot when the link is idle as its layer
ends (``caching``), so a large budget fills with what is used, as ``demand-lru``'s does. Which pays
depends on the budget (cached experts evict others) and the link (a fetch started when idle can still
delay the next demand transfer), so it is measured like any K: the cached arm starts from the plain
step's cost, with the optimism an untried K gets.

Each estimate is a moving average of the rounds measured (the mean of the first four, then an
exponential one). A drafting K's verify time moves with the text as much as with K (a stretch of
text whose experts the link cannot keep up with makes every K dear), and a K not played lately
would keep what it cost on other text. So ``v(K) = level · shape(K)``: every settled drafting round
moves the ``level`` (the verify time the text costs now, ``LEVEL_EMA``), and a round of K moves K's
``shape`` (its verify time over the level it was measured against): Ks played at different times
are compared closer to the same text. While one K is played alone nothing tells the text's change
from K's, and the level and K's shape share it (at these rates about evenly): a K not played lately
follows the text about half way, where a table per K did not follow it at all. A K whose shape is
not measured yet gets it from its measured neighbours (linear between two, the nearest one's beyond
them); plain steps keep their own averages. The chooser plays the K of least estimated time per
token after crediting each drafting K with an optimism bonus that shrinks with how often it was
measured lately (counts decay per round): an untried or long-unplayed K whose estimate comes close
gets played, so a cold first measurement (or a stale one) does not exclude a K for good. K = 0 gets
none: what a plain step costs hardly changes while the run drafts, what drafting costs does —
unless there are two plain arms, each living off what the other cached: then both get it. The
first two rounds are plain steps (K = 0), then ``START`` tokens are drafted until a drafting round
was measured; the second round's time anchors ``v(0)`` but is no sample (a stint of plain steps
settles later). The first round anchors nothing: it follows a prefill and costs what no plain step
costs again (46 ms against ~10 at Mixtral's shapes on the as-built clock); taken for a plain step,
it let a draft that loses to plain steps beat the anchor, and plain steps were never measured.

A round that paid a one-off (``cold``: a step shape run for the first time, its CUDA graphs
captured — on a GPU a token count's first two steps) measures no cost either: a K's first
settled round is the second with its verify pass's token count, the one that captures its graphs,
and counted it makes drafting look many times dearer than it is (the likely cause of the plain
rounds of ``specter`` in the H200's run: docs/benchmark.md).

Only settled rounds measure costs: a stint of plain steps measures from its ninth round, a stint
of drafting rounds from its second, and the first round of a request measures nothing (acceptance
counts from every drafting round: that is the draft's and the target's, whatever the link did).
The first drafting round after plain steps verifies with nothing prefetched and feeds the draft
every token it skipped; the first plain steps after drafting live off the drafting's prefetches
and then, with many slots, refill them with what plain steps cache (at ρ 3, 75 % a plain step
costs 8.5–12 ms for the first ten rounds or so after drafting and 7.7–8.7 once the slots are its
own): neither is what that K costs when it is kept, which is what the choice is about (a stint of plain steps
measured from its fifth round made drafting look cheaper than plain steps where it is not: the
grid on three prompt sets, docs/benchmark.md). Once the chooser
switches between plain and drafting (or between the plain arms) it stays until the new stint has
measured a settled round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
START = 4  # the first drafting round's K (the first round of all is a plain step, K = 0)
EMA = 0.25  # weight of the newest round in v(K), K's shape and d, once four were measured
LEVEL_EMA = 0.3  # weight of the newest drafting round in the level of the verify time
DECAY = 0.95  # per round, on the acceptance counts (about the last 20 rounds weigh in)
ALPHA_PRIOR = (3.0, 4.0)  # accepted, tried: a prior of α = 0.75 worth four positions
ALPHA_MAX = 0.999  # a guard, not a prior: at 0.99 E(32) could not pass 28.2 tokens, and greedy loops accept ~all
BONUS = 0.05  # optimism: a K measured n times (lately) is credited 1 - BONUS / sqrt(n + 1)
UNTRIED_BONUS = 0.1  # optimism for a K never measured (its v is interpolated)
PLAIN_BONUS = 0.01  # optimism between the two plain arms, measured n times (lately): 1 - PLAIN_BONUS / sqrt(n + 1)
SETTLE = {False: 8, True: 1}  # rounds of a kind in a row before one measures (plain, drafting)
SPREAD = 1.0  # the rounds' forwards must vary this much (variance) before c is told from d
PLAIN_CACHED = -1  # the plain step that caches its host-computed experts (``cache_arm``)
FORGET = 0.98  # per round, on every K's measurement count (a K unplayed for ~100 rounds is fresh again)
STATE_VERSION = 1  # of ``WindowChooser.state``'s layout: a state of another version is not read
_KEYED = {"verify_s": float, "shape": float, "measured": float, "samples": int}  # keyed by K (strings in JSON)
_SCALARS = {"route_last": bool, "cache_arm": bool, "draft_s": float, "round_s": float, "level": float,
            "accepted": float, "tried": float, "forward_samples": int, "kind": int, "stint": int,
            "stint_measured": bool, "last": int, "arm": int, "cold": int, "requests": int}
_OPTIONAL = {"draft_s", "level", "kind", "last", "arm", "moments"}  # may be None


@dataclass
class WindowChooser:
    """Chooses K per round (``choose``) and learns from each finished round (``record``).

    Args:
        route_last: the policy runs one more draft forward per round to route the K-th token.
        cache_arm: plain decoding may also cache its host-computed experts (``PLAIN_CACHED``).
    """

    route_last: bool = False
    cache_arm: bool = False
    draft_s: float | None = None  # one draft forward (d)
    round_s: float = 0.0  # a drafting round's fixed part (c)
    moments: tuple[float, float, float, float] | None = None  # averages of x, y, x², xy (x: forwards, y: seconds)
    verify_s: dict[int, float] = field(default_factory=dict)  # K → verify pass time (averaged as measured)
    level: float | None = None  # the verify time of shape 1 on the text of late (drafting rounds)
    shape: dict[int, float] = field(default_factory=dict)  # drafting K → its verify time over the level
    accepted: float = ALPHA_PRIOR[0]
    tried: float = ALPHA_PRIOR[1]
    measured: dict[int, float] = field(default_factory=dict)  # K → how often measured (decaying)
    samples: dict[int, int] = field(default_factory=dict)  # K → how often measured (ever)
    forward_samples: int = 0
    kind: int | None = None  # the running stint's: 1 drafting, 0 plain, PLAIN_CACHED; None: a request starts
    stint: int = 0  # rounds of that kind in a row so far
    stint_measured: bool = True  # the running stint has measured a settled round
    last: int | None = None  # the K chosen for the latest round
    arm: int | None = None  # that choice: its K, or PLAIN_CACHED
    cold: int = 0  # rounds that paid a one-off (``record``'s ``cold``), measured nothing
    requests: int = 0  # requests begun (what it learnt is kept across them)

    @property
    def alpha(self) -> float:
        """The per-position acceptance rate."""
        return min(ALPHA_MAX, self.accepted / self.tried)

    def forwards(self, k: int) -> int:
        """Draft forwards a round of K runs."""
        return k + 1 if self.route_last and k > 0 else max(k, 0)

    def expected_tokens(self, k: int) -> float:
        """Committed tokens a round of K yields on average: 1 + α + … + α^K."""
        a, k = self.alpha, max(k, 0)
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def estimate(self, k: int) -> float | None:
        """Expected seconds per committed token at K; None before any verify pass was measured."""
        verify = self._verify_estimate(k)
        if verify is None:
            return None
        draft = self.forwards(k) * (self.draft_s or 0.0) + (self.round_s if k > 0 else 0.0)
        return (draft + verify) / self.expected_tokens(k)

    def choose(self, limit: int, ahead: bool = False) -> int:
        """K for the next round, at most ``limit`` (the engine's cap and the tokens left); a plain
        step (0) may be the caching arm (``caching``).

        ``ahead``: the K of the round after the running one, drafted during its verify pass
        (pipelined), by the same rule but leaving the running round's choice in place: the policy
        reads it while the round runs (``last``, ``caching``), and until a switch has measured a
        settled round the next choice follows it. An ahead round that stands is ``play``ed."""
        options = [k for k in CANDIDATES if k <= limit] + ([PLAIN_CACHED] if self.cache_arm else [])
        if 0 < limit < CANDIDATES[-1] and limit not in options:  # the request's last tokens
            options.append(limit)
        if not self.verify_s:  # plain steps until the second anchors v(0), every K's estimate from below
            arm = 0
        elif set(self.verify_s) <= {0, PLAIN_CACHED}:
            arm = max(c for c in options if c <= START)
        elif not self.stint_measured and self.arm is not None:  # see a switch through until it measures
            arm = min(self.arm, limit)
        else:
            arm = min(options, key=lambda c: (self.score(c), c))
        if not ahead:
            self.play(arm)
        return max(arm, 0)

    def play(self, arm: int) -> None:
        """The next round runs ``arm`` (its K, or ``PLAIN_CACHED``): chosen now, or drafted ahead."""
        self.arm, self.last = arm, max(arm, 0)

    def summary(self) -> dict[str, Any]:
        """What it has learnt, for a run's record (why it chose the K it did): α, the draft's seconds
        per forward (d) and per round (c), the verify level, each K's estimated seconds per committed
        token (plain arms and candidates, once a pass was measured), its settled samples, the rounds
        that measured nothing for a one-off they paid (``cold``) and the requests it has served."""
        keys = sorted(set(CANDIDATES) | set(self.verify_s)) if self.verify_s else []
        estimates = {k: self.estimate(k) for k in keys}
        return {"alpha": self.alpha, "draft_s": self.draft_s, "round_s": self.round_s, "level": self.level,
                "per_token_s": {str(k): v for k, v in estimates.items() if v is not None},
                "samples": {str(k): n for k, n in sorted(self.samples.items())}, "cold": self.cold,
                "requests": self.requests}

    @property
    def caching(self) -> bool:
        """The latest choice is the plain step that caches its host-computed experts."""
        return self.arm == PLAIN_CACHED

    def score(self, k: int) -> float:
        """The estimate at K less its optimism bonus (what ``choose`` minimises)."""
        estimate = self.estimate(k)
        assert estimate is not None, "score() after a first round was recorded"
        if k == 0 and not self.cache_arm:  # a plain step's cost hardly drifts while drafting: no optimism
            return estimate  # (but the two plain arms' do: each lives off what the other cached)
        if k not in self.samples:  # never measured: only an interpolation, so more optimism
            return estimate * (1.0 - UNTRIED_BONUS)
        bonus = PLAIN_BONUS if k <= 0 else BONUS  # the plain arms differ by a few per cent at most
        return estimate * (1.0 - bonus / math.sqrt(self.measured.get(k, 0.0) + 1.0))

    def record(self, k: int, draft_s: float, verify_s: float, accepted: int | None, cold: bool = False) -> None:
        """What a round of K measured: its drafting time, its verify pass time, tokens accepted
        (a plain round counts for the arm chosen for it). ``accepted`` None: the round's acceptance
        went to ``observe`` already (a batched round: per request). ``cold``: the round paid a one-off
        (a step shape run for the first time, CUDA graphs captured): its acceptance counts, its
        times do not (it still counts in its stint)."""
        if k == 0 and self.arm == PLAIN_CACHED:
            k = PLAIN_CACHED
        if k > 0 and accepted is not None:  # acceptance is the draft's and the target's: any drafting round
            self.observe(k, accepted)
        if self.kind != min(k, 1):
            self.kind, self.stint, self.stint_measured = min(k, 1), 0, False
        if not self.verify_s and k <= 0 and self.stint > 0:  # the anchor: a second plain round (not a sample)
            self.verify_s[k] = verify_s
        settled = self.stint >= SETTLE[k > 0]
        self.stint += 1
        self.cold += cold
        if not settled or cold:
            return  # its costs are not what this K costs when kept
        self.stint_measured = True
        for c in self.measured:
            self.measured[c] *= FORGET
        self.measured[k] = self.measured.get(k, 0.0) + 1.0
        self.samples[k] = self.samples.get(k, 0) + 1
        self.verify_s[k] = _average(self.verify_s.get(k), verify_s, self.samples[k])
        if k > 0:
            self.forward_samples += 1
            self._fit_draft(self.forwards(k), draft_s)
            self._fit_level(k, verify_s)

    def observe(self, k: int, accepted: int) -> None:
        """A window of ``k`` draft tokens had ``accepted`` of them accepted (acceptance only)."""
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (1 if accepted < k else 0)

    def begin_request(self) -> None:
        """A request starts: its first round follows a prefill, so it measures nothing."""
        self.kind, self.stint, self.stint_measured = None, 0, True
        self.requests += 1

    def state(self) -> dict[str, Any]:
        """What it has learnt, as plain JSON-able values (``from_state`` reads it back): a chooser
        kept between runs (``specter/plan/window_store.py``), or handed to another process."""
        out: dict[str, Any] = {"version": STATE_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _KEYED:
                value = {str(k): v for k, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WindowChooser:
        """A chooser that goes on from ``state`` (``state()``'s), at the start of a request.

        Raises:
            ValueError: ``state`` is not one this version wrote (names the field at fault)."""
        if not isinstance(state, dict):
            raise ValueError(f"K chooser state: expected a mapping of its fields, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"K chooser state: expected version {STATE_VERSION}, got {state.get('version')!r}")
        chooser = cls()
        for name, value in state.items():
            if name == "version":
                continue
            try:
                setattr(chooser, name, _read_field(name, value))
            except (TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"K chooser state: field {name!r} holds {value!r} ({exc})") from None
        chooser.kind, chooser.stint, chooser.stint_measured = None, 0, True  # as ``begin_request`` leaves it
        return chooser

    def _fit_draft(self, x: int, y: float) -> None:
        """Update ``c`` and ``d`` with a round of ``x`` forwards that drafted for ``y`` seconds."""
        sample = (x, y, x * x, x * y)
        old = self.moments
        self.moments = mx, my, mxx, mxy = sample if old is None else tuple(  # type: ignore[assignment]
            _average(o, n, self.forward_samples) for o, n in zip(old, sample, strict=True))
        spread = mxx - mx * mx  # the forwards' variance
        slope = (mxy - mx * my) / spread if spread > SPREAD else -1.0
        if slope >= 0.0 and my - slope * mx >= 0.0:
            self.draft_s, self.round_s = slope, my - slope * mx
        elif spread > SPREAD:  # the line would cross below the origin: the best one through it
            self.draft_s, self.round_s = mxy / mxx, 0.0
        else:  # the rounds hardly differ in K: all per forward
            self.draft_s, self.round_s = my / mx, 0.0

    def _fit_level(self, k: int, verify_s: float) -> None:
        """Update the level and K's shape with a settled drafting round of K."""
        if self.level is None:  # the first: its K is the unit of shape
            self.level, self.shape[k] = verify_s, 1.0
            return
        shape = self._shape(k)
        assert shape is not None  # some K has a shape once the level is set
        self.shape[k] = _average(self.shape.get(k), verify_s / self.level, self.samples[k])
        self.level = (1 - LEVEL_EMA) * self.level + LEVEL_EMA * verify_s / shape

    def _shape(self, k: int) -> float | None:
        return _between(self.shape, k)

    def _verify_estimate(self, k: int) -> float | None:
        if k > 0 and self.level is not None:
            return self.level * self._shape(k)  # type: ignore[operator]
        if k == PLAIN_CACHED and k not in self.verify_s:  # untried: what a plain step costs
            k = 0
        if k in self.verify_s:
            return self.verify_s[k]
        # from the drafting Ks measured: a plain step is no neighbour of a drafting one
        return _between({c: v for c, v in self.verify_s.items() if c > 0}, k)


def _read_field(name: str, value: Any) -> Any:
    """A field of ``WindowChooser.state`` back in its own type (TypeError / ValueError if it is not one)."""
    if value is None and name in _OPTIONAL:
        return None
    if name in _KEYED:
        kind = _KEYED[name]
        return {int(k): kind(_number(v, kind)) for k, v in value.items()}
    if name == "moments":
        if len(value) != 4:
            raise ValueError("expected four averages")
        return tuple(float(_number(v, float)) for v in value)
    if name not in _SCALARS:
        raise ValueError("no such field")
    return _SCALARS[name](_number(value, _SCALARS[name]))


def _number(value: Any, kind: type) -> Any:
    """``value`` when it is a ``kind`` as JSON writes one (an int for a float; no bool for a number)."""
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or float(value).is_integer()))
    if not ok:
        raise TypeError(f"expected {kind.__name__}")
    return value


def _between(table: dict[int, float], k: int) -> float | None:
    """``table[k]``, else linear between its measured neighbours, the nearest one's beyond them."""
    if k in table:
        return table[k]
    below = [c for c in table if c < k]
    above = [c for c in table if c > k]
    if not below and not above:
        return None
    if not below:
        return table[min(above)]
    if not above:
        return table[max(below)]
    lo, hi = max(below), min(above)
    t = (k - lo) / (hi - lo)
    return (1 - t) * table[lo] + t * table[hi]


def _average(old: float | None, new: float, n: int) -> float:
    """The mean of the first four samples, then an exponential moving average."""
    weight = max(EMA, 1.0 / n)
    return new if old is None else (1 - weight) * old + weight * new
