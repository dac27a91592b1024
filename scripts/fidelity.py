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


# -- output --------------------------------------------------------------------------------------
def _num(value: Any, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def error_table(result: dict[str, Any]) -> str:
    """Per method: the experts' output error on the calibration inputs (the quantizer's own
    report) and the draft's relative logit error and KL on calibration and held-out text."""
    lines = [
        "| method | expert output rel. err (calibration) | logit rel. err: calibration text | continuations "
        "| prompts | KL: calibration text | continuations | prompts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, v in result["methods"].items():
        calib, gen, real = v.get("calibration_text", {}), v["summary"], v["prompt_region"]
        cells = [_num(v["draft"].get("output_rel_err"), ".4f")]
        cells += [_num(d.get("logit_rel_err"), ".4f") for d in (calib, gen, real)]
        cells += [_num(d.get("kl"), ".2e") for d in (calib, gen, real)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def delta_table(verdict: dict[str, Any], names: tuple[str, str] = ("AWQ", "RTN")) -> str:
    """AWQ − RTN (or ``names``' difference) per measure with its paired-bootstrap 95 % interval over prompts."""
    from specter.eval.fidelity_report import header

    if not verdict.get("delta_awq_minus_rtn"):
        return "(no AWQ − RTN differences: needs both methods)"
    interval = verdict.get("interval_awq_minus_rtn", {})
    lines = [f"| measure | {names[0]} − {names[1]} | 95 % interval |", "| --- | ---: | ---: |"]
    for name, delta in verdict.get("delta_awq_minus_rtn", {}).items():
        spec = "+.3f" if name.startswith("accepted") else "+.4f"
        lo, hi = interval.get(name, (math.nan, math.nan))
        lines.append(f"| {header(name)} | {_num(delta, spec)} | [{_num(lo, spec)}, {_num(hi, spec)}] |")
    return "\n".join(lines)


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
        delta_table(result["verdict"]),
        "",
        "Errors (not part of the verdict): the experts' router-weighted relative output error on their "
        "calibration inputs (`draft_report.json`), and the draft's relative logit error "
        "‖z_draft − z_target‖ / ‖z_target‖ and mean KL(target ‖ draft) on the calibration text, the held-out "
        "continuations and the held-out prompts:",
        "",
        error_table(result),
        "",
        f"Checks (target in fp32, as Specter computes it on a CPU; checkpoint weights {result['dtype']}): the "
        f"target's teacher-forced argmax equals its own cached greedy generation at "
        f"{result['target_teacher_forced_vs_generate']:.4f} of positions, and speculative output equals the "
        f"target's greedy continuation in {same} of {len(runs) * result['num_prompts']} (method, K, prompt) "
        f"runs. Fraction of drafted tokens accepted — {rates}.",
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
        "",
        delta_table(result["prompt_verdict"]),
        *[
            part
            for key, where in (("layout_verdict", "Continuations, "), ("prompt_layout_verdict", "Real text, "))
            if result.get(key)
            for part in ("", where + verdict_line(result[key], _layout_rows(result, key), LAYOUT_NAMES), "",
                         delta_table(result[key], LAYOUT_NAMES))
        ],
    ])


LAYOUT_NAMES = ("AWQ per-expert", "AWQ folded")


def _layout_rows(result: dict[str, Any], key: str) -> dict[str, dict[str, float]]:
    """The rows a layout verdict compares, under the names ``awq_verdict`` reads."""
    rows = result["rows"] if key == "layout_verdict" else result["prompt_rows"]
    return {"awq": rows["awq-expert"], "rtn": rows["awq"]}


DOC_HEAD = """# Draft fidelity: RTN int4, AWQ int4 and int8 drafts

Written by `scripts/fidelity.py` (issue 3, point 5). How closely does a draft — the target
with its routed experts quantized (`specter.draft.quantize.model.quantize_model`) — follow the
target, on held-out prompts?

Both models run **teacher-forced** over the same sequence: the prompt plus the target's own
greedy continuation, so every position has an identical context in both. One forward each;
routing is captured on every router (`RoutingRecorder` for the target, `DraftModel.last_routing`
for the draft). The target is computed in fp32, as Specter's target computes on a CPU (the
checkpoints are stored in bf16); the drafts compute in their checkpoint's dtype (bf16 here).

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
of the training split; the held-out prompts come from held-out files only){self_generated}: it searches
input-channel scales (plain and weight-magnitude "duo" form) and then per-group clipping ratios, both against
the experts' router-weighted output error on the tokens routed to them (`docs/draft.md`). `awq` is the
default folded layout (one power-of-two gate/up scale per layer, folded into the norm and its readers;
down's folded into up: plain W4A16); `awq-expert` the per-expert layout (a scale per expert and
projection, format `specter-awq`), compared with it under "AWQ per-expert vs AWQ folded".

The verdict compares the exact (unrounded) numbers, every column: AWQ must be no worse than RTN
on any and better on at least one. A paired bootstrap over prompts ({bootstrap} resamples) gives a
95 % interval for every AWQ − RTN difference (the table under each verdict); a difference whose
interval holds 0 is not distinguishable from prompt-to-prompt variation. The intervals are
reported next to the verdict and do not change it.

Reruns are bit-identical (fixed compute mode, seeded calibration). Still, many AWQ − RTN gaps
below are a few thousandths in agreement or a tenth of a token in accepted length: on these
small, well-trained models int4 already follows the target closely, and a single near-tied
position can flip a speculation round. The error table (relative logit error, KL, the experts'
output error) measures the drafts' closeness to the target directly.
"""


def write_doc(path: Path, results: list[dict[str, Any]], command: str, args: argparse.Namespace) -> None:
    from specter.draft.quantize.calibrate import GenerationSpec

    g = GenerationSpec(windows=args.calib_generate)
    self_generated = (
        f" and on the target's own greedy continuations ({g.new_tokens} tokens) of {g.windows} windows of "
        f"{g.prompt_tokens} of those tokens (self-generated calibration; never the held-out prompts)"
        if g.windows else ""
    )
    head = DOC_HEAD.format(calib_tokens=args.calib_tokens, group_size=args.group_size, bootstrap=args.bootstrap,
                            draft_mode=args.draft_mode, self_generated=self_generated)
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
            print(delta_table(result["verdict"]))
            print(error_table(result))
            print(f"\nsame measures on the prompts (real text, {result['prompt_positions']} positions):")
            print(markdown_table(result["prompt_rows"]))
            print("real text, " + verdict_line(result["prompt_verdict"], result["prompt_rows"]))
            print(delta_table(result["prompt_verdict"]), flush=True)
            for key, where in (("layout_verdict", ""), ("prompt_layout_verdict", "real text, ")):
                if result.get(key):
                    print(where + verdict_line(result[key], _layout_rows(result, key), LAYOUT_NAMES))
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
