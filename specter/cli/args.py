"""The command line's flags: argument types that name the flag and what was expected, and the
parser of every command."""


from __future__ import annotations

import argparse
from typing import NoReturn

from specter.assets import DEFAULT_MODEL
from specter.cli.names import OPTION_NAMES, POLICY_NAMES
from specter.config import ACTORS_VIA, LinkConfig, SlotConfig, parse_bytes
from specter.draft.quantize.cli import add_quantize_command, positive_int
from specter.timing import CLOCKS
from specter.timing.profiles import PROFILES

DEFAULT_BENCH_PROFILES = "qwen2moe-pcie4,dsv2lite-pcie4"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype's names: torch's dtypes


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fraction(text: str) -> SlotConfig:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the routed experts in (0, 1], got {text!r}") from None
    try:
        return SlotConfig(fraction=value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("budget: ")) from None


def _link(text: str) -> LinkConfig | str:
    if text in PROFILES:
        return text  # resolved once the model is known: the profile's rho on this machine
    try:
        return LinkConfig.parse(text)
    except ValueError as exc:
        reason = str(exc).removeprefix("link: ")
        raise argparse.ArgumentTypeError(f"{reason} or a profile: {', '.join(PROFILES)}") from None


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused here where this machine has no such device."""
    import torch  # here, not at the top: ``specter --help`` answers without importing torch

    expected = f"expected cpu, cuda or cuda:N, got {text!r}"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(expected) from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(expected)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available to this torch ({torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return text


def _policy(text: str) -> str:
    from specter.plan import policy_class  # imports the policies, and torch: only where a policy is given

    try:
        policy_class(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("policy: ")) from None
    return text


_POLICY_HELP = f"prefetch policy NAME[+OPTION...]: {', '.join(sorted(POLICY_NAMES))}; options {', '.join(OPTION_NAMES)}"


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids like 1,2,3, got {text!r}") from None
    return ids


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _stop(text: str) -> str:
    """A stop string, with ``\\n``, ``\\t``, ``\\r``, ``\\\\`` and quotes read as escapes (a shell passes
    ``"\\n"`` as two characters)."""
    out, chars = [], iter(text)
    for char in chars:
        if char == "\\":
            following = next(chars, "")
            out.append(_ESCAPES.get(following, "\\" + following))
        else:
            out.append(char)
    if not out:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return "".join(out)


STOP_HELP = ("end the text where TEXT first appears (not printed; up to 4, repeat the flag): generation stops "
             "at the step or round that wrote it; \\n, \\t, \\r and \\\\ are read as escapes")


def _positive_number(text: str, what: str) -> float:
    """``text`` as a positive, finite float; the error names ``what`` was expected."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive, finite {what}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A positive number of seconds (argparse type)."""
    return _positive_number(text, "number of seconds")


def _add_threads(command: argparse.ArgumentParser, extra: str = "") -> None:
    command.add_argument("--threads", type=positive_int, default=None,
                         help="torch compute threads in this process (default: OMP_NUM_THREADS, else one core "
                              "fewer than the machine has: the link's thread keeps one"
                              + (f"; {extra}" if extra else "") + "); the actors run one each")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specter", description="Speculative expert offloading for MoE models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate text on an offloaded target")
    gen.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint folder (default: embedded moe-fine)")
    gen.add_argument("--draft", default=None,
                     help="draft folder: an AWQ draft from `specter quantize`, a published AutoAWQ / GPTQ / "
                     "compressed-tensors int4 checkpoint of the model, or any full-precision checkpoint "
                     "(default: for the embedded model, its shipped AWQ draft when the run drafts)")
    gen.add_argument("--policy", default="demand-lru", type=_policy, help=_POLICY_HELP)
    gen.add_argument("--window", type=int, default=None,
                     help="draft tokens per round K, 1..64 (default: the policy's own; 0 for no-draft policies); "
                          "for specter the cap of the K it chooses per round (0 included; default 32)")
    gen.add_argument("--budget", type=_fraction, default=None,
                     help="device expert slots as a fraction of all routed experts, 0 < F <= 1 "
                          "(default 0.5 on a CPU; from --device-memory or the GPU's free memory on a GPU)")
    gen.add_argument("--device-memory", type=_size, default=None,
                     help="plan this much device memory (e.g. 24GiB): dense parts, draft, KV, then slots")
    gen.add_argument("--per-layer", action="store_true", help="split the budget evenly per MoE layer")
    gen.add_argument("--link", type=_link, default=None,
                     help="cuda | PROFILE (e.g. mixtral-pcie4: its offload pressure on this machine) | "
                          "sim:GBPS[,LATENCY_US] (default: cuda on a GPU, through --address a cluster with "
                          "GPUs, else sim:1,10)")
    _add_timing(gen)
    _add_threads(gen)
    gen.add_argument("--max-new-tokens", type=positive_int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", type=_stop, action="append", default=None, metavar="TEXT", help=STOP_HELP)
    gen.add_argument("--device", type=_device, default=None, help="cpu | cuda[:N] (default: cuda when available)")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="compute dtype (default: fp32 on a CPU, the checkpoint's on a GPU)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    source.add_argument("--prompt-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    source.add_argument("--prompt-file", metavar="PATH",
                        help="prompt text from a UTF-8 file, as it is (a trailing newline kept: a shell's "
                             "$(cat …) drops it); '-' reads standard input")
    gen.add_argument("--json", action="store_true", help="end with one JSON line: tokens, text, stats")
    gen.add_argument("--address", default=None,
                     help="run through the Ray actors: 'local' (start a local Ray), 'auto' (the running "
                          "cluster from `ray start --head`) or HOST:PORT; default: the in-process engine")
    gen.add_argument("--processes", action="store_true",
                     help="run the three roles as plain processes on this machine, without Ray (the actors' "
                          "code over the same sockets and shared memory; with --link cuda, the default on a "
                          "GPU, on the device: slots shared by CUDA IPC, the copy stream in the transfer process)")
    _add_pipeline(gen)
    _add_chooser_cache(gen)
    gen.add_argument("--connect-timeout", type=_seconds, default=30.0,
                     help="seconds to reach and join a cluster (--address auto|HOST:PORT) before failing (30)")
    _add_batch(commands)
    _add_bench(commands)
    _add_serve(commands)
    add_quantize_command(commands)
    return parser


def _add_chooser_cache(command: argparse.ArgumentParser) -> None:
    command.add_argument("--chooser-cache", default=None, metavar="DIR",
                         help="where a drafting run (or server) keeps its K chooser for the next one of the same "
                              "setup, and starts from the last one's (speed only: greedy output is the same for every K); "
                              "'none': always start fresh (default: $SPECTER_CHOOSER_CACHE, else "
                              "~/.cache/specter/choosers; specter/plan/window_store.py)")


def _add_pipeline(command: argparse.ArgumentParser, when: str = "") -> None:
    command.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                         help=f"{when}the next round is drafted while this one is verified: by the draft actor "
                              "(default on through the actors; docs/actors.md), or in process in the verify pass's "
                              "waits (default: the policy's; specter's is on, +pipe / +nopipe set it)")


def _profile_name(text: str) -> str:
    if text not in PROFILES:
        raise argparse.ArgumentTypeError(f"unknown profile {text!r}; known: {', '.join(PROFILES)}")
    return text


def _positive(text: str) -> float:
    """A positive, finite number (argparse type)."""
    return _positive_number(text, "number")


def _add_timing(command: argparse.ArgumentParser) -> None:
    command.add_argument("--clock", choices=CLOCKS, default="wall",
                         help="wall: real time (default); virtual: compute charged from the profile's GPU cost "
                              "model, link and host as discrete events, nothing sleeps (docs/benchmark.md); "
                              "as-built: virtual, plus the host's dispatch of the ops and reads the engine "
                              "really issues (an eager engine on that GPU, specter/timing/dispatch.py); "
                              "measured: virtual link and host, compute at its measured CPU time (it idles through its "
                              "waits, uncounted, so it takes about as long as the wall clock)")
    command.add_argument("--profile", type=_profile_name, default=None,
                         help="a named profile's link and host (on the virtual clock also its GPU's proportions), "
                              "docs/profiles.md; default on the virtual clock: the one of the model's family")
    command.add_argument("--rho", type=_positive, default=None,
                         help="set the link's bandwidth so that the offload pressure is R for this model under "
                              "the profile (replaces the profile's link)")




def _add_batch(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser(
        "batch", help="generate for every prompt of a JSONL file through N replicas of the Ray actors",
        description="Input lines: {\"id\", \"prompt\"} with optional max_new_tokens, temperature, seed. "
                    "Output lines: {\"id\", \"text\", \"tokens\", \"stats\"}, appended and fsynced as each "
                    "prompt finishes; a re-run resumes, skipping finished ids. Failed prompts go to "
                    "OUT.errors.jsonl and are retried by the next run.",
    )
    batch.add_argument("input", metavar="INPUT", help="prompts JSONL")
    batch.add_argument("--out", required=True, help="results JSONL (appended; finished ids are skipped)")
    batch.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint folder (default: embedded moe-fine)")
    batch.add_argument("--draft", default=None, help="draft folder (from specter quantize, a published AutoAWQ / "
                       "GPTQ / compressed-tensors int4 checkpoint, or full precision; default: for the embedded "
                       "model, its shipped AWQ draft when the run drafts)")
    batch.add_argument("--policy", default="demand-lru", type=_policy, help=_POLICY_HELP)
    _add_pipeline(batch)
    batch.add_argument("--window", type=int, default=None,
                       help="draft tokens per round K, 1..64 (specter: the cap of its per-round K)")
    batch.add_argument("--budget", type=_fraction, default=None, help="device expert slots, 0 < F <= 1 (default 0.5)")
    batch.add_argument("--per-layer", action="store_true", help="split the budget evenly per MoE layer")
    batch.add_argument("--link", type=_link, default=None,
                       help="cuda | PROFILE | sim:GBPS[,LATENCY_US] (default: cuda on a cluster with GPUs, each "
                            "replica one GPU, else sim:1,10)")
    batch.add_argument("--profile", type=_profile_name, default=None,
                       help="a named profile's link and host, scaled to this CPU (as --link PROFILE)")
    batch.add_argument("--max-new-tokens", type=positive_int, default=32, help="default for lines without one")
    batch.add_argument("--temperature", type=float, default=0.0, help="default for lines without one")
    batch.add_argument("--top-p", type=float, default=1.0)
    batch.add_argument("--top-k", type=int, default=0)
    batch.add_argument("--seed", type=int, default=0, help="default for lines without one")
    batch.add_argument("--stop", type=_stop, action="append", default=None, metavar="TEXT",
                       help=STOP_HELP.replace("(not printed;", "(default for lines without \"stop\";"))
    batch.add_argument("--address", default="local",
                       help="'local' (start a local Ray, the default), 'auto' (the running cluster, e.g. inside "
                            "`ray job submit`) or HOST:PORT")
    batch.add_argument("--replicas", type=positive_int, default=1,
                       help="engine trios (one per GPU on a GPU cluster, spread over the nodes)")
    batch.add_argument("--on-bad-line", choices=("skip", "stop"), default="skip",
                       help="a malformed input line: report it and go on (skip), or report all and stop before "
                            "any work (stop)")
    batch.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds one prompt may take before its replica is restarted and the prompt retried")
    batch.add_argument("--retries", type=int, default=2, help="retries of a prompt whose replica failed")
    batch.add_argument("--timeout", type=float, default=60.0,
                       help="seconds an actor waits on a silent peer (handshake, transfer, draft) before failing")
    _add_chooser_cache(batch)
    batch.add_argument("--num-cpus", type=positive_int, default=2, help="CPUs of a local Ray")
    batch.add_argument("--connect-timeout", type=_seconds, default=30.0,
                       help="seconds to reach and join a cluster (--address auto|HOST:PORT) before failing (30)")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return value


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (Ray Serve) in front of one engine replica",
        description="Serves GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed with "
                    "\"stream\": true) and GET /health on Ray Serve, in front of the three actors. Up to --max-batch "
                    "requests are decoded together (a drafting policy's rounds drafted for all of them at once); the others "
                    "wait in a bounded queue (--max-queue), past "
                    "which the server answers 429 with Retry-After. A client that disconnects cancels its "
                    "request. Ctrl-C stops it. See docs/serving.md.",
    )
    serve.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint folder (default: embedded moe-fine)")
    serve.add_argument("--draft", default=None, help="draft folder (for the speculative policies; default: for the "
                       "embedded model, its shipped AWQ draft when the policy drafts)")
    serve.add_argument("--policy", default="demand-lru", type=_policy, help=_POLICY_HELP)
    serve.add_argument("--budget", type=_fraction, default=None,
                       help="device expert slots as a fraction of all routed experts, 0 < F <= 1 (default 0.5)")
    serve.add_argument("--link", type=_link, default=None,
                       help="cuda | PROFILE | sim:GBPS[,LATENCY_US] (default: cuda on a cluster with GPUs, else sim:1,10)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address the HTTP server listens on (default 127.0.0.1: this machine only; any "
                            "other needs an API key)")
    serve.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: the model folder's name)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECTER_API_KEY; required when "
                            "--host is not loopback)")
    serve.add_argument("--max-queue", type=positive_int, default=64,
                       help="requests that may wait for the engine; past it, 429 with Retry-After (default 64)")
    serve.add_argument("--max-batch", type=positive_int, default=8,
                       help="requests decoded together, continuously batched (default 8; 1: one at a time)")
    serve.add_argument("--max-body", type=_size, default=1 << 20,
                       help="largest request body, e.g. 1MiB (default); larger ones get 413 before they are read")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template for /v1/chat/completions (default: the tokenizer's own)")
    _add_chooser_cache(serve)
    serve.add_argument("--address", default="local",
                       help="'local' (start a local Ray, the default), 'auto' (the running cluster from "
                            "`ray start --head`) or HOST:PORT")
    serve.add_argument("--num-cpus", type=positive_int, default=2, help="CPUs of a local Ray")
    serve.add_argument("--timeout", type=float, default=60.0,
                       help="seconds an actor waits on a silent peer (handshake, transfer, draft) before failing")
    serve.add_argument("--connect-timeout", type=_seconds, default=30.0,
                       help="seconds to reach and join a cluster (--address auto|HOST:PORT) before failing (30)")


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="every policy side by side on the same prompts")
    bench.add_argument("--model", default=str(DEFAULT_MODEL))
    bench.add_argument("--draft", default=None, help="draft folder (default: the model's shipped AWQ draft)")
    bench.add_argument("--prompts", default=None, help="JSONL with a 'prompt' per line (default: shipped held-out)")
    bench.add_argument("--num-prompts", type=positive_int, default=20)
    bench.add_argument("--new-tokens", type=positive_int, default=128)
    bench.add_argument("--profiles", default=DEFAULT_BENCH_PROFILES,
                       help=f"comma-separated, from: {', '.join(PROFILES)}")
    bench.add_argument("--policies", default=",".join(POLICY_NAMES))
    bench.add_argument("--budget", type=_fraction, default=None,
                       help="device expert slots, 0 < F <= 1, for every profile (default: each profile's own, "
                            "docs/profiles.md)")
    bench.add_argument("--per-layer", action="store_true")
    bench.add_argument("--window", action="append", default=[], metavar="POLICY=K",
                       help="override a policy's K, e.g. --window specter-paper=6 (repeatable; "
                            "for specter the cap of its per-round K)")
    bench.add_argument("--concurrency", default=None, metavar="N,N,...",
                       help="instead of the side-by-side table: N concurrent requests (closed-loop clients), "
                            "continuously batched, for each N given (e.g. 1,2,4,8): throughput, TPOT, TTFT and "
                            "expert coverage per N (default policies demand-lru,demand-host,specter-paper,specter, "
                            "profiles mixtral-pcie4,qwen2moe-pcie4; a drafting policy's rounds batched too, specter "
                            "choosing K per round, --window its cap; specter+fixed drafts K every round)")
    bench.add_argument("--prefill-chunk", type=positive_int, default=16,
                       help="with --concurrency: prompt tokens a joining request feeds per step, or as many as the step's "
                            "draft tokens where more (default 16; a large value prefills a prompt in one pass, "
                            "stalling the running requests meanwhile)")
    bench.add_argument("--kept-choosers", action="store_true",
                       help="with --concurrency: also run each policy that chooses K per round as 'POLICY kept', its "
                            "batcher going on from the K choosers its fresh run of the same N left (a server that "
                            "kept them between runs, or has run for a while: specter serve keeps them)")
    bench.add_argument("--quick", action="store_true",
                       help="a preview: 3 prompts x 16 tokens, K scanned over 4 and 8 (1-2 minutes)")
    bench.add_argument("--actors", action="store_true",
                       help="add 'POLICY@actors' and 'POLICY@pipelined' columns (POLICY: --actors-policy, default "
                            "specter): it through the three roles, same prompts, without and with pipelined drafting")
    bench.add_argument("--actors-schedule", default="transfer",
                       help="where the actors' schedule runs: transfer (default; next to the copies), verifier, "
                            "or both as 'transfer,verifier' (the second's columns end in -v)")
    bench.add_argument("--actors-via", choices=ACTORS_VIA, default="ray",
                       help="how the actors' columns run the three roles: ray (default; Ray actors on a local "
                            "Ray) or processes (plain processes over the same sockets and shared memory, no Ray: "
                            "what --processes and a lent GPU run)")
    bench.add_argument("--actors-policy", type=_policy, default="specter",
                       help="the policy the actors' columns run (default specter; e.g. specter+fixed for one K, "
                            "so that in process and actors make the same rounds)")
    bench.add_argument("--step-s", type=float, default=None,
                       help="wall and measured clocks: the CPU's all-resident step time (s) that link and host are "
                            "scaled to (default: measure it; on a busy machine the measurement is slow)")
    _add_threads(bench, "on the virtual clock 1 (its figures do not depend on threads)")
    bench.add_argument("--clock", choices=("virtual", "as-built", "wall", "measured"), default="virtual",
                       help="virtual (default): compute charged from each profile's GPU cost model, nothing "
                            "sleeps, the same ratios on any machine (the ideal engine); as-built: the same "
                            "plus the dispatch of the ops and reads the engine issues; wall: real time (the actors column); "
                            "measured: virtual link and host, compute at its measured CPU time (it idles through its "
                            "waits, uncounted, so it takes about as long as the wall clock)")
    bench.add_argument("--graphs", action="store_true",
                       help="with --clock as-built: the steps a GPU replays as CUDA graphs (models/graphed.py), every "
                            "token count made ready before the runs, dispatch at the h200-graphs calibration "
                            "(default: the eager steps at h200-eager)")
    bench.add_argument("--rho", type=_positive, default=None,
                       help="set every profile's link so that the offload pressure is R (default: the profile's)")
    bench.add_argument("--draft-mode", choices=("auto", "int4-kernel", "dequant-cache", "dequant-on-the-fly"),
                       default=None, help="the draft's expert mode (default: auto on the wall clock; int4-kernel "
                                          "on the as-built clock, the int4 draft a profile's memory holds, its "
                                          "experts charged as it computes them; else dequant-cache: a timed "
                                          "choice varies the draft's tokens)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--out", default="runs/bench", help="folder for results.json and plots")
