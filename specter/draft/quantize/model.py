"""Make a draft folder from a target checkpoint: ``quantize_model``.

Steps: build the target the way Specter runs it (dense parts + one host store of experts),
record each expert's calibration inputs, then quantize layer by layer and write

* ``model.safetensors`` — every dense tensor copied unchanged (disk names, disk dtype) plus the
  packed experts (see ``specter.draft.format.pack``);
* ``config.json`` — the target's, plus ``quantization_config`` (compressed-tensors) and a small
  ``specter_draft`` block;
* tokenizer and generation files, copied;
* ``draft_report.json`` — method, group sizes, α and clipping per layer, RTN fallbacks, bytes,
  per-layer error (among it the experts' relative output error on the calibration inputs, for
  every method when calibration text is at hand).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specter.draft.format.pack import (
    AWQ_SCALE,
    PACK_QUANTIZED,
    SPECTER_AWQ,
    quantization_config,
    weight_tensors,
)
from specter.draft.quantize.awq import QuantExpert, QuantLayer, QuantSpec, quantize_layer
from specter.draft.quantize.calibrate import (
    NO_GENERATION,
    CalibrationRecorder,
    GenerationSpec,
    calibration_ids,
    record_expert_inputs,
)
from specter.experts.store import ExpertStore
from specter.models.loader import LoadedModel, build_dense, load_store

log = logging.getLogger(__name__)

REPORT = "draft_report.json"
# Bumped whenever the same flags would quantize differently (2: AWQ clipping, duo scales,
# expert-output loss weighted by the router; 3: the report records self-generated calibration,
# off by default, and with it off the weights equal version 2's); tools that cache drafts compare it.
# 4: AWQ's gate/up scale is one per layer, folded into the norm, and down's is folded into up
# (layout "folded", the default; "per-expert" is version 3's weights under the format "specter-awq").
QUANTIZER_VERSION = 4
_NOT_COPIED = {"config.json", "model.safetensors.index.json", REPORT}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def quantize_model(
    model_dir: str | Path,
    out_dir: str | Path,
    method: str = "awq",
    calib_text: str | Path | None = None,
    calib_tokens: int = 4096,
    group_size: int = 128,
    progress: bool = True,
    *,
    calib_ids: list[int] | None = None,
    cap: int = 512,
    grid: int = 20,
    seed: int = 0,
    duo: bool = True,
    clip_grid: int = 11,
    router_weighted: bool = True,
    generation: GenerationSpec | None = None,
    layout: str = "folded",
) -> dict[str, Any]:
    """Quantize a target's routed experts and write the draft folder.

    Args:
        model_dir: the target checkpoint folder.
        out_dir: the draft folder to write (created; must differ from ``model_dir``; checked before
            the work, replaced whole at the end: ``_write``).
        method: ``awq`` | ``rtn`` | ``int8``.
        calib_text: calibration text file (default: the packaged calibration.txt, if present).
        calib_tokens: calibration tokens used at most.
        group_size: requested int4 group size (falls back per input dim; reported).
        progress: log progress at INFO.
        calib_ids: calibration token ids (overrides ``calib_text``; tests, random models).
        cap: calibration tokens kept per expert.
        grid: α grid points for AWQ.
        seed: calibration sampling seed.
        duo, clip_grid, router_weighted: AWQ's search settings (``QuantSpec``).
        generation: self-generated calibration (the target's greedy continuations of windows of
            the calibration ids); default off (``NO_GENERATION``), ``GenerationSpec()`` for 32 windows.
        layout: where AWQ's scales live: ``folded`` (plain W4A16) or ``per-expert`` (``specter-awq``).

    Returns:
        The report also written to ``out_dir/draft_report.json``.
    """
    # Validate the flags before any loading.
    QuantSpec(method, group_size, grid, duo=duo, clip_grid=clip_grid, router_weighted=router_weighted, layout=layout)
    generation = generation if generation is not None else NO_GENERATION
    out = Path(out_dir).expanduser()
    check_out(out)
    loaded = build_dense(model_dir)
    if out.resolve() == loaded.checkpoint.dir.resolve():
        raise ValueError(f"out_dir {str(out)!r} is the model folder itself; choose another folder")
    spec = QuantSpec(
        method, group_size, grid, loaded.shape.dtype, duo=duo, clip_grid=clip_grid, router_weighted=router_weighted,
        layout=layout,
    )
    ids = calib_ids if calib_ids is not None else _calibration(loaded, method, calib_text, calib_tokens)
    if ids is not None:
        ids = ids[:calib_tokens]
    if method == "awq" and not ids:
        raise ValueError(
            "calib_text: AWQ needs calibration text (and a tokenizer in the model folder) or calib_ids"
        )
    used = {"gate_up": spec.group_for(loaded.shape.hidden), "down": spec.group_for(loaded.shape.intermediate)}
    if method != "int8" and any(g != group_size for g in used.values()):
        log.info("group size %d does not split every input dim; using %s", group_size, used)
    store = load_store(loaded, progress=progress)
    recorder = (
        record_expert_inputs(loaded, store, ids, cap=cap, seed=seed, progress=progress, generation=generation)
        if ids
        else None
    )
    tensors, layers = _quantize_layers(loaded, store, recorder, spec, progress)
    report = _report(loaded, spec, tensors, layers, len(ids) if ids else 0, cap)
    report["calibration"]["generated"] = _generated_summary(generation, recorder)
    _write(loaded, out, tensors, _config(loaded, spec, report), report)
    if progress:
        log.info(
            "draft written to %s: %.2f MB packed experts (%s)", out, report["packed_bytes"] / 1e6, method
        )
    return report


def _quantize_layers(
    loaded: LoadedModel, store: ExpertStore, recorder: CalibrationRecorder | None, spec: QuantSpec, progress: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every MoE layer's experts quantized: the draft's tensors (dense parts included, with the
    folded layout's input scales folded in) and a summary per layer (logged as each finishes
    when ``progress``)."""
    tensors = _dense_tensors(loaded)
    layers: dict[str, Any] = {}
    for layer in loaded.moe_layers:
        quant = _quantize_layer(loaded, store, recorder, layer, spec)
        for expert, q in enumerate(quant.experts):
            if quant.input_scale is not None:  # the scale lives in the dense tensors now
                q = replace(q, gate=replace(q.gate, awq_scale=None), up=replace(q.up, awq_scale=None))
            tensors.update(_expert_tensors(loaded, layer, expert, q))
        if quant.input_scale is not None:
            tensors.update(fold_input_scale(tensors, loaded, layer, quant.input_scale))
        layers[str(layer)] = _layer_summary(quant, store, layer)
        if progress:
            log.info("%s", _progress_line(layer, layers[str(layer)]))
    return tensors, layers


def fold_input_scale(
    tensors: dict[str, torch.Tensor], loaded: LoadedModel, layer: int, scale: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The dense tensors of one MoE layer with its gate/up input scale ``s`` folded in: the
    post-attention norm (weight, and bias where it has one) divided by ``s``, every other reader
    of that norm's output — the router, the shared expert's gate and up, its gate — multiplied by
    ``s`` along its input. The router's logits and the shared expert's output are unchanged (up to
    rounding to the disk dtype); the routed experts see ``x / s``, which ``Q(W s)`` expects."""
    norm = f"model.layers.{layer}.post_attention_layernorm"
    if f"{norm}.weight" not in tensors:
        raise ValueError(
            f"layout 'folded': {norm}.weight is not in the checkpoint, so layer {layer}'s AWQ scale has nowhere "
            "to go; quantize with layout 'per-expert'"
        )
    s = scale.float()
    out = {
        key: (tensors[key].float() / s).to(tensors[key].dtype)
        for key in (f"{norm}.weight", f"{norm}.bias")
        if key in tensors
    }
    prefix = f"model.layers.{layer}.{loaded.family.disk_moe}."
    down = loaded.family.proj_names[2]
    for key, t in tensors.items():
        if (key.startswith(prefix) and key.endswith(".weight") and t.dim() == 2
                and t.shape[1] == s.numel() and not loaded.family.is_expert_key(key)
                and f".{down}." not in key and ".down_proj." not in key):
            out[key] = (t.float() * s).to(t.dtype)
    return out


def _calibration(
    loaded: LoadedModel, method: str, calib_text: str | Path | None, calib_tokens: int
) -> list[int] | None:
    """Calibration ids. RTN and int8 need no activations: they record them (for the report's
    output error) only when the text and tokenizer are at hand, and never fail for lack of them."""
    try:
        return calibration_ids(loaded.checkpoint.dir, calib_text, calib_tokens)
    except ValueError:
        if method == "awq" or calib_text is not None:
            raise
        return None


def _generated_summary(generation: GenerationSpec, recorder: CalibrationRecorder | None) -> dict[str, Any]:
    sequences = recorder.generated if recorder is not None else []
    return {
        "windows": generation.windows,
        "prompt_tokens": generation.prompt_tokens,
        "new_tokens": generation.new_tokens,
        "sequences": len(sequences),
        "tokens": sum(len(s) for s in sequences),
    }


def _quantize_layer(
    loaded: LoadedModel, store: ExpertStore, recorder: CalibrationRecorder | None, layer: int, spec: QuantSpec
) -> QuantLayer:
    inputs = recorder.inputs(layer) if recorder is not None else [None] * loaded.num_experts
    module = loaded.experts_modules.get(layer)
    act = getattr(module, "act_fn", None) or F.silu
    weights = [store.shape.split(store.blob(layer, expert)) for expert in range(len(inputs))]
    records = [(rec.x, rec.h, rec.w) if rec is not None else None for rec in inputs]
    return quantize_layer(weights, records, spec, act)


def _expert_tensors(
    loaded: LoadedModel, layer: int, expert: int, quant: QuantExpert
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for key, weight in zip(
        loaded.family.expert_keys(layer, expert), (quant.gate, quant.up, quant.down), strict=True
    ):
        tensors.update(weight_tensors(key.removesuffix(".weight"), weight))
    return tensors


def _dense_tensors(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Every non-expert tensor of the target, unchanged (disk name and dtype)."""
    checkpoint, family = loaded.checkpoint, loaded.family
    return {k: checkpoint.read(k) for k in sorted(checkpoint.entries) if not family.is_expert_key(k)}


def _layer_summary(quant: QuantLayer, store: ExpertStore, layer: int) -> dict[str, Any]:
    """α and clipping statistics, fallbacks, token-weighted output MSE, the experts' relative
    output error and the weight error of one layer (and, folded, the layer's input scale)."""
    experts = quant.experts
    alphas_gu = [q.alpha_gate_up for q in experts if q.alpha_gate_up is not None]
    alphas_down = [q.alpha_down for q in experts if q.alpha_down is not None]
    tokens = sum(q.tokens for q in experts)
    ref = sum(q.out_ref for q in experts)
    summary: dict[str, Any] = {
        "alpha_gate_up": _stats(alphas_gu),
        "alpha_down": _stats(alphas_down),
        "duo_gate_up": sum(q.duo_gate_up for q in experts),
        "duo_down": sum(q.duo_down for q in experts),
        "clip_gate_up": _stats([q.clip_gate_up for q in experts if q.clip_gate_up is not None]),
        "clip_down": _stats([q.clip_down for q in experts if q.clip_down is not None]),
        "output_rel_err": (sum(q.out_err for q in experts) / ref) ** 0.5 if ref else None,
        "rtn_fallback": sum(q.fallback for q in experts),
        "calibration_tokens": tokens,
        "weight_rel_err": _weight_error(experts, store, layer),
        "input_scale": (
            {"alpha": quant.alpha, "duo": quant.duo} if quant.input_scale is not None else None
        ),
    }
    for name in ("mse_gate_up", "mse_down"):
        pairs = [(getattr(q, name), q.tokens) for q in experts if getattr(q, name) is not None]
        summary[name] = sum(m * t for m, t in pairs) / max(1, sum(t for _, t in pairs)) if pairs else None
    return summary


def _weight_error(experts: list[QuantExpert], store: ExpertStore, layer: int) -> float:
    """‖W − W_q‖ / ‖W‖ over all projections of the layer's experts."""
    err = ref = 0.0
    for expert, quant in enumerate(experts):
        gate_up, down = store.shape.split(store.blob(layer, expert))
        approx_gu, approx_down = quant.effective()
        for weight, approx in ((gate_up.float(), approx_gu), (down.float(), approx_down)):
            err += float((weight - approx).pow(2).sum())
            ref += float(weight.pow(2).sum())
    return (err / ref) ** 0.5 if ref else 0.0


def _progress_line(layer: int, summary: dict[str, Any]) -> str:
    parts = [f"layer {layer}:"]
    for name in ("alpha_gate_up", "alpha_down"):
        if summary[name] is not None:
            parts.append(f"{name} {summary[name]['mean']:.2f}")
    for name in ("mse_gate_up", "mse_down", "output_rel_err"):
        if summary[name] is not None:
            parts.append(f"{name} {summary[name]:.3g}")
    parts.append(f"weight rel err {summary['weight_rel_err']:.4f}, {summary['rtn_fallback']} RTN fallbacks")
    return " ".join(parts)


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _report(
    loaded: LoadedModel,
    spec: QuantSpec,
    tensors: dict[str, torch.Tensor],
    layers: dict[str, Any],
    tokens: int,
    cap: int,
) -> dict[str, Any]:
    packed = sum(
        t.numel() * t.element_size()
        for k, t in tensors.items()
        if ".weight_" in k and loaded.family.is_expert_key(k)
    )
    shape = loaded.shape
    return {
        "method": spec.method,
        "quantizer_version": QUANTIZER_VERSION,
        "model_type": loaded.family.model_type,
        "source": str(loaded.checkpoint.dir),
        "num_bits": spec.num_bits,
        "group_size_requested": spec.group_size,
        "group_sizes": {"gate_up": spec.group_for(shape.hidden), "down": spec.group_for(shape.intermediate)},
        "awq_grid": spec.grid if spec.method == "awq" else None,
        "awq_search": (
            {"duo": spec.duo, "clip_grid": spec.clip_grid, "clip_min": spec.clip_min,
             "router_weighted": spec.router_weighted, "layout": spec.layout}
            if spec.method == "awq" else None
        ),
        "calibration": {"tokens": tokens, "cap_per_expert": cap},
        "rtn_fallback_experts": sum(layer["rtn_fallback"] for layer in layers.values()),
        "output_rel_err": _mean([layer["output_rel_err"] for layer in layers.values()]),
        "awq_scaled_projections": sum(1 for k in tensors if k.endswith(AWQ_SCALE)),
        "packed_bytes": packed,
        "target_expert_bytes": len(loaded.moe_layers) * loaded.num_experts * shape.nbytes,
        "dense_bytes": loaded.dense_bytes,
        "layers": layers,
    }


def _config(loaded: LoadedModel, spec: QuantSpec, report: dict[str, Any]) -> dict[str, Any]:
    shape, family = loaded.shape, loaded.family
    config = dict(loaded.checkpoint.config)
    gate, up, down = family.proj_names
    base = r".*\." + re.escape(family.disk_moe) + r"\.experts\.\d+\."
    gu_group, down_group = report["group_sizes"]["gate_up"], report["group_sizes"]["down"]
    schemes = {
        f"{base}({gate}|{up})": (spec.num_bits, gu_group, shape.hidden),
        f"{base}{down}": (spec.num_bits, down_group, shape.intermediate),
    }
    ignore = [
        k.removesuffix(".weight")
        for k, e in loaded.checkpoint.entries.items()
        if k.endswith(".weight") and len(e.shape) == 2 and not family.is_expert_key(k)
    ]
    # Per-expert AWQ scales are a tensor stock readers do not know: such a draft gets a format name
    # they refuse (compressed-tensors: unknown format) instead of one they would misread.
    scaled = report["awq_scaled_projections"] > 0
    config["quantization_config"] = quantization_config(schemes, ignore, SPECTER_AWQ if scaled else PACK_QUANTIZED)
    config["specter_draft"] = {"method": spec.method, "layout": spec.layout if spec.method == "awq" else None,
                               "awq_scale_suffix": AWQ_SCALE if scaled else None, "format_version": 2}
    return config


def check_out(out: Path) -> None:
    """Refuse a draft folder that could not be written, before the work: a file in its place, or a
    nearest existing folder above it that this process cannot write into.

    Raises:
        ValueError: naming ``out`` and what is wrong.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} is a file; the draft is a folder")
    above = next(p for p in (out, *out.parents) if p.exists())
    if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir {str(out)!r}: {str(above)!r} is not a folder this process can write into")


def _write(
    loaded: LoadedModel,
    out: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    report: dict[str, Any],
) -> None:
    """Write the draft into a folder beside ``out``, then put it in ``out``'s place: a run that fails,
    is interrupted or killed while it writes leaves ``out`` as it was (an earlier draft there whole)
    and, but for a kill, no partial folder. What else ``out`` held stays, an earlier draft's weights
    and index aside. Between the two renames of the swap (microseconds) ``out`` is briefly absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
    try:
        save_file(
            {k: t.contiguous() for k, t in tensors.items()},
            str(staging / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in loaded.checkpoint.dir.iterdir():
            if path.is_file() and path.name not in _NOT_COPIED and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(path, staging / path.name)
        (staging / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if not out.exists():
            staging.rename(out)
            return
        for path in out.iterdir():  # kept: what is not the draft's own
            if (staging / path.name).exists() or path.name in _NOT_COPIED or path.name.endswith(_WEIGHT_SUFFIXES):
                continue
            if path.is_dir():
                shutil.copytree(path, staging / path.name, symlinks=True)
            else:
                shutil.copy2(path, staging / path.name, follow_symlinks=False)
        old = out.rename(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
