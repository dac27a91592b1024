"""Every message that crosses a socket between Specter's processes, and ``PROTOCOL_VERSION``.

Typed msgspec structs encoded as msgpack arrays (``array_like``), tagged so that one decoder
reads a union. Plans carry ids and scores, never tensors. New fields go at the end, with defaults.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1


class PlanDelta(msgspec.Struct, frozen=True, array_like=True, tag="plan"):
    """What the draft's routers picked at one draft step of one round.

    Attributes:
        round: the speculative round this step belongs to (stale rounds are cancelled).
        step: the draft step within the round, 0-based.
        layers: MoE layer ids, in the order of ``experts`` and ``probs``.
        experts: per layer, the top-k expert ids of this step's position(s), flattened.
        probs: per layer, the router weight of each id in ``experts``.
    """

    round: int
    step: int
    layers: list[int]
    experts: list[list[int]]
    probs: list[list[float]]
