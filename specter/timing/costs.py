"""The virtual clock's cost model: what a forward of the small model costs on a profile's GPU.

The small model's layers and experts stand for the real model's (``docs/profiles.md``): each of
its ``layers`` MoE layers stands for ``profile.layers / layers`` real ones, and each routed expert
it runs for ``σ = profile.experts_per_token / (layers × top_k)`` real expert runs, so that one
all-resident decode step costs exactly the real model's step on that GPU. Moving one small expert
over the virtual link takes σ real expert transfers and computing one on the host σ real host
computations, so on the virtual clock ρ, η and the draft/target step ratio are the real model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from specter.config import HostConfig, LinkConfig
from specter.timing.clock import WallClock, make_clock
from specter.timing.dispatch import DEFAULT_DISPATCH, DISPATCH, Dispatch
from specter.timing.profiles import LAUNCH_S, Profile

if TYPE_CHECKING:
    from specter.models.routing import DraftCompute, Routing


@dataclass(frozen=True)
class CostModel:
    """Seconds of compute charged on the virtual clock, per the real model under ``profile``.

    Args:
        profile: the GPU, link, host and real model.
        layers: the small model's MoE layers.
        top_k: the small model's experts per token per layer.
        expert_nbytes: bytes of one small-model expert blob (what the virtual link moves).
        expert_flops: flops of one small-model expert on one token (what the host computes).
        launches: charge the ideal engine's fixed launches per layer and expert (``virtual``); False
            where the clock counts the dispatch the engine really issues (``as-built``).
    """

    profile: Profile
    layers: int
    top_k: int
    expert_nbytes: int
    expert_flops: int
    launches: bool = True

    def __post_init__(self) -> None:
        if self.layers < 1 or self.top_k < 1:
            raise ValueError(f"cost model: needs >= 1 MoE layer and top_k >= 1, got {self.layers}, {self.top_k}")

    @property
    def sigma(self) -> float:
        """Real expert runs one small expert run stands for."""
        return self.profile.experts_per_token / (self.layers * self.top_k)

    @property
    def layer_scale(self) -> float:
        """Real layers one small MoE layer stands for."""
        return self.profile.layers / self.layers

    def dense_s(self, positions: int, context: int) -> float:
        """One MoE layer's dense part (charged as the layer starts)."""
        return self.layer_scale * self.profile.dense_layer_s(positions, context, self._launch_s)

    def expert_s(self, tokens: int) -> float:
        """One routed target expert on ``tokens`` tokens from a device slot."""
        return self.sigma * self.profile.expert_s(tokens, launch_s=self._launch_s)

    @property
    def _launch_s(self) -> float:
        return LAUNCH_S if self.launches else 0.0

    def draft_s(self, routing: Routing, positions: int, context: int, compute: DraftCompute | None = None) -> float:
        """One draft forward: every layer's dense part and its experts — each distinct one as int4 on
        its tokens (the ideal engine's draft), or as ``compute`` says the draft computed each layer's
        (``DraftModel.last_compute``; ``int4-gathered``: every routed pair its own copy and call)."""
        total = len(routing) * self.dense_s(positions, context)
        for layer, (ids, _) in routing.items():  # host tensors (the draft read them): numpy, not a device read
            how = (compute or {}).get(layer, "int4")
            flat = ids.numpy().ravel()
            if how == "int4-gathered":
                total += len(flat) * self.sigma * self.profile.draft_expert_s(1, how, self._launch_s)
                continue
            counts = np.bincount(flat)
            for tokens in counts[counts > 0].tolist():
                total += self.sigma * self.profile.draft_expert_s(tokens, how, self._launch_s)
        return total

    @property
    def step_s(self) -> float:
        """The all-resident decode step of the target (= ``profile.step_s``)."""
        return self.layers * (self.dense_s(1, 0) + self.top_k * self.expert_s(1))

    @property
    def draft_step_s(self) -> float:
        """A draft decode step (= ``profile.draft_step_s``)."""
        int4 = self.profile.expert_s(1, int4=True, launch_s=self._launch_s)
        return self.layers * (self.dense_s(1, 0) + self.top_k * self.sigma * int4)

    def link(self, rho: float | None = None) -> LinkConfig:
        """The virtual link: the profile's (one small expert moves in σ real transfers), or with
        ``rho`` the bandwidth at which a fully-missed token takes ρ all-resident steps."""
        if rho is None:
            bandwidth = self.expert_nbytes / (self.sigma * self.profile.link_expert_s)
        else:
            if not rho > 0:
                raise ValueError(f"rho: must be > 0, got {rho}")
            bandwidth = self.layers * self.top_k * self.expert_nbytes / (rho * self.ideal.step_s)
        return LinkConfig(kind="sim", bandwidth=bandwidth, latency=0.0)

    def host(self) -> HostConfig:
        """The profile's host CPU, each small expert standing for σ real ones (whatever the link)."""
        return self.profile.scaled_host(self.expert_nbytes, self.expert_flops, self.sigma)

    def rho(self, link: LinkConfig) -> float:
        """ρ of ``link`` for this model: a fully-missed token's transfers over the all-resident step."""
        return self.layers * self.top_k * self.expert_nbytes / link.bandwidth / self.ideal.step_s

    @property
    def ideal(self) -> CostModel:
        """This model with the ideal engine's launches: ρ is the same link's whatever the clock counts."""
        return self if self.launches else replace(self, launches=True)

    def describe(self) -> str:
        p = self.profile
        return (f"{p.name}: step {p.step_s * 1e3:.2f} ms, draft/target {p.draft_ratio:.2f}, "
                f"{self.layers} layers x {self.top_k} stand for {p.layers} x {p.experts_per_token // p.layers}")


def cost_model(profile: Profile, moe_layers: int, top_k: int, expert_nbytes: int, expert_numel: int) -> CostModel:
    """The cost model of a small model (its MoE layers, top-k, one expert's bytes and weights)."""
    return CostModel(profile, moe_layers, top_k, expert_nbytes, 2 * expert_numel)


@dataclass(frozen=True)
class Timing:
    """A run's clock, link and host, resolved from the command line's ``--clock/--profile/--link/--rho``.

    Attributes:
        clock: ``wall`` | ``virtual`` | ``as-built`` | ``measured`` (``specter/timing/clock.py``).
        link: the (simulated or virtual) link.
        host: the host's rate; None: the link's default host (a plain ``sim:`` link, no profile).
        costs: the cost model (the virtual clock only).
        profile: the profile named, if any.
        rho: the offload pressure ``link`` gives this model (None when no profile says what a step is).
    """

    clock: str
    link: LinkConfig
    host: HostConfig | None = None
    costs: CostModel | None = None
    profile: str | None = None
    rho: float | None = None
    idle: bool = True  # the measured clock sleeps through its waits (``VirtualClock``)
    dispatch: Dispatch | None = None  # the as-built clock's per-op and per-read costs

    def make_clock(self) -> WallClock:
        """A fresh clock of this kind (one per target: each target's link lives on its own)."""
        return make_clock(self.clock, self.costs, self.idle, self.dispatch)

    def describe(self) -> str:
        rho = f", rho {self.rho:.1f}" if self.rho is not None else ""
        where = f"profile {self.profile}{rho}, " if self.profile else ""
        return f"clock {self.clock} ({where}link {self.link.bandwidth / 1e6:.2f} MB/s)"


def model_costs(model: str, profile: Profile) -> CostModel:
    """The cost model of the checkpoint at ``model`` under ``profile``."""
    import torch

    from specter.models.loader import build_dense

    loaded = build_dense(model, torch.float32)
    return cost_model(profile, len(loaded.moe_layers), loaded.top_k, loaded.shape.nbytes, loaded.shape.numel)


def resolve_timing(
    model: str, clock: str = "wall", profile: str | None = None, link: LinkConfig | None = None,
    rho: float | None = None, step_s: float | None = None, dispatch: str = DEFAULT_DISPATCH,
) -> Timing:
    """What a run of ``model`` is timed by.

    ``profile`` sets the link and host (on the virtual clock also the model's proportions:
    ``CostModel``); ``link`` replaces the profile's link; ``rho`` sets the link's bandwidth so
    that ρ = R for this model under the profile. On the wall and measured clocks a profile's link
    is scaled to this CPU's all-resident step (``step_s``, measured when None). Without a profile
    the virtual clock takes the one whose real model is of the checkpoint's family. The
    ``as-built`` clock is the virtual one charging the engine's counted dispatch at ``dispatch``'s
    costs (``specter.timing.dispatch.DISPATCH``) instead of the ideal engine's fixed launches.
    """
    from specter.timing.clock import CLOCKS
    from specter.timing.profiles import PROFILES, default_profile

    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch: unknown {dispatch!r}; known: {', '.join(DISPATCH)}")
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile: unknown {profile!r}; known: {', '.join(PROFILES)}")
    if rho is not None and not (rho > 0 and rho < float("inf")):
        raise ValueError(f"rho: must be a positive number, got {rho}")
    if link is not None and rho is not None:
        raise ValueError("rho: sets the link's bandwidth, so give either --rho or a sim: --link, not both")
    if clock in ("virtual", "as-built") and profile is None:
        from specter.models.checkpoint import read_config_dict, resolve_model_dir

        profile = default_profile(str(read_config_dict(resolve_model_dir(model)).get("model_type")))
    if profile is None:
        if rho is not None:
            raise ValueError("rho: needs a profile (--profile NAME) to say what a decode step costs")
        return Timing(clock, link or LinkConfig(kind="sim", bandwidth=1e9, latency=10e-6))
    real = PROFILES[profile]
    if clock in ("virtual", "as-built"):
        costs = model_costs(model, real)
        chosen = link or costs.link(rho)
        if clock == "virtual":
            return Timing(clock, chosen, costs.host(), costs, profile, costs.rho(chosen))
        built = replace(costs, launches=False)  # the launches are counted, not assumed
        return Timing(clock, chosen, costs.host(), built, profile, costs.rho(chosen), dispatch=DISPATCH[dispatch])
    from specter.generation import bytes_per_token, resident_step_s

    if step_s is None:
        step_s, per_token = resident_step_s(model, [0, 1, 2, 3])
    else:
        per_token = bytes_per_token(model)
    native = real.sim_bandwidth(step_s, per_token)
    costs = model_costs(model, real)
    host = costs.profile.sim_host(native, costs.expert_nbytes, costs.expert_flops)
    chosen = link or LinkConfig(kind="sim", bandwidth=per_token / (rho * step_s) if rho else native, latency=0.0)
    return Timing(clock, chosen, host, None, profile, per_token / chosen.bandwidth / step_s)
