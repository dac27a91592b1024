"""What the draft has predicted so far in a round: per layer, expert → count and best weight."""

from __future__ import annotations

from dataclasses import dataclass, field

from specter.experts.slots import Key
from specter.protocol import PlanDelta


@dataclass
class RoundPlan:
    """Accumulated draft routing of the current round; deltas of older rounds are ignored."""

    round: int = -1
    steps: int = 0
    counts: dict[Key, int] = field(default_factory=dict)
    weight: dict[Key, float] = field(default_factory=dict)

    def reset(self, round_id: int) -> None:
        self.round, self.steps = round_id, 0
        self.counts.clear()
        self.weight.clear()

    def add(self, delta: PlanDelta) -> bool:
        """Fold a delta in; False (ignored) when it belongs to another round."""
        if delta.round != self.round:
            return False
        self.steps += 1
        for layer, ids, probs in zip(delta.layers, delta.experts, delta.probs, strict=True):
            for expert, prob in zip(ids, probs, strict=True):
                key = (layer, expert)
                self.counts[key] = self.counts.get(key, 0) + 1
                self.weight[key] = max(self.weight.get(key, 0.0), prob)
        return True

    def top_per_layer(self, m: int) -> list[Key]:
        """Up to ``m`` most frequent experts per layer (ties by weight), in layer order."""
        by_layer: dict[int, list[Key]] = {}
        for key in self.counts:
            by_layer.setdefault(key[0], []).append(key)
        ordered: list[Key] = []
        for layer in sorted(by_layer):
            keys = sorted(by_layer[layer], key=lambda k: (-self.counts[k], -self.weight[k], k[1]))
            ordered += keys[:m]
        return ordered
