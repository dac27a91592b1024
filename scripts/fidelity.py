#!/usr/bin/env python
"""Draft fidelity study: RTN int4, AWQ int4 and int8 drafts against their target.

For each model and method: quantize the target's routed experts into a draft, then on held-out
prompts (the target's own greedy continuation, teacher-forced through both models) measure exact
top-k set agreement per MoE layer, routing recall over windows of K positions, next-token
agreement, and the mean accepted length of greedy speculation through ``specter.engine.Engine``.
Prints one table per model, writes JSON and a markdown report, and checks the issue's rule
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

from specter.fidelity import (
    WINDOWS,
    awq_verdict,
    greedy_continuation,
    markdown_table,
    measure_acceptance,
    measure_teacher_forced,
    merge,
    paired_bootstrap,
    row_measures,
    target_pass,
    verdict_line,
)

METHODS = ("rtn", "awq", "int8", "fp")  # fp: the target itself as its own draft (a ceiling check)
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
    if args.num_prompts < 1 or args.new_tokens < 2 or args.prompt_len < 1:
        p.error("--num-prompts >= 1, --new-tokens >= 2, --prompt-len >= 1")
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
    from specter.prompts import HELDOUT, load_prompts

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


def make_draft(model_dir: Path, method: str, work: Path, args: argparse.Namespace, vocab: int) -> tuple[Any, dict]:
    """The draft of ``method`` (quantized into ``work/<model>-<method>`` unless a newer one is there)."""
    if method == "fp":
        from specter.draft.resident import ResidentDraft

        return ResidentDraft(model_dir), {"method": "fp"}
    from specter.draft.quantize import REPORT, quantize_model
    from specter.draft.runner import DraftModel

    def load_draft(folder: Path) -> DraftModel:
        return DraftModel.load(folder, device="cpu", mode=args.draft_mode)

    out = work / f"{model_dir.name}-{method}"
    report_file = out / REPORT
    weights = max(f.stat().st_mtime for f in model_dir.glob("*.safetensors"))
    if report_file.is_file() and report_file.stat().st_mtime > weights:
        report = json.loads(report_file.read_text())
        if report.get("method") == method:
            say(f"  {method}: reusing the draft in {out}")
            return load_draft(out), report
    say(f"  {method}: quantizing into {out}")
    report = quantize_model(
        model_dir, out, method=method, calib_tokens=args.calib_tokens, group_size=args.group_size,
        progress=args.verbose, calib_ids=calibration(model_dir, vocab, args) if method == "awq" else None,
    )
    return load_draft(out), report


def _report_brief(report: dict) -> dict:
    keys = ("method", "bits", "group_sizes", "calib_tokens", "rtn_fallback_experts", "awq_scaled_projections",
            "packed_bytes", "target_expert_bytes")
    return {k: report[k] for k in keys if k in report}


# -- one model -----------------------------------------------------------------------------------
def study(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from specter.config import LinkConfig, SlotConfig
    from specter.models.routing import RoutingRecorder
    from specter.target import OffloadedTarget

    say(f"{model_dir}: loading the target")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), experts_implementation="eager").eval()
    config = model.config
    vocab = int(config.vocab_size)
    num_experts = next(int(getattr(config, a)) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                       if getattr(config, a, None))
    recorder = RoutingRecorder(model)
    prompts, source = held_out_prompts(model_dir, vocab, args)
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
    distinct = [len(set(c)) / len(c) for c in continuations]
    return {
        "model": str(model_dir),
        "model_type": config.model_type,
        "dtype": str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "?")).removeprefix("torch."),
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
        "continuation_distinct_fraction": distinct,
    }


# -- output --------------------------------------------------------------------------------------
def model_section(result: dict[str, Any]) -> str:
    name = Path(result["model"]).name
    d = result["continuation_distinct_fraction"]
    loops = sum(x < 0.1 for x in d)
    runs = [a for v in result["methods"].values() for a in v["acceptance"].values()]
    same = sum(a["lossless_prompts"] for a in runs)
    rates = "; ".join(
        f"{m}: " + ", ".join(f"K={k} {a['acceptance_rate']:.2f}" for k, a in v["acceptance"].items())
        for m, v in result["methods"].items()
    )
    return "\n".join([
        f"### {name} ({result['model_type']}, {result['experts']} experts top-{result['top_k']}, "
        f"{result['moe_layers']} MoE layers)",
        "",
        f"{result['prompts']}, {result['new_tokens']} new tokens each: {result['positions']} scored positions "
        f"per layer.",
        "",
        markdown_table(result["rows"]),
        "",
        verdict_line(result["verdict"], result["rows"]),
        "",
        f"Checks ({result['dtype']} weights): the target's teacher-forced argmax equals its own cached greedy "
        f"generation at {result['target_teacher_forced_vs_generate']:.4f} of positions, and speculative output "
        f"equals the target's greedy continuation in {same} of {len(runs) * result['num_prompts']} "
        f"(method, K, prompt) runs; a difference in either comes from near-tied logits, whose argmax can flip "
        f"in low precision with the number of positions one forward processes (which acceptance decides). "
        f"Fraction of drafted tokens accepted — {rates}.",
        "",
        f"Greedy continuations of a small model repeat themselves: on average "
        f"{sum(d) / len(d):.2f} of a continuation's tokens are distinct, and {loops} of {len(d)} are a loop of a "
        f"few tokens (< 10 % distinct), which makes drafting easier than on real text. The same measures on the "
        f"prompts themselves (real held-out text, {result['prompt_positions']} positions; routing at every "
        f"prompt position, next-token at the positions that predict prompt tokens):",
        "",
        markdown_table(result["prompt_rows"]),
        "",
        "Real text, " + verdict_line(result["prompt_verdict"], result["prompt_rows"]),
    ])


DOC_HEAD = """# Draft fidelity: RTN int4, AWQ int4 and int8 drafts

Written by `scripts/fidelity.py` (issue 3, point 5). How closely does a draft — the target
with its routed experts quantized (`specter.draft.quantize.quantize_model`) — follow the
target, on held-out prompts?

Both models run **teacher-forced** over the same sequence: the prompt plus the target's own
greedy continuation, so every position has an identical context in both. One forward each;
routing is captured on every router (`RoutingRecorder` for the target, `DraftModel.last_routing`
for the draft).

| column | meaning |
| --- | --- |
| top-k set (mean / min layer) | fraction of positions where the draft's top-k expert *set* equals the target's, per MoE layer; mean over layers, and the worst layer |
| R@K | routing recall over windows of K consecutive positions (sliding, stride 1, within one sequence): per layer, \\|∪ draft ∩ ∪ target\\| / \\|∪ target\\|, averaged over windows and layers |
| next-token | fraction of positions where the draft's argmax equals the target's (teacher-forced) |
| accepted K=k | mean accepted draft tokens per round of greedy speculation (`specter.engine.Engine`, `demand-lru`, every expert resident), all accepted tokens / all rounds; at most k |

Routing measures are scored at the positions of the generated tokens (what decode steps
process), next-token agreement at the positions that predict them. `int8` is per-channel
asymmetric; `rtn` and `awq` are int4, group {group_size} (or the largest divisor the report names);
drafts compute in `{draft_mode}` mode (`DraftModel.load`).
AWQ calibrates on the first {calib_tokens} tokens of `specter/assets/prompts/calibration.txt` (excerpts
of the training split; the held-out prompts come from held-out files only).

The verdict compares the exact (unrounded) numbers, every column: AWQ must be no worse than RTN
on any and better on at least one. A paired bootstrap over prompts
({bootstrap} resamples) says which AWQ − RTN differences are clear of sampling noise (95 % interval
excluding 0); it is reported next to the verdict and does not change it.

Reading the verdict: the AWQ − RTN gaps below are mostly a few thousandths in agreement and
0.01–0.3 tokens in accepted length — close to the size of a change that leaves the weights alone.
While this study was built, runs whose drafts picked their compute kernel by timing
(`--draft-mode auto`: dequantized weights or torch's int4 kernel) moved top-k set agreement by up
to 0.003 and mean accepted length by up to 0.11 tokens (K=8) on these models. The
mode is fixed now and reruns are bit-identical, but a PASS or FAIL decided by a gap of that size
says little; the bootstrap says which gaps stand out from prompt-to-prompt variation.
"""


def write_doc(path: Path, results: list[dict[str, Any]], command: str, args: argparse.Namespace) -> None:
    head = DOC_HEAD.format(calib_tokens=args.calib_tokens, group_size=args.group_size, bootstrap=args.bootstrap,
                            draft_mode=args.draft_mode)
    parts = [head, "## Results", "", "```", command, "```", ""]
    for result in results:
        parts += [model_section(result), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))


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
            print(f"\nsame measures on the prompts (real text, {result['prompt_positions']} positions):")
            print(markdown_table(result["prompt_rows"]))
            print("real text, " + verdict_line(result["prompt_verdict"], result["prompt_rows"]), flush=True)
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
