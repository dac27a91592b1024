"""A full-precision draft: any transformers checkpoint with all experts resident.

Used where the draft must equal the target (tests: draft == target ⇒ every token accepted) and
as the unquantized reference for the fidelity study.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specter.models.routing import DraftCompute, Routing, RoutingRecorder, read_routing


class ResidentDraft:
    """A transformers model used as a draft: logits plus each step's routing."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), experts_implementation="eager", dtype=dtype)
        self.model.to(device).eval()  # type: ignore[arg-type]
        self.device = torch.device(device)
        self.recorder = RoutingRecorder(self.model)
        self.last_routing: Routing = {}  # the latest forward's, on the host (one read per forward)
        self.last_compute: DraftCompute = {}  # every layer's experts in full precision

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=input_ids.to(self.device), cache=cache, use_cache=True)
        self.last_routing, _ = read_routing(self.recorder.last)
        self.last_compute = dict.fromkeys(self.last_routing, "bf16")
        return out.logits.float()
