"""Named link profiles: real machines running real models, reduced to one number, the offload
pressure ρ = (time to move one token's experts if all miss) / (time of one all-resident decode step).

On a CPU the simulated link's bandwidth is set from the small model's measured all-resident step
time so that its ρ equals the profile's. A profile also names the server's host CPU, which can
compute a late expert from host memory instead of moving it; its simulated rate keeps the real
ratio η = (host compute of one expert) / (transfer of one expert). Derivations (sources and
arithmetic) are in docs/profiles.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specter.config import HostConfig

GB = 1e9
TFLOPS = 1e12

# The GPU side of the cost model (docs/profiles.md derives each figure).
LAUNCH_S = 3.5e-6  # one kernel launched back to back after another, at batch 1 (no CUDA graph)
DENSE_KERNELS = 12  # per layer: norms, q/k/v/o projections, rotary, attention, router, top-k, residuals
EXPERT_KERNELS = 5  # per routed expert: gather, gate/up GEMV, activation×up, down GEMV, weighted add
W4_TIME_RATIO = 0.73  # a W4A16 MoE expert GEMV at one token over its bf16 time (flashinfer PR 5301)
INT4_BYTES = 4.25 / 16  # an int4 expert's bytes over its bf16 ones: the codes, a 16-bit scale and zero per 128
# One draft expert's time over its bf16 read's, by how the draft computes it (``DraftModel.last_compute``;
# the ideal engine's draft is ``int4``, the as-built clock charges the path the draft took):
DRAFT_EXPERT_READS = {
    "int4": W4_TIME_RATIO,  # the int4 kernel on the expert's resident codes
    "int4-gathered": W4_TIME_RATIO + 2 * INT4_BYTES,  # its codes copied to the pair's buffer (read, write), then the kernel
    "bf16": 1.0,  # a bf16 copy held on the device (dequant-cache, a full-precision draft)
    "dequant": INT4_BYTES + 2.0,  # unpacked at each call: the codes read, a bf16 copy written, then read
}
FLOPS_EFFICIENCY = 0.5  # fraction of the GPU's bf16 tensor peak a prefill GEMM reaches


@dataclass(frozen=True)
class Host:
    """A server's host CPU computing one expert: memory-bound at a few tokens.

    Attributes:
        bytes_per_s: DRAM bandwidth a batch-1 expert GEMV achieves (peak × efficiency).
        flops_per_s: fp32 throughput an expert GEMM achieves once it is compute-bound.
        latency: per-expert fixed cost (activations over PCIe both ways, synchronisation, dispatch).
    """

    name: str
    bytes_per_s: float
    flops_per_s: float
    latency: float = 50e-6

    def expert_s(self, expert_bytes: float, flops_per_token: float, tokens: int = 1) -> float:
        return HostConfig(self.bytes_per_s, self.flops_per_s, self.latency).expert_s(expert_bytes, flops_per_token, tokens)


# AMD EPYC 7763 (A100 servers): 8 × DDR4-3200 = 204.8 GB/s peak, 0.5 achieved by a bf16 GEMV;
# 64 cores × 2.45 GHz × 32 fp32 flops/cycle (AVX2, 2 FMA pipes) = 5.0 TFLOPS, 0.3 achieved.
EPYC_7763 = Host("AMD EPYC 7763, 8x DDR4-3200", 0.5 * 204.8 * GB, 0.3 * 5.0 * TFLOPS)
# Intel Xeon Platinum 8480+ (H100 servers): 8 × DDR5-4800 = 307.2 GB/s peak, 0.5 achieved;
# 56 cores × 2.0 GHz × 64 fp32 flops/cycle (AVX-512, 2 FMA pipes) = 7.2 TFLOPS, 0.3 achieved.
XEON_8480 = Host("Intel Xeon Platinum 8480+, 8x DDR5-4800", 0.5 * 307.2 * GB, 0.3 * 7.2 * TFLOPS)


@dataclass(frozen=True)
class Profile:
    """A GPU + link + model triple, and the cost model of the model's compute on that GPU.

    Attributes:
        link_bytes_per_s: pinned host→device bandwidth achieved in practice.
        expert_bytes: bytes of one routed expert of the real model (fp16/bf16).
        experts_per_token: routed experts one decode step touches (top-k × MoE layers).
        active_bytes: bytes one all-resident decode step reads (active parameters).
        hbm_bytes_per_s: the GPU's memory bandwidth; a decode step is bound by it.
        efficiency: fraction of peak HBM bandwidth a decode step achieves.
        budget: the device's expert slots as a fraction of the routed experts — what the GPU holds
            after the dense parts, the draft and the KV cache (docs/profiles.md); the benchmark's
            default budget for this profile.
        layers: the real model's MoE layers.
        kv_bytes: KV-cache bytes per position, all layers (attention reads them every pass).
        gpu_flops: the GPU's dense bf16 tensor peak (a prefill's roofline).
        model_type: the transformers family the profile's model belongs to.
    """

    name: str
    description: str
    link_bytes_per_s: float
    expert_bytes: float
    experts_per_token: int
    active_bytes: float
    hbm_bytes_per_s: float
    budget: float
    layers: int
    kv_bytes: float
    gpu_flops: float
    model_type: str
    host: Host = EPYC_7763
    efficiency: float = 0.7
    bytes_per_param: int = 2

    @property
    def miss_s(self) -> float:
        """Seconds to move one token's experts when all miss."""
        return self.experts_per_token * self.expert_bytes / self.link_bytes_per_s

    @property
    def step_s(self) -> float:
        """Seconds of one all-resident decode step: its dense part and its experts."""
        return self.layers * self.dense_layer_s(1, 0) + self.experts_per_token * self.expert_s(1)

    @property
    def draft_step_s(self) -> float:
        """Seconds of one decode step of the int4 draft (dense parts as the target's, experts W4A16)."""
        return self.layers * self.dense_layer_s(1, 0) + self.experts_per_token * self.expert_s(1, int4=True)

    @property
    def draft_ratio(self) -> float:
        """The draft's decode step over the target's all-resident one."""
        return self.draft_step_s / self.step_s

    @property
    def dense_bytes(self) -> float:
        """Bytes of everything a decode step reads but the routed experts (attention, shared
        experts, embeddings and head, norms, routers)."""
        return self.active_bytes - self.experts_per_token * self.expert_bytes

    def dense_layer_s(self, positions: int, context: int, launch_s: float = LAUNCH_S) -> float:
        """One layer's dense part over ``positions`` positions after ``context`` cached ones: its
        weights and KV cache over HBM (or its flops, for a long prefill), plus its launches (the
        ideal engine's fixed count at ``launch_s`` each; 0 where dispatch is counted instead)."""
        hbm = self.hbm_bytes_per_s * self.efficiency
        read = (self.dense_bytes + (context + positions) * self.kv_bytes) / self.layers / hbm
        flops = 2 * self.dense_bytes / self.bytes_per_param / self.layers * positions
        return max(read, flops / (self.gpu_flops * FLOPS_EFFICIENCY)) + DENSE_KERNELS * launch_s

    def expert_s(self, tokens: int, int4: bool = False, launch_s: float = LAUNCH_S) -> float:
        """One routed expert on ``tokens`` tokens from device memory (``int4``: the draft's W4A16),
        plus its launches as in ``dense_layer_s``."""
        return self.draft_expert_s(tokens, "int4", launch_s) if int4 else self._expert_s(tokens, 1.0, launch_s)

    def draft_expert_s(self, tokens: int, compute: str, launch_s: float = LAUNCH_S) -> float:
        """One draft expert on ``tokens`` tokens computed as ``compute`` says (``DRAFT_EXPERT_READS``)."""
        if compute not in DRAFT_EXPERT_READS:
            raise ValueError(f"draft compute: expected one of {', '.join(DRAFT_EXPERT_READS)}, got {compute!r}")
        return self._expert_s(tokens, DRAFT_EXPERT_READS[compute], launch_s)

    def _expert_s(self, tokens: int, reads: float, launch_s: float) -> float:
        read = self.expert_bytes / (self.hbm_bytes_per_s * self.efficiency) * reads
        flops = self.expert_flops * tokens / (self.gpu_flops * FLOPS_EFFICIENCY)
        return max(read, flops) + EXPERT_KERNELS * launch_s

    @property
    def rho(self) -> float:
        return self.miss_s / self.step_s

    def sim_bandwidth(self, cpu_step_s: float, bytes_per_token: float) -> float:
        """The simulated link's bandwidth giving the CPU model this profile's ρ."""
        return bytes_per_token / (self.rho * cpu_step_s)

    @property
    def expert_flops(self) -> float:
        """Flops of one expert on one token (a multiply-add per weight)."""
        return 2 * self.expert_bytes / self.bytes_per_param

    @property
    def link_expert_s(self) -> float:
        """Seconds to move one expert."""
        return self.expert_bytes / self.link_bytes_per_s

    def host_expert_s(self, tokens: int = 1) -> float:
        """Seconds for the host CPU to compute one expert on ``tokens`` tokens."""
        return self.host.expert_s(self.expert_bytes, self.expert_flops, tokens)

    @property
    def eta(self) -> float:
        """Host compute of one expert (one token) over its transfer: < 1 means computing is cheaper."""
        return self.host_expert_s(1) / self.link_expert_s

    @property
    def rho_host(self) -> float:
        """A fully-missed token computed on the host, in all-resident decode steps."""
        return self.experts_per_token * self.host_expert_s(1) / self.step_s

    def scaled_host(self, expert_bytes: float, expert_flops: float, sigma: float) -> HostConfig:
        """The host for a CPU model whose experts (``expert_bytes``, ``expert_flops`` per token)
        each stand for σ of the real model's: every real per-expert time × σ."""
        return HostConfig(
            bytes_per_s=self.host.bytes_per_s * expert_bytes / self.expert_bytes / sigma,
            flops_per_s=self.host.flops_per_s * expert_flops / self.expert_flops / sigma,
            latency=self.host.latency * sigma,
        )

    def sim_host(self, link_bytes_per_s: float, expert_bytes: float, expert_flops: float) -> HostConfig:
        """The simulated host for a CPU model whose experts (``expert_bytes``, ``expert_flops`` per
        token) move over a simulated link of ``link_bytes_per_s``.

        Every real per-expert time is scaled by σ = (simulated transfer of the CPU model's expert) /
        (real transfer of the real expert), the factor the link's ρ already applies, so host compute
        and transfer keep the real machine's ratio at every token count.
        """
        return self.scaled_host(expert_bytes, expert_flops, (expert_bytes / link_bytes_per_s) / self.link_expert_s)

    def host_relative_to(self, link_bytes_per_s: float, latency: float = 0.0) -> HostConfig:
        """A host for any link when no profile is given: this profile's host rates per link rate."""
        ratio = link_bytes_per_s / self.link_bytes_per_s
        return HostConfig(self.host.bytes_per_s * ratio, self.host.flops_per_s * ratio, latency)


_MIXTRAL_EXPERT = 3 * 4096 * 14336 * 2
_MIXTRAL_ACTIVE = 12.9e9 * 2
_DSV2L_EXPERT = 3 * 2048 * 1408 * 2
_DSV2L_ACTIVE = 2.4e9 * 2
_QWEN_EXPERT = 3 * 2048 * 1408 * 2
_QWEN_ACTIVE = 2.7e9 * 2
# KV cache per position, all layers, bf16: Mixtral 32 layers × 8 KV heads × 128 × (K, V);
# DeepSeek-V2-Lite (MLA) 27 layers × (512 latent + 64 rotary); Qwen1.5-MoE 24 layers × 16 heads × 128 × (K, V).
_MIXTRAL_KV = 32 * 8 * 128 * 2 * 2
_DSV2L_KV = 27 * (512 + 64) * 2
_QWEN_KV = 24 * 16 * 128 * 2 * 2
A100_FLOPS = 312 * TFLOPS  # dense bf16 tensor peak (NVIDIA A100 data sheet)
H200_FLOPS = 989 * TFLOPS  # dense bf16 tensor peak (NVIDIA H200 data sheet)
H200_HBM = 4.8e12  # bytes/s (NVIDIA H200 data sheet)
H200_PINNED = 55 * GB  # pinned host→device, measured on the lent H200 (2026-12-04, PCIe 5.0)
# The lent H200's host (16 cores): one fp32 expert took 0.21 ms at Qwen1.5-MoE's shape and 5.3 ms at
# Mixtral's (scripts/gpu_check.py, 2026-12-04); as bf16 bytes over the time less the 50 us latency.
H200_HOST = Host("the lent H200 machine's 16 cores", 0.5 * (_QWEN_EXPERT / 0.16e-3 + _MIXTRAL_EXPERT / 5.25e-3),
                 0.3 * 2.0 * TFLOPS)
H100_PCIE_FLOPS = 756 * TFLOPS  # dense bf16 tensor peak (NVIDIA H100 PCIe data sheet)
H100_SXM_FLOPS = 989 * TFLOPS  # dense bf16 tensor peak (NVIDIA H100 SXM data sheet)
H100_SXM_HBM = 3.35e12  # bytes/s, HBM3 (NVIDIA H100 SXM data sheet)

# The lent H200 (docs/benchmark.md's validation of the as-built clock): its measured link, a 25 % budget
# as the end-to-end runs there used.
_LENT_H200 = (
    Profile("qwen2moe-h200", "Qwen1.5-MoE-A2.7B bf16, H200 (4.8 TB/s), PCIe 5.0 x16 55 GB/s measured",
            H200_PINNED, _QWEN_EXPERT, 4 * 24, _QWEN_ACTIVE, H200_HBM, 0.25,
            24, _QWEN_KV, H200_FLOPS, "qwen2_moe", H200_HOST),
    Profile("mixtral-h200", "Mixtral-8x7B bf16, H200 (4.8 TB/s), PCIe 5.0 x16 55 GB/s measured",
            H200_PINNED, _MIXTRAL_EXPERT, 2 * 32, _MIXTRAL_ACTIVE, H200_HBM, 0.25,
            32, _MIXTRAL_KV, H200_FLOPS, "mixtral", H200_HOST),
)


def _on_h100(h200: Profile) -> Profile:
    """A lent H200 profile on the device tool's other kind, "one NVIDIA H100 GPU (about 78 GiB)", taken
    as the SXM part (its PCIe part has 2.0 TB/s: mixtral-pcie5): its memory and compute; the link and the
    host the H200 machine's, assumed (both kinds are PCIe 5.0 machines with 16 cores; never run here)."""
    model = h200.description.split(", H200")[0]
    return replace(h200, name=h200.name.replace("-h200", "-h100"), hbm_bytes_per_s=H100_SXM_HBM,
                   gpu_flops=H100_SXM_FLOPS,
                   description=f"{model}, H100 SXM (3.35 TB/s), PCIe 5.0 x16 55 GB/s as the H200's")


# Budgets. DeepSeek-V2-Lite and Qwen1.5-MoE: the published evaluation's main ("high") cases on
# the A100-40GB, 16 of 64 and 15 of 60 experts resident per layer. Mixtral: what the GPU holds
# after the dense parts (1.6 B params, 3.3 GB), the int4 draft's experts (256 × 91 MB = 23.3 GB)
# and ~2 GB of KV cache and workspace, in 352 MB experts: A100-40GB 11.4 GB → 32 of 256;
# H100-80GB 51.4 GB → 146 of 256.
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("mixtral-pcie4", "Mixtral-8x7B fp16, A100-40GB (1.56 TB/s), PCIe 4.0 x16 25 GB/s",
                25 * GB, _MIXTRAL_EXPERT, 2 * 32, _MIXTRAL_ACTIVE, 1.555e12, 32 / 256,
                32, _MIXTRAL_KV, A100_FLOPS, "mixtral"),
        Profile("mixtral-pcie5", "Mixtral-8x7B fp16, H100 PCIe (2.0 TB/s), PCIe 5.0 x16 50 GB/s",
                50 * GB, _MIXTRAL_EXPERT, 2 * 32, _MIXTRAL_ACTIVE, 2.0e12, 146 / 256,
                32, _MIXTRAL_KV, H100_PCIE_FLOPS, "mixtral", XEON_8480),
        Profile("dsv2lite-pcie4", "DeepSeek-V2-Lite bf16, A100-40GB, PCIe 4.0 x16 25 GB/s",
                25 * GB, _DSV2L_EXPERT, 6 * 26, _DSV2L_ACTIVE, 1.555e12, 16 / 64,
                26, _DSV2L_KV, A100_FLOPS, "deepseek_v2"),
        Profile("qwen2moe-pcie4", "Qwen1.5-MoE-A2.7B bf16, A100-40GB, PCIe 4.0 x16 25 GB/s",
                25 * GB, _QWEN_EXPERT, 4 * 24, _QWEN_ACTIVE, 1.555e12, 15 / 60,
                24, _QWEN_KV, A100_FLOPS, "qwen2_moe"),
        *_LENT_H200,
        *(_on_h100(p) for p in _LENT_H200),
    )
}

DEFAULT_HOST_PROFILE = "mixtral-pcie4"  # whose host-to-link ratio a plain simulated link gets


def default_profile(model_type: str) -> str:
    """The profile whose real model is of ``model_type``'s family (qwen2moe-pcie4 for any other)."""
    return next((p.name for p in PROFILES.values() if p.model_type == model_type), "qwen2moe-pcie4")


def simulated_host(bandwidth: float, latency: float, expert_bytes: int, expert_flops: int,
                   profile: str | None = None) -> HostConfig:
    """The host beside a simulated link of ``bandwidth`` bytes/s: a named profile's, scaled like its
    link (``Profile.sim_host``), or with none the default profile's rates relative to the link's."""
    if profile is not None:
        return PROFILES[profile].sim_host(bandwidth, expert_bytes, expert_flops)
    return PROFILES[DEFAULT_HOST_PROFILE].host_relative_to(bandwidth, latency)
