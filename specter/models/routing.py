"""Capturing a model's routing: which experts each MoE layer's router picked, per position."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specter.timing.dispatch import host_read

# layer → (top-k expert ids (T, k), their router probabilities (T, k)) of one forward
Routing = dict[int, tuple[torch.Tensor, torch.Tensor]]
# layer -> how a draft forward computed that layer's experts: "int4" | "int4-gathered" | "bf16" | "dequant"
# (``timing/profiles.py: DRAFT_EXPERT_READS``; what the as-built clock charges)
DraftCompute = dict[int, str]

_ROUTER_NAMES = ("gate", "router")


def router_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index → the router of each MoE layer (``mlp.gate`` or ``mlp.router``)."""
    found: dict[int, torch.nn.Module] = {}
    for index, layer in enumerate(model.get_decoder().layers):  # type: ignore[operator]
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "experts"):
            continue
        for name in _ROUTER_NAMES:
            module = getattr(mlp, name, None)
            if isinstance(module, torch.nn.Module) and not isinstance(module, torch.nn.Sequential):
                found[index] = module
                break
    return found


class RoutingRecorder:
    """Forward hooks on every router; ``last`` holds the latest call's (ids, weights) per layer.

    Routers in transformers 5 return ``(router_logits, top_k_weights, top_k_index)``.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = router_modules(model)
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in self.routers.items()]

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            _, weights, index = output
            self.last[layer] = (index.detach(), weights.detach().float())

        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def read_routing(routing: Routing, logits: torch.Tensor | None = None) -> tuple[Routing, int | None]:
    """``routing`` (on the device) on the host, every layer's ids and probabilities in one read; with
    ``logits`` (one row) also their argmax in the same read (a greedy draft's token: no read of its own)."""
    read, tokens = read_routing_rows(routing, None if logits is None else logits.reshape(1, -1))
    return read, None if tokens is None else tokens[0]


def read_routing_rows(routing: Routing, logits: torch.Tensor | None = None) -> tuple[Routing, list[int] | None]:
    """As ``read_routing`` with ``logits`` (n, V): each row's argmax, all in the one read."""
    tokens = None if logits is None else torch.argmax(logits, dim=-1).reshape(-1).float()
    if not routing:
        return {}, None if tokens is None else [int(t) for t in host_read(tokens)]
    layers = sorted(routing)
    ids = torch.stack([routing[layer][0] for layer in layers])
    probs = torch.stack([routing[layer][1] for layer in layers])
    parts = [ids.flatten().float(), probs.flatten().float()] + ([] if tokens is None else [tokens])
    values = np.asarray(host_read(torch.cat(parts)), dtype=np.float32)
    count = ids.numel()
    host_ids = values[:count].astype(np.int64).reshape(ids.shape)
    host_probs = values[count : 2 * count].reshape(ids.shape)
    read = {layer: (torch.from_numpy(host_ids[i]), torch.from_numpy(host_probs[i])) for i, layer in enumerate(layers)}
    return read, None if tokens is None else [int(t) for t in values[2 * count:]]
