"""What ``scripts/fidelity.py`` writes and prints from its results: the per-model tables (errors,
AWQ − RTN differences with their intervals), a model's markdown section, and the markdown report
(``docs/fidelity.md``) with its fixed head.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from specter.eval.fidelity_report import markdown_table, verdict_line


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
            for part in ("", where + verdict_line(result[key], layout_rows(result, key), LAYOUT_NAMES), "",
                         delta_table(result[key], LAYOUT_NAMES))
        ],
    ])


LAYOUT_NAMES = ("AWQ per-expert", "AWQ folded")


def layout_rows(result: dict[str, Any], key: str) -> dict[str, dict[str, float]]:
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
