"""A small MoE model's run on record: ``training_report.json`` (every figure, machine-readable), the
model card ``README.md`` rendered from it, and the summary printed at the end of a run.

Used by ``scripts/train_small_moe.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from small_moe_corpus import EOT, EXCLUDED_DIRS, HELDOUT_EVERY, Corpus
from small_moe_model import Recipe, moe_shape
from small_moe_training import LOAD_HIGH, LOAD_LOW, EvalStats, TrainStats, mean
from transformers import PretrainedConfig, PreTrainedModel


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_report(
    args: argparse.Namespace,
    recipe: Recipe,
    model: PreTrainedModel,
    corpus: Corpus,
    token_counts: dict[str, int],
    stats: TrainStats,
    fp32_loss: float,
    ev: EvalStats,
    out: Path,
) -> dict:
    """All figures of the run, machine-readable."""
    num_experts, top_k = moe_shape(model.config)
    weights = out / "model.safetensors"
    ratios = ev.load_ratios()
    return {
        "model": args.model,
        "architecture": model.config.architectures[0] if model.config.architectures else type(model).__name__,
        "model_type": model.config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_experts": num_experts,
        "top_k": top_k,
        "config": _config_summary(model.config),
        "weights_file_bytes": weights.stat().st_size,
        "weights_sha256": sha256(weights),
        "data": {
            "corpus": "CPython standard library .py sources of the training interpreter",
            "python_version": platform.python_version(),
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "split": f"files sorted by relative path; file i held out when i % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1}",
            "train_files": len(corpus.train_files),
            "heldout_files": len(corpus.heldout_files),
            "train_tokens": token_counts["train"],
            "heldout_tokens": token_counts["heldout"],
            "vocab_size": model.config.vocab_size,
        },
        "training": {
            "command": command_line(),
            "seed": args.seed,
            "recipe": asdict(recipe),
            "steps": stats.steps,
            "tokens_seen": stats.tokens_seen,
            "epochs": stats.tokens_seen / token_counts["train"],
            "seconds": round(stats.seconds, 1),
            "final_train_loss": stats.final_train_loss,
            "final_balance_aux": stats.final_aux,
            "history": stats.history,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
        },
        "heldout": {
            "loss": ev.loss,
            "perplexity": ev.perplexity,
            "loss_fp32_before_bf16_cast": fp32_loss,
            "tokens_evaluated": ev.tokens,
            "note": "shipped bf16 weights, reloaded from disk, computed in fp32; non-overlapping 256-token windows",
        },
        "expert_load": {
            "bounds_vs_uniform": [LOAD_LOW, LOAD_HIGH],
            "per_layer_share": ev.loads,
            "per_layer_min_vs_uniform": [r[0] for r in ratios],
            "per_layer_max_vs_uniform": [r[1] for r in ratios],
            "within_bounds": ev.gates_ok(),
        },
        "distinct_experts_per_window": {
            str(w): {"per_layer": v, "mean": mean(v)} for w, v in ev.distinct_per_window.items()
        },
    }


def _config_summary(config: PretrainedConfig) -> dict:
    keys = [
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
        "max_position_embeddings", "intermediate_size", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_local_experts", "num_experts", "num_experts_per_tok",
        "norm_topk_prob", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ]  # fmt: skip
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


def command_line() -> str:
    """The command that is running, as it could be typed again."""
    return "python scripts/train_small_moe.py " + shlex.join(sys.argv[1:])


def render_card(report: dict) -> str:
    """The model card (markdown) for ``report``."""
    return "\n".join(_card_setup(report) + _card_results(report))


def _card_setup(report: dict) -> list[str]:
    """Card sections: config, data, training."""
    cfg, data, tr = report["config"], report["data"], report["training"]
    e, k = report["num_experts"], report["top_k"]
    return [
        f"# Specter small MoE: `{report['model']}` ({report['architecture']})",
        "",
        "A small mixture-of-experts language model of Python source code, trained by the Specter project",
        "itself so that routing is learned (random weights route with tiny margins and say nothing about",
        "expert prediction). It is the benchmark target; its AWQ-quantized copy is the draft.",
        "",
        "## Config",
        "",
        f"* `model_type` = `{report['model_type']}`, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV heads), vocab {cfg['vocab_size']}, "
        f"max positions {cfg['max_position_embeddings']}, tied embeddings: {cfg['tie_word_embeddings']}",
        f"* {e} routed experts per layer, top-{k}"
        + (
            f", expert size {cfg['moe_intermediate_size']}, one shared expert of size "
            f"{cfg['shared_expert_intermediate_size']} with a sigmoid gate, norm_topk_prob={cfg['norm_topk_prob']}"
            if report["model_type"] == "qwen2_moe"
            else f", expert size {cfg['intermediate_size']} (top-k weights renormalised, as Mixtral)"
        ),
        f"* parameters: {report['num_parameters']:,}; `model.safetensors`: {report['weights_file_bytes']:,} bytes "
        f"(bf16, per-expert keys as transformers writes them)",
        f"* eos = bos = pad = `{EOT}` (id {cfg['eos_token_id']})",
        "",
        "## Data",
        "",
        f"* {data['corpus']} (Python {data['python_version']}), found with `sysconfig.get_paths()['stdlib']`.",
        f"* Excluded folders: {', '.join('`' + d + '`' for d in data['excluded_dirs'])} "
        "(third-party code, test suites, generated codec tables, the documentation dump).",
        f"* Split by file: {data['split']}: {data['train_files']} train files ({data['train_tokens']:,} tokens), "
        f"{data['heldout_files']} held-out files ({data['heldout_tokens']:,} tokens).",
        f"* Tokenizer: byte-level BPE (`tokenizers`), vocab {data['vocab_size']}, trained on the train split; "
        f"every file is preceded by `{EOT}`. Decoding round-trips text exactly.",
        "",
        "## Training",
        "",
        f"* {tr['steps']} steps of batch {tr['recipe']['batch_size']} x {tr['recipe']['seq_len']} tokens "
        f"({tr['tokens_seen']:,} tokens, {tr['epochs']:.2f} epochs), {tr['seconds'] / 60:.1f} min on "
        f"{tr['threads']} CPU thread(s), fp32, seed {tr['seed']}; {tr['wall_seconds_total'] / 60:.1f} min wall "
        "clock for the whole command (tokenizer, training, evaluation).",
        "* Budget: ~15 min of one core of a shared 2-core CPU per model, so the model is undertrained: it has "
        "learned, balanced routing for expert-offloading studies, not the skill to write good code.",
        f"* AdamW (betas 0.9/0.95, weight decay {tr['recipe']['weight_decay']}), peak lr {tr['recipe']['lr']}, "
        f"{tr['recipe']['warmup']} warmup steps, cosine to {tr['recipe']['min_lr_ratio']} x peak, "
        f"grad clip {tr['recipe']['grad_clip']}.",
        f"* Loss: next-token cross-entropy + {tr['recipe']['balance_coef']} x per-layer load balance "
        "(`E * sum_e f_e * P_e` per layer from hooks on each router, averaged over layers).",
        f"* Final train loss (mean of last 50 steps): {tr['final_train_loss']:.4f}; balance term "
        f"{tr['final_balance_aux']:.4f} (1.0 = uniform).",
        "* Prompt files shared by both models (`../prompts/`, written by `--write-prompts`): `heldout.jsonl`, "
        "8-32-token prompts cut at line boundaries from `def`/`class` lines of the held-out files; "
        "`calibration.txt`, ~64 KiB of train-split excerpts for the AWQ draft's calibration.",
        "",
    ]


def _card_results(report: dict) -> list[str]:
    """Card sections: held-out results, expert loads, distinct experts per window, how to reproduce."""
    cfg, tr, ho, load = report["config"], report["training"], report["heldout"], report["expert_load"]
    e = report["num_experts"]
    lines = [
        "## Held-out results",
        "",
        f"* Loss {ho['loss']:.4f} nats/token, perplexity {ho['perplexity']:.2f} over {ho['tokens_evaluated']:,} "
        f"tokens ({ho['note']}); fp32 weights before the bf16 cast: {ho['loss_fp32_before_bf16_cast']:.4f}.",
        "",
        f"Expert load per layer: share of routed token-slots, as a multiple of uniform (1/{e}). "
        f"Gate: every expert within {load['bounds_vs_uniform'][0]}x..{load['bounds_vs_uniform'][1]}x "
        f"-- **{'passed' if load['within_bounds'] else 'FAILED'}**.",
        "",
        "| layer | min share | max share | min / uniform | max / uniform |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, shares in enumerate(load["per_layer_share"]):
        lines.append(
            f"| {i} | {min(shares):.4f} | {max(shares):.4f} | {load['per_layer_min_vs_uniform'][i]:.2f} | "
            f"{load['per_layer_max_vs_uniform'][i]:.2f} |"
        )
    lines += [
        "",
        f"Distinct experts touched per layer by a window of consecutive held-out tokens (of {e}; "
        "sliding windows, mean over positions):",
        "",
        "| window | " + " | ".join(f"layer {i}" for i in range(cfg["num_hidden_layers"])) + " | mean |",
        "| --- " * (cfg["num_hidden_layers"] + 2) + "|",
    ]
    for w, row in report["distinct_experts_per_window"].items():
        lines.append(
            f"| {w} | " + " | ".join(f"{v:.2f}" for v in row["per_layer"]) + f" | {row['mean']:.2f} |"
        )
    lines += [
        "",
        "## Reproduce",
        "",
        "```",
        tr["command"],
        "```",
        "",
        f"torch {tr['torch']}, transformers {tr['transformers']}. Full figures, including per-expert loads and "
        "the loss curve: `training_report.json`.",
        "",
    ]
    return lines


def print_summary(ev: EvalStats, fp32_loss: float, report: dict) -> None:
    """Held-out figures on stdout."""
    print(
        f"held-out loss {ev.loss:.4f} (ppl {ev.perplexity:.2f}); fp32 before cast {fp32_loss:.4f}", flush=True
    )
    for i, (lo, hi) in enumerate(ev.load_ratios()):
        print(f"layer {i}: expert load min {lo:.2f}x max {hi:.2f}x uniform", flush=True)
    for w, v in ev.distinct_per_window.items():
        print(f"window {w:2d}: {mean(v):.2f} distinct experts per layer", flush=True)
    print(
        f"weights {report['weights_file_bytes'] / 1e6:.1f} MB; wall {report['training']['wall_seconds_total'] / 60:.1f} min",
        flush=True,
    )
