"""Open a draft folder: a packed AWQ draft (``specter quantize``), or any full-precision checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from specter.models.checkpoint import read_config_dict, resolve_model_dir


def load_draft(  # type: ignore[no-untyped-def]
    draft_dir: str | Path, device: str | torch.device | None = None, mode: str = "auto", dtype: torch.dtype | None = None,
    step: str = "auto",
):
    """A ``DraftModel`` for a quantized draft folder (experts computed in ``mode``, in ``dtype``:
    default fp32 on a CPU), else a ``ResidentDraft``.

    ``auto`` times the modes on this machine, so which one runs (and, at near-ties, which draft
    token wins) can differ from run to run; the virtual clock's runs pass a fixed mode. ``step``: how a
    quantized draft's steps after the prompt run (``DraftModel.load``: CUDA graphs on a GPU by default).
    """
    folder = resolve_model_dir(draft_dir)
    if "quantization_config" in read_config_dict(folder):
        from specter.draft.runner import DraftModel

        return DraftModel.load(folder, device=device, mode=mode, dtype=dtype, step=step)
    from specter.draft.resident import ResidentDraft

    return ResidentDraft(folder, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))


def check_draft_matches(draft_config: dict, target_config: dict) -> None:
    """A draft must be of the target's family and share its vocabulary, layers, experts, hidden and expert sizes."""
    fields = ("model_type", "vocab_size", "num_hidden_layers", "hidden_size", "num_experts_per_tok", "intermediate_size",
              "moe_intermediate_size")
    experts = ("num_local_experts", "num_experts", "n_routed_experts")
    wrong = [f"{f}: draft {draft_config.get(f)} vs target {target_config.get(f)}"
             for f in fields + experts if draft_config.get(f) != target_config.get(f)]
    if wrong:
        raise ValueError("draft: does not match the target (" + "; ".join(wrong) + ")")
