"""``oracle``: the bound. The true routing of every round, recorded from a run of the same prompt,
is the plan, known in full when the round starts; scheduling and eviction are ``specter``'s.

Usage: run the prompt once with ``Oracle()`` (it records), call ``replay()``, run it again.
"""

from __future__ import annotations

from specter.plan.specter import Specter
from specter.protocol import PlanDelta


class Oracle(Specter):
    """Perfect prediction from a recorded trace."""

    name = "oracle"
    route_last_draft = False  # it knows the routing; an extra draft step would only cost time
    adaptive_window = False  # its trace is replayed round by round, so every round has the same K
    pipelined = False  # the recorded run and its replay make the same rounds, one after another
    default_window = 4

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[dict[int, set[int]]] = []
        self.future: list[dict[int, set[int]]] | None = None

    def replay(self) -> None:
        """Use what was recorded as the future of the next run."""
        self.future, self.trace = self.trace, []

    def begin_request(self) -> None:
        self.trace = []

    def begin_round(self, round_id: int) -> None:
        super().begin_round(round_id)
        if self.future is None or round_id >= len(self.future):
            return
        layers = sorted(self.future[round_id])
        experts = [sorted(self.future[round_id][layer]) for layer in layers]
        self.plan.add(PlanDelta(round_id, 0, layers, experts, [[1.0] * len(e) for e in experts]))
        self.schedule()

    def on_plan(self, delta: PlanDelta) -> None:
        """Draft plans are ignored (the oracle already knows); the step's time still counts."""
        self.draft_step_done()

    def end_round(self, round_id: int, accepted: int, true_routing: dict[int, set[int]]) -> None:
        super().end_round(round_id, accepted, true_routing)
        self.trace.append({layer: set(ids) for layer, ids in true_routing.items()})
