"""The verifier's stand-in for a policy that schedules in the transfer actor.

``RemotePolicy`` carries the real policy's flags (what the executor and the engine read: host
compute, the window, ``route_last_draft``) and its window chooser (K is chosen where the round's
times are measured, and sent with each ``RoundStart``); its hooks become messages to the transfer
actor, where the same policy class runs (``specter/remote/scheduler.py``). Plan deltas do not pass
through here: the draft sends them to the transfer actor itself, so ``on_plan`` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from specter.experts.slots import Key
from specter.plan.base import Policy
from specter.plan.window import WindowChooser
from specter.protocol import FetchLater, PlanDelta, Replay, RequestStart, RoundEnd, RoundStart, VerifyStart
from specter.remote.channel import Channel

_FLAGS = ("name", "default_window", "route_last_draft", "host_compute", "fetch_after_host", "fetch_when_idle", "cache_arm", "hindsight_cache",
          "value_order", "adaptive_window", "pipelined", "needs_model")


class RemotePolicy(Policy):
    """A policy whose schedule runs in the transfer actor.

    Args:
        local: the same policy, built here for its flags and its window chooser (never bound).
        channel: the push channel to the transfer actor.
        wire: a round's id as the draft's plan deltas carry it (``RemoteProposer.wire_id``); default
            the engine's id (no draft).
    """

    def __init__(self, local: Policy, channel: Channel, wire: Callable[[int], int] | None = None):
        super().__init__()
        if local.needs_model:
            raise ValueError(f"policy {local.name}: reads the target's hidden states, so it schedules in the verifier")
        self.local, self.channel = local, channel
        self.wire = wire or (lambda round_id: round_id)
        for flag in _FLAGS:
            setattr(self, flag, getattr(local, flag))
        if hasattr(local, "replay"):
            self.replay = self._replay

    def window_chooser(self) -> WindowChooser | None:
        return self.local.window_chooser()

    def use_window_chooser(self, chooser: WindowChooser) -> None:
        self.local.use_window_chooser(chooser)

    def begin_request(self) -> None:
        self.channel.send(RequestStart())

    def begin_round(self, round_id: int) -> None:
        chooser = self.window_chooser()
        k = chooser.last if chooser is not None and chooser.last is not None else self.window
        self.channel.send(RoundStart(round_id, self.wire(round_id), k, self.round_drafts or 0))

    def on_plan(self, delta: PlanDelta) -> None:
        """Nothing: the draft sends its plans to the transfer actor."""

    def on_plans(self, deltas: list[PlanDelta]) -> None:
        """Nothing: the draft sends its plans to the transfer actor."""

    def begin_verify(self, round_id: int, positions: int) -> None:
        self.channel.send(VerifyStart(round_id, positions))

    def end_round(self, round_id: int, accepted: int, true_routing: dict[int, set[int]]) -> None:
        layers = sorted(true_routing)
        self.channel.send(RoundEnd(round_id, accepted, layers, [sorted(true_routing[lay]) for lay in layers]))

    def fetch_later(self, keys: list[Key]) -> None:
        by_layer: dict[int, list[int]] = {}
        for layer, expert in keys:
            by_layer.setdefault(layer, []).append(expert)
        for layer, experts in by_layer.items():
            self.channel.send(FetchLater(layer, experts))

    def choose_victim(self, candidates: list[Key]) -> Key:
        raise RuntimeError("the transfer actor chooses victims when it runs the schedule")

    def _replay(self) -> None:
        self.channel.send(Replay())
