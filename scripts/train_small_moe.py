#!/usr/bin/env python
"""Train the project's own small mixture-of-experts models on the Python standard library.

Two shipped models (see ``specter/assets/``):

* ``coarse`` -- Mixtral-style (``MixtralForCausalLM``): 8 experts, top-2.
* ``fine``   -- Qwen2-MoE-style (``Qwen2MoeForCausalLM``): 64 routed experts, top-4, one shared
  expert with its sigmoid gate. The fine-grained regime, where a short window of tokens does not
  touch every expert of a layer.

Everything is offline and deterministic: the corpus is the ``.py`` sources of this interpreter's
standard library (sorted by path, split by file), the tokenizer is a byte-level BPE trained on the
train split, seeds and data order are fixed and torch uses a fixed number of threads (``--threads``,
default 1: see ``DEFAULT_THREADS``).

The loss is next-token cross-entropy plus a *per-layer* Switch-style load-balance term
(``E * sum_e f_e * P_e`` computed for each layer separately, then averaged over layers); router
logits are captured with forward hooks on ``model.model.layers[i].mlp.gate``.

After training the model is cast to bf16, saved with ``save_pretrained``, reloaded from disk and
evaluated on the held-out split (loss, per-layer expert loads, distinct experts per token window).
A model card (``README.md``) and ``training_report.json`` are written next to the weights.

Examples::

    python scripts/train_small_moe.py --model fine --out specter/assets/moe-fine \
        --write-prompts specter/assets/prompts
    python scripts/train_small_moe.py --model coarse --out specter/assets/moe-coarse
    python scripts/train_small_moe.py --prompts-only                          # prompt files only
    python scripts/train_small_moe.py --model fine --out /tmp/fine --steps 20  # smoke run

The parts live beside this entry script: ``small_moe_corpus.py`` (corpus, tokenizer, prompt files),
``small_moe_model.py`` (recipes, configs, building and saving a model), ``small_moe_training.py``
(training loop and held-out evaluation) and ``small_moe_card.py`` (report and model card).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from small_moe_card import build_report, print_summary, render_card
from small_moe_corpus import load_data, write_prompt_files
from small_moe_model import RECIPES, Recipe, build_config, build_model, save_model
from small_moe_training import LOAD_HIGH, LOAD_LOW, evaluate, train
from transformers import AutoModelForCausalLM

# One torch thread by default: on a 2-core machine that something else also uses, two OpenMP threads
# stall at every parallel region behind a descheduled thread (measured 3-10x slower than one thread).
DEFAULT_THREADS = 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(RECIPES), help="which model to train")
    p.add_argument("--out", type=Path, help="output folder (weights, tokenizer, card, report)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads (part of the recipe)")
    p.add_argument("--balance-coef", type=float, default=None, help="per-layer balance loss coefficient")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument(
        "--write-prompts",
        type=Path,
        nargs="?",
        const=Path("specter/assets/prompts"),
        default=None,
        help="also (re)write heldout.jsonl and calibration.txt into this folder "
        "(default when given without a value: specter/assets/prompts)",
    )
    p.add_argument(
        "--prompts-only",
        action="store_true",
        help="train the tokenizer, write the prompt files (--write-prompts, default specter/assets/prompts) "
        "and the tokenizer (into --out if given), then stop without training a model",
    )
    args = p.parse_args(argv)
    if args.prompts_only:
        args.write_prompts = args.write_prompts or Path("specter/assets/prompts")
    elif args.model is None or args.out is None:
        p.error("--model and --out are required (unless --prompts-only)")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def recipe_for(args: argparse.Namespace) -> Recipe:
    """The model's recipe with command-line overrides applied."""
    base = RECIPES[args.model]
    overrides = {
        "steps": args.steps,
        "balance_coef": args.balance_coef,
        "lr": args.lr,
        "batch_size": args.batch_size,
    }
    return Recipe(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})


def set_determinism(seed: int, threads: int) -> None:
    """Fixed seeds and thread count."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Train, save, evaluate and document one model; non-zero exit if a quality gate fails."""
    args = parse_args(argv)
    set_determinism(args.seed, args.threads)
    wall0 = time.perf_counter()
    data = load_data()
    if args.write_prompts is not None:
        sizes = write_prompt_files(data.corpus, data.tok, args.write_prompts)
        print(f"prompt files written to {args.write_prompts}: {sizes}", flush=True)
    if args.prompts_only:
        if args.out is not None:
            data.tok.save_pretrained(args.out)
            print(f"tokenizer written to {args.out}", flush=True)
        return 0

    recipe = recipe_for(args)
    torch.manual_seed(args.seed)
    model = build_model(build_config(args.model, data.tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params:,} parameters; {recipe}", flush=True)
    stats = train(model, data.train_tokens, recipe, recipe.steps, args.seed)
    fp32_loss = evaluate(model, data.heldout_tokens, recipe.seq_len).loss

    save_model(model, data.tok, args.out)
    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    ev = evaluate(shipped, data.heldout_tokens, recipe.seq_len)
    report = build_report(args, recipe, shipped, data.corpus, data.counts(), stats, fp32_loss, ev, args.out)
    report["training"]["wall_seconds_total"] = round(time.perf_counter() - wall0, 1)
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (args.out / "README.md").write_text(render_card(report), encoding="utf-8")
    print_summary(ev, fp32_loss, report)
    if not ev.gates_ok():
        print(
            f"GATE FAILED: some expert load is outside {LOAD_LOW}x..{LOAD_HIGH}x uniform; "
            "raise --balance-coef and retrain",
            file=sys.stderr,
        )
        return 2
    print(f"saved to {args.out}; all gates passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
