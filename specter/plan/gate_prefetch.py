"""``gate-prefetch``: the next layer's router applied to the current hidden state, one layer ahead.

The MoE-Infinity / ProMoE / Pre-gated MoE family of predictors: no draft. At MoE layer l (its
input known), layer l+1's router is run on the same hidden state and the experts it picks are
moved while layer l computes.
"""

from __future__ import annotations

import torch

from specter.models.routing import router_modules
from specter.plan.base import Policy
from specter.plan.schedule import prefetch


class GatePrefetch(Policy):
    """Prefetch the next MoE layer's experts as its router predicts them from this layer's input."""

    name = "gate-prefetch"
    needs_model = True  # its routers run on the hidden state of the layer before

    def __init__(self) -> None:
        super().__init__()
        self.routers: dict[int, torch.nn.Module] = {}
        self.next_layer: dict[int, int] = {}

    def attach_model(self, model: torch.nn.Module) -> None:
        """Give the policy the target's routers (called by the target once loaded)."""
        self.routers = router_modules(model)
        layers = sorted(self.routers)
        self.next_layer = dict(zip(layers, layers[1:], strict=False))

    @torch.no_grad()
    def before_layer(self, layer: int, hidden: torch.Tensor, needed: list[int]) -> None:
        nxt = self.next_layer.get(layer)
        if nxt is None or self.offload is None:
            return
        _, _, index = self.routers[nxt](hidden)
        predicted = sorted(set(index.flatten().tolist()))
        protect = {(layer, e) for e in needed} | {(nxt, e) for e in predicted}
        prefetch(self.offload, [(nxt, e) for e in predicted], protect)
