#!/usr/bin/env python
"""Draft fidelity study: RTN int4, AWQ int4 and int8 drafts against their target.

For each model and method: quantize the target's routed experts into a draft, then on held-out
prompts (the target's own greedy continuation, teacher-forced through both models) measure exact
top-k set agreement per MoE layer, routing recall over windows of K positions, next-token
agreement, and the mean accepted length of greedy speculation through ``specter.engine.Engine``.
Prints one table per model, writes JSON and a markdown report (the tables and the report are
``fidelity_doc.py``, beside this script), and checks the issue's rule
"AWQ must be no worse than RTN on any measure and better on at least one".

    python scripts/fidelity.py --model specter/assets/moe-fine --model specter/assets/moe-coarse \\
        --num-prompts 20 --new-tokens 64 --out docs/fidelity.md
    python scripts/fidelity.py --model /tmp/tiny --random-prompts 4 --methods int8,rtn   # no tokenizer
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from specter.eval.fidelity import (
    WINDOWS,
    logit_error_on_text,
    measure_acceptance,
    measure_teacher_forced,
    merge,
    target_pass,
)
from specter.eval.fidelity_report import (
    awq_verdict,
    markdown_table,
    paired_bootstrap,
    row_measures,
    verdict_line,
)
from specter.models.greedy import greedy_continuation

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fidelity_doc.py, however this is loaded
from fidelity_doc import LAYOUT_NAMES, delta_table, error_table, layout_rows, write_doc  # noqa: E402

# fp: the target itself as its own draft (a ceiling check); awq-expert: AWQ in the per-expert layout
# (a gate/up scale per expert, format specter-awq), against the default folded one (docs/draft.md).
METHODS = ("rtn", "awq", "awq-expert", "int8", "fp")
LAYOUT = {"awq": "folded", "awq-expert": "per-expert"}
_T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="target checkpoint folder (repeatable)")
    p.add_argument("--prompts", help="JSONL of {'prompt': text} (default: the shipped held-out set)")
    p.add_argument("--prompt-ids", help="JSONL of token-id lists (or {'ids': [...]}) for tokenizer-less models")
    p.add_argument("--random-prompts", type=int, default=0, metavar="N",
                   help="N seeded random prompts of --prompt-len token ids instead of text prompts")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per random prompt")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--methods", default="rtn,awq,int8", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="recall windows K")
    p.add_argument("--spec-windows", default="4,8", help="speculation windows K for mean accepted length")
    p.add_argument("--calib-tokens", type=int, default=4096, help="AWQ calibration tokens")
    p.add_argument("--calib-generate", type=int, default=0, metavar="N",
                   help="calibrate also on the target's greedy continuations of N windows of the calibration "
                        "text (0: text only)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="seed of random prompts and random calibration ids")
    p.add_argument("--work", help="folder that keeps the drafts (reused when newer than the model)")
    p.add_argument("--out", default="docs/fidelity.md", help="markdown report ('' for none)")
    p.add_argument("--json", default="runs/fidelity.json", help="JSON results ('' for none)")
    p.add_argument("--draft-mode", default="dequant-cache",
                   choices=("dequant-cache", "int4-kernel", "dequant-on-the-fly", "auto"),
                   help="draft compute mode (fixed by default: 'auto' picks by timing, so numerics could vary)")
    p.add_argument("--bootstrap", type=int, default=1000, help="paired bootstrap resamples for the verdict")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("-v", "--verbose", action="store_true", help="the quantizer's progress at INFO")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    try:
        args.windows = tuple(int(k) for k in args.windows.split(","))
        args.spec_windows = [int(k) for k in args.spec_windows.split(",") if k.strip()]
    except ValueError:
        p.error("--windows/--spec-windows: comma lists of integers")
    if any(k < 1 for k in args.windows) or any(k < 1 or k > 64 for k in args.spec_windows):
        p.error("--windows: K >= 1; --spec-windows: 1 <= K <= 64")
    if args.num_prompts < 1 or args.new_tokens < 2 or args.prompt_len < 1 or args.calib_generate < 0:
        p.error("--num-prompts >= 1, --new-tokens >= 2, --prompt-len >= 1, --calib-generate >= 0")
    for model in args.model:
        if not (Path(model) / "config.json").is_file():
            p.error(f"--model: {model} has no config.json")
    return args


# -- inputs --------------------------------------------------------------------------------------
def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def held_out_prompts(model_dir: Path, vocab: int, args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """Prompt token ids and a description of where they came from."""
    if args.random_prompts:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab, (args.random_prompts, args.prompt_len), generator=gen).tolist()
        return ids, f"{args.random_prompts} random prompts of {args.prompt_len} ids (seed {args.seed})"
    if args.prompt_ids:
        rows = [json.loads(line) for line in Path(args.prompt_ids).read_text().splitlines() if line.strip()]
        ids = [row["ids"] if isinstance(row, dict) else row for row in rows][: args.num_prompts]
        if not ids or any(not r or not all(isinstance(t, int) and 0 <= t < vocab for t in r) for r in ids):
            raise SystemExit(f"--prompt-ids: {args.prompt_ids} needs non-empty lists of ids in [0, {vocab})")
        return ids, f"{len(ids)} prompts from {args.prompt_ids}"
    if not has_tokenizer(model_dir):
        raise SystemExit(f"--model: {model_dir} has no tokenizer; give --random-prompts N or --prompt-ids FILE")
    from specter.eval.prompts import HELDOUT, load_prompts

    ids = load_prompts(model_dir, args.prompts, args.num_prompts)
    source = Path(args.prompts or HELDOUT).resolve()
    shown = source.relative_to(Path.cwd()) if source.is_relative_to(Path.cwd()) else source
    return ids, f"{len(ids)} held-out prompts from `{shown}`"


def calibration(model_dir: Path, vocab: int, args: argparse.Namespace) -> list[int] | None:
    """None: the quantizer's default text; random seeded ids for a tokenizer-less model."""
    if has_tokenizer(model_dir):
        return None
    gen = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, vocab, (args.calib_tokens,), generator=gen).tolist()


def calibration_text(model_dir: Path, vocab: int, args: argparse.Namespace) -> list[int]:
    """The calibration token ids AWQ sees (the quantizer's default text, or the seeded random ids)."""
    ids = calibration(model_dir, vocab, args)
    if ids is not None:
        return ids
    from specter.draft.quantize.calibrate import calibration_ids

    return calibration_ids(model_dir, None, args.calib_tokens) or []


def make_draft(model_dir: Path, method: str, work: Path, args: argparse.Namespace, vocab: int) -> tuple[Any, dict]:
    """The draft of ``method`` (quantized into ``work/<model>-<method>`` unless a newer one is there)."""
    if method == "fp":
        from specter.draft.resident import ResidentDraft

        return ResidentDraft(model_dir), {"method": "fp"}
    from specter.draft.quantize.calibrate import GenerationSpec
    from specter.draft.quantize.model import QUANTIZER_VERSION, REPORT, quantize_model
    from specter.draft.runner import DraftModel

    def load_draft(folder: Path) -> DraftModel:
        # bf16, as a GPU runs it: the measures are of the draft the device would compute
        return DraftModel.load(folder, device="cpu", mode=args.draft_mode, dtype=torch.bfloat16)

    out = work / f"{model_dir.name}-{method}"
    report_file = out / REPORT
    weights = max(f.stat().st_mtime for f in model_dir.glob("*.safetensors"))
    if report_file.is_file() and report_file.stat().st_mtime > weights:
        report = json.loads(report_file.read_text())
        windows = report.get("calibration", {}).get("generated", {}).get("windows")
        layout = (report.get("awq_search") or {}).get("layout")
        if (report.get("method"), report.get("quantizer_version"), windows, layout) == (
            method.removesuffix("-expert"), QUANTIZER_VERSION, args.calib_generate, LAYOUT.get(method)
        ):
            say(f"  {method}: reusing the draft in {out}")
            return load_draft(out), report
    say(f"  {method}: quantizing into {out}")
    report = quantize_model(
        model_dir, out, method=method.removesuffix("-expert"), calib_tokens=args.calib_tokens,
        group_size=args.group_size, progress=args.verbose,
        calib_ids=calibration(model_dir, vocab, args) if method in LAYOUT else None,
        generation=GenerationSpec(windows=args.calib_generate), layout=LAYOUT.get(method, "folded"),
    )
    return load_draft(out), report


def _report_brief(report: dict) -> dict:
    keys = ("method", "bits", "group_sizes", "calibration", "rtn_fallback_experts", "awq_scaled_projections",
            "packed_bytes", "target_expert_bytes", "output_rel_err", "awq_search")
    return {k: report[k] for k in keys if k in report}


# -- one model -----------------------------------------------------------------------------------
def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint is stored in (its config.json), not the dtype it is computed in."""
    config = json.loads((model_dir / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "?").removeprefix("torch.")


def study(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from specter.config import LinkConfig, SlotConfig
    from specter.models.routing import RoutingRecorder
    from specter.target import OffloadedTarget

    say(f"{model_dir}: loading the target (fp32, as Specter computes it on a CPU)")
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), experts_implementation="eager", dtype=torch.float32
    ).eval()
    config = model.config
    vocab = int(config.vocab_size)
    num_experts = next(int(getattr(config, a)) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                       if getattr(config, a, None))
    recorder = RoutingRecorder(model)
    prompts, source = held_out_prompts(model_dir, vocab, args)
    calib_text = calibration_text(model_dir, vocab, args)
    say(f"{model_dir.name}: {source}; greedy continuations of {args.new_tokens} tokens")
    sequences, continuations, consistent = [], [], 0
    for i, prompt in enumerate(prompts):
        cont = greedy_continuation(model, prompt, args.new_tokens)
        ids = list(prompt) + cont
        logits, routing = target_pass(model, recorder, ids)
        consistent += int((logits[len(prompt) - 1 : -1].argmax(-1) == torch.tensor(cont)).sum())
        sequences.append((ids, len(prompt), logits, routing))
        continuations.append(cont)
        if (i + 1) % 5 == 0 or i + 1 == len(prompts):
            say(f"  target: {i + 1}/{len(prompts)} sequences")
    recorder.close()
    target = OffloadedTarget.load(model_dir, SlotConfig(fraction=1.0), LinkConfig(kind="sim"),
                                  policy="demand-lru", device="cpu")
    methods: dict[str, Any] = {}
    rows: dict[str, dict[str, float]] = {}
    parts: dict[str, Any] = {}
    prompt_rows: dict[str, dict[str, float]] = {}
    prompt_parts: dict[str, Any] = {}
    try:
        for method in args.methods:
            t0 = time.perf_counter()
            draft, report = make_draft(model_dir, method, work, args, vocab)
            say(f"  {method}: teacher-forced passes")
            tallies = measure_teacher_forced(draft, sequences, args.windows, num_experts)
            on_prompts = measure_teacher_forced(draft, sequences, args.windows, num_experts, region="prompt")
            on_calibration = logit_error_on_text(model, draft, calib_text)
            acceptance = {}
            for k in args.spec_windows:
                say(f"  {method}: greedy speculation K={k}")
                acceptance[k] = measure_acceptance(target, draft, prompts, args.new_tokens, k, continuations)
            if hasattr(draft, "close"):
                draft.close()
            rows[method] = row_measures(tallies, acceptance)
            parts[method] = (tallies, acceptance)
            prompt_rows[method] = row_measures(on_prompts, {})
            prompt_parts[method] = (on_prompts, {})
            methods[method] = {"summary": merge(tallies).summary(), "acceptance": acceptance,
                               "per_prompt_next_token": [t.token_hits / t.tokens for t in tallies],
                               "prompt_region": merge(on_prompts).summary(),
                               "calibration_text": on_calibration,
                               "draft": {**_report_brief(report), "mode": getattr(draft, "mode", "fp")},
                               "seconds": time.perf_counter() - t0}
            say(f"  {method}: done in {time.perf_counter() - t0:.0f}s")
    finally:
        target.close()
    interval = prompt_interval = None
    if "awq" in parts and "rtn" in parts and len(prompts) > 1 and args.bootstrap:
        say("  paired bootstrap AWQ - RTN over prompts")
        interval = paired_bootstrap(parts["awq"], parts["rtn"], samples=args.bootstrap, seed=args.seed)
        prompt_interval = paired_bootstrap(prompt_parts["awq"], prompt_parts["rtn"], samples=args.bootstrap,
                                           seed=args.seed)
    layout = prompt_layout = None
    if "awq" in parts and "awq-expert" in parts and len(prompts) > 1 and args.bootstrap:
        say("  paired bootstrap AWQ per-expert - AWQ folded over prompts")
        pair = {"awq": rows["awq-expert"], "rtn": rows["awq"]}
        layout = awq_verdict(pair, paired_bootstrap(parts["awq-expert"], parts["awq"], samples=args.bootstrap,
                                                    seed=args.seed))
        pair_prompts = {"awq": prompt_rows["awq-expert"], "rtn": prompt_rows["awq"]}
        prompt_layout = awq_verdict(pair_prompts, paired_bootstrap(
            prompt_parts["awq-expert"], prompt_parts["awq"], samples=args.bootstrap, seed=args.seed))
    distinct = [len(set(c)) / len(c) for c in continuations]
    return {
        "model": str(model_dir),
        "model_type": config.model_type,
        "dtype": checkpoint_dtype(model_dir),
        "experts": num_experts,
        "top_k": int(config.num_experts_per_tok),
        "moe_layers": len(sequences[0][3]),
        "prompts": source,
        "num_prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "positions": len(prompts) * args.new_tokens,
        "target_teacher_forced_vs_generate": consistent / (len(prompts) * args.new_tokens),
        "methods": methods,
        "rows": rows,
        "verdict": awq_verdict(rows, interval),
        "prompt_positions": sum(len(p) for p in prompts),
        "prompt_rows": prompt_rows,
        "prompt_verdict": awq_verdict(prompt_rows, prompt_interval),
        "layout_verdict": layout,
        "prompt_layout_verdict": prompt_layout,
        "continuation_distinct_fraction": distinct,
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    command = "python scripts/fidelity.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = []
        for model in args.model:
            result = study(Path(model), args, work)
            results.append(result)
            print(f"\n{Path(model).name}: {result['prompts']}, {result['new_tokens']} new tokens")
            print(markdown_table(result["rows"]))
            print(verdict_line(result["verdict"], result["rows"]))
            print(delta_table(result["verdict"]))
            print(error_table(result))
            print(f"\nsame measures on the prompts (real text, {result['prompt_positions']} positions):")
            print(markdown_table(result["prompt_rows"]))
            print("real text, " + verdict_line(result["prompt_verdict"], result["prompt_rows"]))
            print(delta_table(result["prompt_verdict"]), flush=True)
            for key, where in (("layout_verdict", ""), ("prompt_layout_verdict", "real text, ")):
                if result.get(key):
                    print(where + verdict_line(result[key], layout_rows(result, key), LAYOUT_NAMES))
                    print(delta_table(result[key], LAYOUT_NAMES), flush=True)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_jsonable({"command": command, "results": results}), indent=1))
        say(f"JSON written to {out}")
    if args.out:
        write_doc(Path(args.out), results, command, args)
        say(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
