"""The GPU bench: synthetic models at real expert shapes, every engine setting interleaved, medians.

    bash scripts/gpu_bench.sh               # on a lent device machine: figures under $OUT
    python scripts/gpu_bench.py --out DIR [--smoke] [--shapes qwen1.5-moe,mixtral-8x7b] [--repeats 3]

For each shape (``specter/eval/synthetic.py``: Qwen1.5-MoE-A2.7B's and Mixtral-8x7B's layer shapes, a
few layers, random weights, built on the device) and its ``gain`` (how often the draft agrees), an
RTN int4 draft is made with ``specter quantize``'s code, and then, after a discarded pass of every
setting over 4 tokens (on the H200 a path's first run cost up to 10x the next: first kernels,
library handles, lazily loaded modules), interleaved (every setting once per repeat, prompts
differing per repeat), with medians over ``--repeats``:

* ``transformers``: transformers' own ``generate``, every expert resident;
* ``engine``: Specter's engine, every expert resident (budget 1.0, demand-lru): its step runs whole,
  one graph with the experts inside; ``engine-cut``: the same step cut at each MoE layer, the
  routing read and the experts computed by each layer's slot graph between the pieces, as an
  offloaded step runs (``GraphedStep.runs_whole`` off);
* ``demand-lru``, ``specter-paper`` (K 8), ``specter`` at each of ``--budgets`` (default 25 % and 50 %);
* ``engine-eager``, ``demand-lru-eager``, ``specter-eager`` (the first budget): the same with the
  steps after the prompt eager (no CUDA graphs: ``models/graphed.py``), draft and target;
* ``demand-lru-ops`` (the first budget): graphed, but each layer's experts in slots issued as ops
  between the pieces rather than replayed as its slot graph (``GraphedStep.slot_graphs`` off, as the
  H200 ran offloaded steps at fa408d0): beside ``demand-lru``, what the slot graphs buy;
* ``specter-paper-int4``, ``specter-int4`` (the first budget, where the int4 kernel takes the shapes):
  the draft's experts in int4 on the device (``int4-kernel``: a step gathers its routed experts, no
  read, graphed), beside the draft step's time in that mode;
* ``demand-lru-processes``, ``specter-processes`` (``--processes``; the first budget): the same
  policies through the three roles as plain processes (``specter/remote/processes.py``): the transfer
  process's copy stream writes the slots the verifier reads by CUDA IPC. One replica per shape serves
  them all (launched once, before the discarded pass); its rows add the TPOT ratio to the same policy
  in process and, for ``demand-lru`` (every copy a demand), the copy engine's busy share of the time a
  demand copy was queued or moving, and for every policy the mean wall time from a demand being asked for
  to its copy being issued on the stream (``demand_issue_us``: where that share's idle time goes). Each of
  these runs first makes ready, in the verifier and the draft process, every token count its rounds can use
  (``ProcessEngine.prepare_steps``), as in process.

Beside the rows, the resident step at a second depth (``engine-depth``: a model of half the layers, or
two where the shape has one; built the same way, no draft): the slope between the two is the engine's
resident step **per MoE layer** as a whole model pays it, the intercept the step's own work (embedding,
final norm, LM head, its launch and reads), which a few-layer model's TPOT over its layers spreads
over those few (``resident_slope``; issue 34's "engine resident ≤ 0.35 / 0.4 ms per MoE layer").

Each row: TPOT (median), its ratio to ``demand-lru`` at the same budget, accepted / K per speculative
round (and the share of rounds ``specter``'s K chooser made plain),
hit rate, link busy share, host reads per MoE layer per token; under the table, per speculative row,
its rounds by K, the rounds drafted ahead that stood and what ``specter``'s K chooser had learnt (α,
the draft's seconds per forward and per round, the K it estimated best, the rounds it did not learn
from for a one-off in them). A setting's K chooser is kept through its runs (the discarded pass's
included), as a running engine keeps it and as the processes' verifier does: each in-process run
loads a fresh target (a fresh slot pool), not a fresh chooser. Each in-process run first captures every token count its rounds can use
(``Engine.prepare_steps``: ``prepared`` in its raw record, beside ``cold_steps``, the timed run's steps
that still ran a count first or captured: 0 when that worked). ``--smoke --static`` runs the steps as
the static pieces a GPU graphs, eagerly (the CPU test of that path). Per shape also the draft's one-token
step, eager and replayed as a CUDA graph (``static`` on a CPU: the same step run eagerly), against
the engine's resident step. Before the shapes, a few seconds of ``kernel_probe``: what a small
kernel takes inside a CUDA graph (the as-built clock's ``h200-graphs`` floor is 5.5 µs) and an
RMSNorm as torch's ``F.rms_norm`` (one fused kernel where torch has one) against the engine's own
(about eight kernels in bf16; two RMSNorms a layer are ~12 of the ~47 kernels of a layer's step), and a
one-token GEMV through a Mixtral expert's 14336 x 4096 bf16 matrix: the bandwidth a resident step's
weights stream at, over which the report sets each shape's ``layer_read_bytes`` beside its slope.
Writes ``gpu_bench.json`` and ``gpu_bench.md`` (the report:
``gpu_bench_report.py``, beside this script) under ``--out``. On a CPU (``--smoke``: shrunk shapes,
1 layer, a few tokens, a simulated link) the same code runs as a test of the script
(``tests/test_gpu_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_bench_report import markdown

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the device machine runs the checkout without installing it

# shape: (layers, gain) on the device. Small gains lead the stream by the token embedding (the draft
# agrees more): the H200's first run saw Mixtral's random draft accept 0.2 of 7.1 even so, so its gain
# is lower, to measure the link-bound regime with a draft that agrees (acceptance is in every row).
DEVICE_SHAPES = {"qwen1.5-moe": (4, 1.0), "mixtral-8x7b": (2, 0.25)}
SMOKE_SHRINK = {"qwen1.5-moe": 16, "mixtral-8x7b": 64}
SPECULATIVE = {"specter-paper": 8, "specter": 16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: shrunk shapes, 1 layer, few tokens")
    parser.add_argument("--shapes", default=",".join(DEVICE_SHAPES))
    parser.add_argument("--budgets", default="0.25,0.5")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --smoke)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 32 (6 with --smoke)")
    parser.add_argument("--gain", type=float, default=None, help="override every shape's agreement knob")
    parser.add_argument("--static", action="store_true",
                        help="with --smoke: the steps after the prompt as the static pieces a GPU graphs, run "
                             "eagerly (step='static': Engine.prepare_steps and the pieces' cold counts on a CPU)")
    parser.add_argument("--extra", default="",
                        help="more policies (options allowed, e.g. specter+nohost) run at the first budget")
    parser.add_argument("--processes", default="demand-lru,specter",
                        help="policies also run through the three processes at the first budget ('' for none)")
    parser.add_argument("--models", default=None,
                        help="folder for the synthetic checkpoints (default: a temporary one, removed at the end; "
                             "never under --out, whose files travel back from a device)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.error("no CUDA device: run with --smoke on a CPU")
    if args.static and cuda:
        parser.error("--static: the static pieces stand in for CUDA graphs on a CPU; a device graphs them")
    shapes = [s for s in args.shapes.split(",") if s]
    from specter.plan import policy_class

    for policy in (p for p in f"{args.extra},{args.processes}".split(",") if p):
        try:
            policy_class(policy)
        except ValueError as exc:
            parser.error(f"--extra: {exc}")
    unknown = [s for s in shapes if s not in DEVICE_SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(DEVICE_SHAPES)}")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets: expected fractions like 0.25,0.5, got {args.budgets!r}")
    if not all(0 < b <= 1 for b in budgets):
        parser.error(f"--budgets: each must be in (0, 1], got {args.budgets}")
    repeats = args.repeats or (1 if args.smoke else 3)
    new_tokens = args.new_tokens or (6 if args.smoke else 32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                               "repeats": repeats, "new_tokens": new_tokens, "budgets": budgets, "shapes": {}}
    try:  # seconds: what the as-built clock's kernel floor stands for (its failure stops no shape)
        results["kernels"] = kernel_probe(cuda)
    except Exception as exc:
        results["kernels"] = {"status": f"failed: {type(exc).__name__}: {exc}"}
    scratch = tempfile.TemporaryDirectory(prefix="specter-bench-")
    models = Path(args.models) if args.models else Path(scratch.name)
    for shape in shapes:
        t0 = time.perf_counter()
        def save(block: dict[str, Any], shape: str = shape) -> None:  # after every repeat: a timeout keeps them
            results["shapes"][shape] = block
            (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
            (out / "gpu_bench.md").write_text(markdown(results))

        try:
            results["shapes"][shape] = bench_shape(shape, models, budgets, repeats, new_tokens, args, cuda, save)
        except Exception as exc:  # one shape failing leaves the others' figures
            results["shapes"][shape] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        results["shapes"][shape]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"gpu_bench: {shape} done in {results['shapes'][shape]['seconds']} s", file=sys.stderr, flush=True)
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_bench.md").write_text(markdown(results))
    print(markdown(results))
    scratch.cleanup()
    return 0


def kernel_probe(cuda: bool, hidden: int = 2048, count: int = 256, replays: int = 20) -> dict[str, Any]:
    """What a small kernel costs inside a CUDA graph, and what an RMSNorm costs there three ways:
    transformers' module (``pow``, ``mean``, ``add``, ``rsqrt``, ``mul`` in fp32 between two dtype
    conversions and the weight: eight kernels in bf16), the engine's (``models/decode.py: _rms_weight``:
    the fp32 part as one ``F.rms_norm``, one fused kernel where torch has ``_fused_rms_norm``: four)
    and all of it in one ``F.rms_norm`` with the weight (one kernel, but it rounds once where
    transformers rounds twice). The as-built clock's ``h200-graphs`` charges 5.5 µs a kernel; this
    says what the device takes (bf16, one row of ``hidden``, ``count`` calls a graph, the median of
    ``replays`` replays), and on 256 rows the share of the engine's and the one-call norm's outputs
    that differ from transformers' bits (the fused kernel reduces in its own order); and ``gemv_gbps``, the
    bytes per second of one token's GEMV through a matrix larger than any L2."""
    if not cuda:
        return {"status": "skipped: needs CUDA"}
    import torch.nn.functional as F

    from specter.models.decode import _rms_weight

    def module_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # transformers' RMSNorm
        up = x.float()
        return weight * (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5

    def per_call_us(body: Any, calls: int = count) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: kernels chosen and loaded before the capture
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return round(statistics.median(times), 2)

    out: dict[str, Any] = {"status": "ok", "hidden": hidden, "calls_per_graph": count}
    out["fused_rms_norm_cuda"] = bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA"))
    out["add_us"] = per_call_us(lambda: x.add_(0))  # one small kernel
    out["rms_norm_module_us"] = per_call_us(lambda: module_rms(x, weight, 1e-6))
    out["rms_norm_engine_us"] = per_call_us(lambda: _rms_weight(x, weight, 1e-6))
    out["rms_norm_fused_us"] = per_call_us(lambda: F.rms_norm(x, (hidden,), weight, 1e-6))
    rows = torch.randn(256, hidden, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0))
    ref = module_rms(rows, weight, 1e-6)
    out["rms_norm_engine_differs"] = float((_rms_weight(rows, weight, 1e-6) != ref).float().mean())
    out["rms_norm_fused_differs"] = float((F.rms_norm(rows, (hidden,), weight, 1e-6) != ref).float().mean())
    # The memory a resident step's weights stream at: one token through a Mixtral expert's gate matrix
    # (14336 x 4096 bf16, 117 MB: past any L2), the GEMV a decode step's weights are read by.
    try:  # its failure keeps the figures above (the report then prints no floor)
        matrix = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
        token = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        out["gemv_us"] = per_call_us(lambda: F.linear(token, matrix), calls=32)
        out["gemv_gbps"] = round(matrix.numel() * matrix.element_size() / (out["gemv_us"] * 1e-6) / 1e9, 1)
    except Exception as exc:
        out["gemv_status"] = f"failed: {type(exc).__name__}: {exc}"
    return out


def layer_read_bytes(shape: str, shrink: int = 1, bytes_per_param: int = 2) -> int:
    """The weights one token's resident step reads per MoE layer of ``shape`` (``specter/eval/synthetic.py``'s
    layer): every parameter of the layer — attention, norms, router, a shared expert — but the routed
    experts, of which only the top-k's; counted off transformers' own module for the shape (no weights)."""
    from transformers import AutoModelForCausalLM

    from specter.eval.synthetic import synthetic_config

    config = synthetic_config(shape, 1, shrink=shrink)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    routed = sum(p.numel() for name, p in layer.named_parameters() if ".experts." in f".{name}")
    rest = sum(p.numel() for p in layer.parameters()) - routed
    return (rest + routed * config.num_experts_per_tok // experts) * bytes_per_param


def bench_shape(shape: str, models: Path, budgets: list[float], repeats: int, new_tokens: int,
                args: argparse.Namespace, cuda: bool, save: Any = None) -> dict[str, Any]:
    """One shape's settings, interleaved over ``repeats``; ``save`` gets the figures so far after each."""
    from specter.draft.quantize.model import quantize_model
    from specter.eval.synthetic import build_synthetic

    layers, gain = DEVICE_SHAPES[shape]
    if args.gain is not None:
        gain = args.gain
    if args.smoke:
        layers = 1
    depth = layers // 2 if layers > 1 else 2  # the resident step's second depth (``resident_slope``)
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    folder, other = models / shape, models / f"{shape}-{depth}-layers"
    for where, count in ((folder, layers), (other, depth)):
        build_synthetic(shape, where / "target", layers=count, gain=gain,
                        shrink=SMOKE_SHRINK[shape] if args.smoke else 1, dtype=dtype, device=device)
    quantize_model(str(folder / "target"), str(folder / "draft"), method="rtn", progress=False)
    settings = [("transformers", 1.0), ("engine", 1.0), ("engine-cut", 1.0), ("engine-eager", 1.0)]
    settings += [(policy, b) for b in budgets for policy in ("demand-lru", *SPECULATIVE)]
    settings += [(f"{policy}-eager", budgets[0]) for policy in ("demand-lru", "specter")]
    settings += [("demand-lru-ops", budgets[0])]
    runner = Runner(folder, device, dtype, cuda, step="static" if args.static else "auto")
    int4 = runner.int4_ready()
    if int4:  # the draft's experts in int4 on the device, gathered per step (where the kernel takes the shapes)
        settings += [(f"{policy}-int4", budgets[0]) for policy in SPECULATIVE]
    settings += [(policy, budgets[0]) for policy in args.extra.split(",") if policy]
    settings += [(f"{policy}-processes", budgets[0]) for policy in args.processes.split(",") if policy]
    runs: dict[str, list[dict[str, Any]]] = {f"{p}@{b:g}": [] for p, b in settings}
    try:  # a figure beside the slope: its failure must not cost the shape's runs
        read_bytes: int | None = layer_read_bytes(shape, SMOKE_SHRINK[shape] if args.smoke else 1, dtype.itemsize)
    except Exception as exc:
        read_bytes = None
        print(f"gpu_bench: {shape}: the layer's weights not counted: {type(exc).__name__}: {exc}", file=sys.stderr)
    deeper: list[dict[str, Any]] = []  # the resident step at the second depth (its tokens: another model's)
    depth_runner = Runner(other, device, dtype, cuda, step="static" if args.static else "auto", draft=False)
    gen = torch.Generator().manual_seed(0)
    try:
        warm = torch.randint(0, 4096, (16,), generator=torch.Generator().manual_seed(1)).tolist()
        for policy, budget in settings:  # a discarded pass: each path's first kernels, handles and modules
            runner.run(policy, budget, warm, 4)
        depth_runner.run("engine", 1.0, warm, 4)
        for repeat in range(repeats):
            prompt = torch.randint(0, 4096, (16,), generator=gen).tolist()
            for policy, budget in settings:  # interleaved: each setting once per repeat
                runs[f"{policy}@{budget:g}"].append(runner.run(policy, budget, prompt, new_tokens))
            deeper.append({"prompt": prompt, **depth_runner.run("engine", 1.0, prompt, new_tokens)})
            if save is not None:
                save({**shape_figures(layers, gain, dtype, runs, {}, (depth, deeper), read_bytes),
                      "repeats_done": repeat + 1})
    finally:
        runner.close()
        depth_runner.close()
    graph = "graph" if cuda else "static"
    steps = {mode: draft_step_ms(folder / "draft", mode, device, dtype, new_tokens) for mode in ("eager", graph)}
    if int4:
        steps[f"int4 {graph}"] = draft_step_ms(folder / "draft", graph, device, dtype, new_tokens, "int4-kernel")
    return shape_figures(layers, gain, dtype, runs, steps, (depth, deeper), read_bytes)


def shape_figures(layers: int, gain: float, dtype: torch.dtype, runs: dict[str, list[dict[str, Any]]],
                  steps: dict[str, float], depth: tuple[int, list[dict[str, Any]]] | None = None,
                  read_bytes: int | None = None) -> dict[str, Any]:
    """A shape's figures: medians per setting, ratios to ``demand-lru``, the draft's step times,
    (``depth``: the second depth's layers and its resident runs) ``resident_slope``, and beside it
    ``layer_read_bytes`` (``read_bytes``: the weights a resident step reads per MoE layer)."""
    summary = {name: summarize(rows) for name, rows in runs.items() if rows}
    for name, row in summary.items():
        setting, budget = name.split("@")
        base = summary.get(f"demand-lru@{budget}")
        if base is not None and base["tpot_ms"] and row["tpot_ms"]:
            row["vs_demand_lru"] = round(base["tpot_ms"] / row["tpot_ms"], 3)
        alone = summary.get(f"{setting.removesuffix('-processes')}@{budget}") if setting.endswith("-processes") else None
        if alone is not None and alone["tpot_ms"]:
            row["vs_in_process"] = round(row["tpot_ms"] / alone["tpot_ms"], 3)
    resident = summary.get("engine@1", {}).get("tpot_ms")
    draft_step = {mode: {"ms": ms, "vs_target_step": round(ms / resident, 3) if resident else None}
                  for mode, ms in steps.items()}
    slope = None
    if depth is not None and depth[1] and resident:
        slope = resident_slope(layers, resident, depth[0], summarize(depth[1])["tpot_ms"])
    return {"layers": layers, "gain": gain, "dtype": str(dtype), "summary": summary, "draft_step": draft_step,
            "resident_slope": slope, "layer_read_bytes": read_bytes, "runs": runs,
            "depth_runs": depth[1] if depth is not None else []}


def resident_slope(layers: int, tpot_ms: float, depth: int, depth_tpot_ms: float) -> dict[str, Any]:
    """The engine's resident step per MoE layer as a whole model pays it: the slope between its TPOT at
    ``layers`` and at ``depth`` layers (the step's own work cancels), that own work (the intercept),
    and the TPOT over ``layers`` beside them (what a model of this few layers shows)."""
    if depth == layers:
        raise ValueError(f"depth: a second depth other than the model's {layers} layers, got {depth}")
    per = (tpot_ms - depth_tpot_ms) / (layers - depth)
    return {"layers": [depth, layers], "tpot_ms": [round(depth_tpot_ms, 4), round(tpot_ms, 4)],
            "per_layer_ms": round(per, 4), "step_own_ms": round(tpot_ms - layers * per, 4),
            "tpot_over_layers_ms": round(tpot_ms / layers, 4)}


def draft_step_ms(folder: Path, step: str, device: str, dtype: torch.dtype, tokens: int,
                  mode: str = "dequant-cache") -> float:
    """The draft's one-token step in ``step`` mode (``DraftModel.load``): median ms over ``tokens`` greedy
    steps after a 16-token prompt (each step reads its routing and token, as the engine's do)."""
    from specter.draft.runner import DraftModel

    draft = DraftModel.load(folder, device=device, mode=mode, dtype=dtype, step=step)
    try:
        cache = draft.new_cache()
        draft.forward(torch.arange(16)[None], cache)
        times = []
        for _ in range(tokens + 2):  # the first two: warm-up (and the capture)
            t0 = time.perf_counter()
            draft.forward(torch.tensor([[draft.last_token]]), cache)
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times[2:]) * 1e3, 4)
    finally:
        draft.close()


class Runner:
    """Loads the target per run (a fresh slot pool) and the draft once; times one request."""

    def __init__(self, folder: Path, device: str, dtype: torch.dtype, cuda: bool, step: str = "auto",
                 draft: bool = True):
        from specter.config import LinkConfig
        from specter.draft.loading import load_draft

        self.folder, self.device, self.dtype, self.step = folder, device, dtype, step
        self.link = LinkConfig(kind="cuda") if cuda else LinkConfig(kind="sim", bandwidth=2e9, latency=10e-6)
        # ``draft`` False: the plain settings only (``engine-depth``'s model has no draft)
        self.draft = load_draft(folder / "draft", device=device, mode="dequant-cache", dtype=dtype,
                                step=step) if draft else None
        self.eager_draft: Any = None
        self.int4_draft: Any = None
        self.processes: Any = None  # the three roles as processes (launched by the first ``-processes`` run)
        self.processes_prepared = 0  # token counts their steps made ready (``ProcessEngine.prepare_steps``)
        self.moe_layers = 1  # the target's MoE layers (known from the first run in process)
        self.choosers: dict[tuple[str, float], Any] = {}  # each setting's K chooser, kept through its runs

    def _draft(self, eager: bool) -> Any:
        """The draft (its steps graphed where the device allows), or its eager twin for ``-eager`` rows."""
        if not eager:
            return self.draft
        if self.eager_draft is None:
            from specter.draft.runner import DraftModel

            self.eager_draft = DraftModel.load(self.folder / "draft", device=self.device, mode="dequant-cache",
                                               dtype=self.dtype, step="eager")
        return self.eager_draft

    def int4_ready(self) -> bool:
        """Whether the draft runs in ``int4-kernel`` with its experts gathered (the kernel takes every
        projection's shape); loads it for the ``-int4`` rows when it does."""
        from specter.draft.runner import DraftModel

        try:
            draft = DraftModel.load(self.folder / "draft", device=self.device, mode="int4-kernel", dtype=self.dtype,
                                    step=self.step)
        except ValueError as exc:
            print(f"gpu_bench: no int4 draft rows: {exc}", file=sys.stderr, flush=True)
            return False
        if not draft.kernels.gathered or draft.kernels.kernel_fallbacks:
            draft.close()
            return False
        self.int4_draft = draft
        return True

    def _int4(self) -> Any:
        """The draft in ``int4-kernel`` (its steps graphed where the device allows): ``int4_ready``'s."""
        assert self.int4_draft is not None, "int4_ready() first"
        return self.int4_draft

    def run(self, policy: str, budget: float, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        setting = (policy, budget)
        if policy == "transformers":
            return self._transformers(prompt, new_tokens)
        if policy.endswith("-processes"):
            return self._through_processes(policy.removesuffix("-processes"), budget, prompt, new_tokens)
        from specter.config import SlotConfig
        from specter.engine import Engine
        from specter.target import OffloadedTarget

        eager = policy.endswith("-eager")  # the lean steps without graphs (a CPU's default), for the ratio
        policy = policy.removesuffix("-eager")
        cut = policy.endswith("-cut")  # the resident step cut at each MoE layer, as an offloaded one runs
        policy = policy.removesuffix("-cut")
        ops = policy.endswith("-ops")  # a cut step's experts in slots as ops, not replays of its slot graphs
        policy = policy.removesuffix("-ops")
        int4 = policy.endswith("-int4")  # the draft's experts in int4, gathered per step
        policy = policy.removesuffix("-int4")
        name = "demand-lru" if policy == "engine" else policy
        target = OffloadedTarget.load(self.folder / "target", SlotConfig(fraction=budget), self.link, name,
                                      device=self.device, dtype=self.dtype, step="eager" if eager else self.step)
        try:
            if target.graphed is not None:
                target.graphed.runs_whole, target.graphed.slot_graphs = not cut, not ops
            window = SPECULATIVE.get(policy.split("+")[0], 0)
            engine = Engine(target, (self._int4() if int4 else self._draft(eager)) if window else None, window=window)
            if setting in self.choosers:  # what its earlier runs measured stays learnt, as in a running engine
                engine.policy.use_window_chooser(self.choosers[setting])
            self.choosers[setting] = engine.policy.window_chooser()
            prepared = engine.prepare_steps()  # every token count a round can use captured now, not in the timed run
            engine.generate_fresh(prompt, 2)  # warm-up: kernels chosen, caches allocated
            cold = engine.cold_steps()
            tokens, stats = engine.generate_fresh(prompt, new_tokens)
            cold = engine.cold_steps() - cold  # steps of the timed run that ran a count first or captured: 0 here
            layers = self.moe_layers = len(target.loaded.moe_layers)
            graphs = target.graphed.captures if target.graphed is not None else 0
            whole = bool(target.graphed.whole) if target.graphed is not None else False
            slot_graphs = target.graphed is not None and any(p.inside for p in target.graphed.pieces.values())
            failure = target.graphed.failure if target.graphed is not None else None
        finally:
            target.close()
        if failure:
            print(f"gpu_bench: {policy}: CUDA graph capture failed: {failure}", file=sys.stderr, flush=True)
        # the engine's mean_window counts the rounds its K chooser made plain (K 0); here K is over the
        # speculative rounds, beside the share of plain ones
        spec, plain = stats.extra.get("rounds", 0), stats.extra.get("plain_rounds", 0)
        window = stats.extra.get("mean_window", 0.0) * (spec + plain) / spec if spec else 0.0
        return {"tpot_ms": stats.tpot_s * 1e3, "tokens": tokens, "hit_rate": stats.hit_rate, "graphs": graphs,
                "prepared": prepared, "cold_steps": cold, "whole": whole, "slot_graphs": slot_graphs,
                "accepted": stats.extra.get("mean_accepted", 0.0), "window": window,
                "plain_share": plain / (spec + plain) if spec + plain else 0.0,
                "link_busy": stats.link_busy_fraction,
                "reads_per_layer_token": stats.extra["host_reads"] / max(1, (len(tokens) - 1) * layers),
                **_rounds(stats.extra)}

    def _through_processes(self, policy: str, budget: float, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        """One request through the three processes (launched at the first call, at its budget)."""
        from specter.config import SlotConfig
        from specter.remote.processes import launch_processes

        if self.processes is None:
            self.processes = launch_processes(self.folder / "target", self.folder / "draft", SlotConfig(fraction=budget),
                                              self.link, policy=policy, timeout_s=120, draft_mode="dequant-cache",
                                              dtype=self.dtype, step=self.step)
        engine = self.processes
        window = SPECULATIVE.get(policy.split("+")[0], 0)
        # as in process, no capture inside the timed run; ``prepared``: what the replica made ready so far
        self.processes_prepared += sum(engine.prepare_steps(window).values())
        engine.generate(prompt, 2, policy=policy, window=window)  # warm-up, as in process

        def draft_cold() -> int:  # the draft process's cold steps so far (its own count: not in the stats)
            return int(engine.call(engine.draft, "cold_steps")) if engine.draft is not None else 0

        before, cold = engine.link_counters(), draft_cold()
        out = engine.generate(prompt, new_tokens, policy=policy, window=window)
        after, cold = engine.link_counters(), draft_cold() - cold
        stats, tokens = out["stats"], out["tokens"]
        spec, plain = stats.get("rounds", 0), stats.get("plain_rounds", 0)
        row = {"tpot_ms": stats["tpot_s"] * 1e3, "tokens": tokens, "hit_rate": stats["hit_rate"],
               "prepared": self.processes_prepared, "cold_steps": stats.get("cold_steps", 0) + cold,
               "accepted": stats.get("mean_accepted", 0.0),
               "window": stats.get("mean_window", 0.0) * (spec + plain) / spec if spec else 0.0,
               "plain_share": plain / (spec + plain) if spec + plain else 0.0,
               "link_busy": stats["link_busy_fraction"],
               "reads_per_layer_token": stats["host_reads"] / max(1, (len(tokens) - 1) * self.moe_layers),
               **_rounds(stats)}
        outstanding = after.get("demand_outstanding_s", 0.0) - before.get("demand_outstanding_s", 0.0)
        if policy == "demand-lru" and outstanding > 0:  # every copy a demand: busy over outstanding is the share
            row["busy_while_demanded"] = (after["busy_s"] - before["busy_s"]) / outstanding
        issued = after.get("demands_issued", 0) - before.get("demands_issued", 0)
        if issued > 0:  # how long a demand waited to be issued on the copy stream, on average
            row["demand_issue_us"] = (after["demand_issue_s"] - before["demand_issue_s"]) / issued * 1e6
        return row

    def _transformers(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.folder / "target"), dtype=self.dtype)
        model.to(self.device).eval()  # type: ignore[arg-type]
        ids = torch.tensor([prompt], device=self.device)
        times = {}
        try:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
                for n in (1, new_tokens):
                    self._sync()
                    t0 = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                    self._sync()
                    times[n] = time.perf_counter() - t0
        finally:
            del model
        tokens = out[0, len(prompt):].tolist()
        return {"tpot_ms": (times[new_tokens] - times[1]) / (new_tokens - 1) * 1e3, "tokens": tokens}

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        for draft in (self.draft, self.eager_draft, self.int4_draft):
            getattr(draft, "close", lambda: None)()
        if self.processes is not None:
            self.processes.shutdown()


def _rounds(stats: dict[str, Any]) -> dict[str, Any]:
    """How a speculative run's rounds went, beyond the medians: the K of each round counted, the
    rounds drafted ahead that stood, and what ``specter``'s K chooser had learnt by the end (α, the
    draft's seconds per forward and per round, each K's estimated seconds per token): on silicon,
    why it chose the K it did."""
    out: dict[str, Any] = {}
    if stats.get("window_hist"):
        out["window_hist"] = stats["window_hist"]
    if stats.get("pipelined"):
        out["ahead"] = {k: stats.get(f"ahead_{k}", 0) for k in ("asked", "kept", "dropped")}
    if stats.get("chooser"):
        out["chooser"] = stats["chooser"]
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats (TPOT, acceptance, hit rate, busy share, reads); the rounds' record
    (``_rounds``) of the last repeat."""
    keys = [k for k in rows[0] if k != "tokens" and all(isinstance(r.get(k), int | float) for r in rows)]
    summary: dict[str, Any] = {k: round(statistics.median(r[k] for r in rows), 4) for k in keys}
    summary.update({k: rows[-1][k] for k in ("window_hist", "ahead", "chooser") if k in rows[-1]})
    return summary


if __name__ == "__main__":
    sys.exit(main())
