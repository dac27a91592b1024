"""The GPU bench's markdown report (``gpu_bench.md``) from its results: per shape, a table of every
setting's medians, each speculative row's rounds and K chooser under it, the resident step per MoE
layer (its slope over two depths) and the draft's step times.

Used by ``scripts/gpu_bench.py``, which runs the settings and keeps the figures.
"""

from __future__ import annotations

from typing import Any


def markdown(results: dict[str, Any]) -> str:
    """``gpu_bench.md``: per shape the settings' medians, the speculative rows' rounds and chooser, the
    draft's step."""
    lines = [f"# GPU bench ({results['device']}, torch {results['torch']}, {results['repeats']} repeats interleaved, "
             f"{results['new_tokens']} tokens, medians)", ""]
    kernels = results.get("kernels", {})
    if kernels.get("status") == "ok":
        lines += [f"Kernels in a CUDA graph (bf16, one row of {kernels['hidden']}): a small kernel "
                  f"{kernels['add_us']} µs (the as-built clock charges 5.5); an RMSNorm as transformers' module "
                  f"{kernels['rms_norm_module_us']} µs, as the engine's {kernels['rms_norm_engine_us']} µs (outputs "
                  f"differing from the module's: {kernels['rms_norm_engine_differs']:.2%}), in one `F.rms_norm` "
                  f"{kernels['rms_norm_fused_us']} µs ({kernels['rms_norm_fused_differs']:.2%}; fused kernel: "
                  f"{kernels['fused_rms_norm_cuda']})." + (
                      f" A one-token GEMV through a 14336 x 4096 bf16 matrix: {kernels['gemv_us']} µs, "
                      f"**{kernels['gemv_gbps']:.0f} GB/s** (the memory a resident step's weights stream at)."
                      if "gemv_gbps" in kernels else ""), ""]
    elif kernels:
        lines += [f"Kernels in a CUDA graph: {kernels['status']}.", ""]
    for shape, block in results["shapes"].items():
        if "error" in block:
            lines += [f"## {shape}: failed", "", f"    {block['error']}", ""]
            continue
        lines += [f"## {shape} ({block['layers']} layers, gain {block['gain']}, {block['dtype']})", "",
                  "| setting | TPOT ms | vs demand-lru | accepted / K | hit rate | link busy | reads / layer / token "
                  "| processes / in process | busy while a demand waits |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, row in block["summary"].items():
            ratio = f"{row['vs_demand_lru']:.2f}x" if "vs_demand_lru" in row else "-"
            accepted = f"{row['accepted']:.1f} / {row['window']:.1f}" if row.get("window") else "-"
            if row.get("plain_share"):
                accepted += f" ({row['plain_share']:.0%} plain)"
            lines.append(f"| {name} | {row['tpot_ms']:.2f} | {ratio} | {accepted} | {row.get('hit_rate', 1.0):.2f} "
                         f"| {row.get('link_busy', 0.0):.2f} | {row.get('reads_per_layer_token', 0.0):.2f} "
                         f"| {_figure(row, 'vs_in_process', '{:.2f}x')} | {_figure(row, 'busy_while_demanded', '{:.0%}')}"
                         f"{_figure(row, 'demand_issue_us', ' (issued after {:.0f} µs)', '')} |")
        lines += _chooser_lines(block["summary"])
        slope = block.get("resident_slope")
        if slope:
            (few, many), (few_ms, many_ms) = slope["layers"], slope["tpot_ms"]
            lines.append(f"Engine resident per MoE layer: **{slope['per_layer_ms']:.3f} ms** (the slope between its "
                         f"{few}- and {many}-layer steps, {few_ms:.3f} and {many_ms:.3f} ms a token); the step's own "
                         f"work {slope['step_own_ms']:.3f} ms; the {many}-layer step over its layers "
                         f"{slope['tpot_over_layers_ms']:.3f} ms." + _floor(slope, block, kernels))
        steps = block.get("draft_step", {})
        if steps:
            lines.append("Draft step (one token, ms; ratio to the engine's resident step): " + ", ".join(
                f"{mode} {row['ms']:.3f} ({row['vs_target_step']}x)" for mode, row in steps.items()))
        lines.append("")
    return "\n".join(lines)


def _floor(slope: dict[str, Any], block: dict[str, Any], kernels: dict[str, Any]) -> str:
    """Beside the slope: the layer's weights over the probe's GEMV bandwidth (what no engine goes below
    on this device) and what of the slope is above it."""
    if not block.get("layer_read_bytes") or not kernels.get("gemv_gbps"):
        return ""
    floor = block["layer_read_bytes"] / (kernels["gemv_gbps"] * 1e9) * 1e3
    return (f" Its weights ({block['layer_read_bytes'] / 1e6:.0f} MB a layer: attention, norms, router, the top-k "
            f"experts) at the probe's {kernels['gemv_gbps']:.0f} GB/s take {floor:.3f} ms; the rest of the slope, "
            f"{slope['per_layer_ms'] - floor:.3f} ms, is launches, kernel floors and the small kernels.")


def _chooser_lines(summary: dict[str, Any]) -> list[str]:
    """Per speculative row (last repeat): the K its rounds drafted, the rounds drafted ahead that
    stood, and for an adaptive one what its chooser had learnt."""
    lines = []
    for name, row in summary.items():
        if not any(int(k) > 0 for k in row.get("window_hist", {})):  # plain decoding: nothing to tell
            continue
        text = f"* {name}: rounds by K " + ", ".join(f"{k}: {n}" for k, n in row["window_hist"].items())
        if "ahead" in row:
            text += f"; drafted ahead {row['ahead']['kept']}/{row['ahead']['asked']} stood"
        chooser = row.get("chooser")
        if chooser and chooser.get("per_token_s"):
            best = min(chooser["per_token_s"].items(), key=lambda kv: kv[1])
            draft = "not measured" if chooser["draft_s"] is None else (
                f"{1e3 * chooser['draft_s']:.2f} ms a forward + {1e3 * chooser['round_s']:.2f} ms a round")
            text += (f"; chooser: alpha {chooser['alpha']:.2f}, draft {draft}, best K {best[0]} at "
                     f"{1e3 * best[1]:.2f} ms/token, plain {1e3 * chooser['per_token_s'].get('0', float('nan')):.2f}"
                     f", {chooser.get('cold', 0)} rounds cold (a step shape's first run or capture: not measured)")
        lines.append(text)
    return ([""] + lines + [""] if lines else [])


def _figure(row: dict[str, Any], key: str, form: str, missing: str = "-") -> str:
    return form.format(row[key]) if key in row else missing
