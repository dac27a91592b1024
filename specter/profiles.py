"""Named link profiles: real machines running real models, reduced to one number, the offload
pressure ρ = (time to move one token's experts if all miss) / (time of one all-resident decode step).

On a CPU the simulated link's bandwidth is set from the small model's measured all-resident step
time so that its ρ equals the profile's. Derivations (sources and arithmetic) are in docs/profiles.md.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Profile:
    """A GPU + link + model triple.

    Attributes:
        link_bytes_per_s: pinned host→device bandwidth achieved in practice.
        expert_bytes: bytes of one routed expert of the real model (fp16/bf16).
        experts_per_token: routed experts one decode step touches (top-k × MoE layers).
        active_bytes: bytes one all-resident decode step reads (active parameters).
        hbm_bytes_per_s: the GPU's memory bandwidth; a decode step is bound by it.
        efficiency: fraction of peak HBM bandwidth a decode step achieves.
    """

    name: str
    description: str
    link_bytes_per_s: float
    expert_bytes: float
    experts_per_token: int
    active_bytes: float
    hbm_bytes_per_s: float
    efficiency: float = 0.7

    @property
    def miss_s(self) -> float:
        """Seconds to move one token's experts when all miss."""
        return self.experts_per_token * self.expert_bytes / self.link_bytes_per_s

    @property
    def step_s(self) -> float:
        """Seconds of one all-resident decode step."""
        return self.active_bytes / (self.hbm_bytes_per_s * self.efficiency)

    @property
    def rho(self) -> float:
        return self.miss_s / self.step_s

    def sim_bandwidth(self, cpu_step_s: float, bytes_per_token: float) -> float:
        """The simulated link's bandwidth giving the CPU model this profile's ρ."""
        return bytes_per_token / (self.rho * cpu_step_s)


_MIXTRAL_EXPERT = 3 * 4096 * 14336 * 2
_MIXTRAL_ACTIVE = 12.9e9 * 2
_DSV2L_EXPERT = 3 * 2048 * 1408 * 2
_DSV2L_ACTIVE = 2.4e9 * 2
_QWEN_EXPERT = 3 * 2048 * 1408 * 2
_QWEN_ACTIVE = 2.7e9 * 2

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("mixtral-pcie4", "Mixtral-8x7B fp16, A100-40GB (1.56 TB/s), PCIe 4.0 x16 25 GB/s",
                25 * GB, _MIXTRAL_EXPERT, 2 * 32, _MIXTRAL_ACTIVE, 1.555e12),
        Profile("mixtral-pcie5", "Mixtral-8x7B fp16, H100 PCIe (2.0 TB/s), PCIe 5.0 x16 50 GB/s",
                50 * GB, _MIXTRAL_EXPERT, 2 * 32, _MIXTRAL_ACTIVE, 2.0e12),
        Profile("dsv2lite-pcie4", "DeepSeek-V2-Lite bf16, A100-40GB, PCIe 4.0 x16 25 GB/s",
                25 * GB, _DSV2L_EXPERT, 6 * 26, _DSV2L_ACTIVE, 1.555e12),
        Profile("qwen2moe-pcie4", "Qwen1.5-MoE-A2.7B bf16, A100-40GB, PCIe 4.0 x16 25 GB/s",
                25 * GB, _QWEN_EXPERT, 4 * 24, _QWEN_ACTIVE, 1.555e12),
    )
}
