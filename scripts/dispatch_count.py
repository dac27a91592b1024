"""Count a decode's dispatch through the public API: ops that reach a kernel and reads of device data
into Python, per MoE layer per committed token (``specter/timing/dispatch.py``).

A held-out model (never used to tune anything: a seeded Qwen2-MoE of 4 MoE layers x 32 experts,
top-4, with a shared expert; or ``--model DIR``) and a draft of it (``specter quantize``, int8 by
default: it agrees with the target nearly always, so a round's count is that of rounds that stand;
``--method rtn`` for int4) are built in a temporary folder. Each setting generates ``--tokens`` + 1 new tokens and 1 new
token after the same prompt; the difference is the decode's own dispatch. ``--steps eager,static``
counts each setting with the eager lean steps (a CPU's default) and with the pieces a GPU replays as
CUDA graphs (``models/graphed.py``; each replay one op); ``--prepare`` makes every token count's steps
ready before the runs (``Engine.prepare_steps``, as the GPU bench does), so no count's first steps run
eagerly inside them. Beside ops and reads, the kernels the device runs (inside a replay too): what a
graphed step takes at least, a floor each (``Dispatch.kernel_s``). ``--dtype bfloat16`` computes as a
GPU does, with the dtype conversions a bf16 step issues. After the settings, per step kind: a draft
decode step alone (``--mode``: its experts' compute mode, e.g. ``int4-kernel`` with ``--method rtn``),
per MoE layer per step.

    python scripts/dispatch_count.py [--tokens 32] [--steps eager,static] [--prepare] [--dtype bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.eval.synthetic import build_held_out
from specter.target import OffloadedTarget
from specter.timing.dispatch import DispatchCount

SETTINGS = (  # name, budget, policy, window
    ("resident plain", 1.0, "demand-lru", 0),
    ("offloaded plain 25%", 0.25, "demand-lru", 0),
    ("specter round K 8, 25%", 0.25, "specter+fixed+nopipe", 8),
)


def make_draft(model: Path, out: Path, method: str) -> Path:
    from specter.draft.quantize.model import quantize_model

    quantize_model(str(model), str(out), method=method, group_size=32)
    return out


def count(engine: Engine, prompt: list[int], tokens: int) -> tuple[DispatchCount, int, float]:
    """Dispatch of ``tokens`` committed decode tokens (a run of tokens + 1 less a run of 1), and the
    mean tokens a round committed."""
    runs = []
    for new in (1, tokens + 1):
        engine.target.offload.reset_residency()
        with DispatchCount() as counted:
            ids, stats = engine.generate(prompt, new)
        runs.append((counted, len(ids)))
    (short, n1), (long, n2) = runs
    diff = DispatchCount()
    diff.ops, diff.reads, diff.syncs = long.ops - short.ops, long.reads - short.reads, long.syncs - short.syncs
    diff.kernels = long.kernels - short.kernels
    diff.by_name = {k: v - short.by_name.get(k, 0) for k, v in long.by_name.items()}
    diff.kernels_by_name = {k: v - short.kernels_by_name.get(k, 0) for k, v in long.kernels_by_name.items()}
    rounds = stats.extra.get("rounds") or len(ids)
    return diff, n2 - n1, len(ids) / rounds


def count_draft(draft, prompt: list[int], steps: int) -> DispatchCount:
    """A draft decode step's dispatch alone: ``steps`` one-token forwards after the prompt and two
    warm steps (each token count's first steps are not a decode's), summed."""
    cache = draft.new_cache()
    draft.forward(torch.tensor([prompt]), cache)
    for token in (3, 4):
        draft.forward(torch.tensor([[token]]), cache)
    with DispatchCount() as counted:
        for token in range(steps):
            draft.forward(torch.tensor([[5 + token % 7]]), cache)
    return counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder (default: the held-out model)")
    parser.add_argument("--draft", help="its draft (default: one made here by --method)")
    parser.add_argument("--method", default="int8", choices=("int8", "rtn", "awq"), help="the draft made here")
    parser.add_argument("--mode", default="dequant-cache", help="the draft's compute mode (default dequant-cache)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--top", type=int, default=0, help="also list the N most frequent kernels per setting (a replay's "
                        "included), per MoE layer per token")
    parser.add_argument("--steps", default="eager", help="comma-separated: eager (a CPU's), static (a GPU's graphs)")
    parser.add_argument("--prepare", action="store_true", help="every token count's steps made ready first")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the compute dtype (default float32, a CPU's; bfloat16: a GPU's, with its conversions)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_held_out(Path(tmp) / "model")
        draft_dir = Path(args.draft) if args.draft else make_draft(model, Path(tmp) / "draft", args.method)
        prompt = list(range(3, 11))
        for step in args.steps.split(","):
            draft = load_draft(draft_dir, device="cpu", mode=args.mode, step=step, dtype=dtype)
            for name, budget, policy, window in SETTINGS:
                target = OffloadedTarget.load(model, SlotConfig(fraction=budget), LinkConfig(
                    kind="sim", bandwidth=1e12, latency=0.0), policy=policy, device="cpu", step=step, dtype=dtype)
                engine = Engine(target, draft if window else None, window=window)
                if args.prepare:
                    engine.prepare_steps()
                counted, tokens, per_round = count(engine, prompt, args.tokens)
                per = tokens * len(target.loaded.moe_layers)
                rows.append({"setting": f"{name} ({step}{', prepared' if args.prepare else ''}, {args.dtype})", "tokens": tokens, "tokens_per_round": per_round,
                             "ops": counted.ops / per, "reads": counted.reads / per, "syncs": counted.syncs / per,
                             "kernels": counted.kernels / per,
                             "top": [(k, v / per) for k, v in sorted(counted.kernels_by_name.items(),
                                                                     key=lambda kv: -kv[1])[: args.top]]})
                target.close()
            counted = count_draft(draft, prompt, args.tokens)
            per = args.tokens * len(target.loaded.moe_layers)
            rows.append({"setting": f"draft step alone, {args.mode} ({step}, {args.dtype})", "tokens": args.tokens,
                         "tokens_per_round": 1.0, "ops": counted.ops / per, "reads": counted.reads / per,
                         "syncs": counted.syncs / per, "kernels": counted.kernels / per,
                         "top": [(k, v / per) for k, v in sorted(counted.kernels_by_name.items(),
                                                                 key=lambda kv: -kv[1])[: args.top]]})
    print("| setting | ops / MoE layer / token | kernels | host reads | implicit syncs | tokens / round |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['setting']} | {row['ops']:.1f} | {row['kernels']:.1f} | {row['reads']:.2f} | {row['syncs']:.2f} "
              f"| {row['tokens_per_round']:.2f} |")
        if args.top:
            print("    " + ", ".join(f"{k} {v:.2f}" for k, v in row["top"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
