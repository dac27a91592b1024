"""``specter quantize``: make an int4 (AWQ or RTN) or int8 draft folder from a target checkpoint.

Wired into ``specter/cli/`` (``args.py``) with ``add_quantize_command(commands)`` and, for
``args.command == "quantize"``, ``return run_quantize(args)``. Bad flags exit 2 with one line
naming the flag; a missing model folder, an unsupported architecture or a failed load exit 1
with one line naming the thing at fault. Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from specter.draft.quantize import LAYOUTS, METHODS

log = logging.getLogger(__name__)


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``, else an error saying it expected ``what``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "a non-negative integer")


def _existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"file {text!r} does not exist")
    return path


def add_quantize_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``quantize`` to a subparsers action; returns the new parser."""
    cmd = subparsers.add_parser("quantize", help="quantize a target's routed experts into a draft folder")
    cmd.add_argument("--model", required=True, help="target checkpoint folder")
    cmd.add_argument("--out", required=True, help="draft folder to write")
    cmd.add_argument(
        "--method",
        choices=METHODS,
        default="awq",
        help="awq (int4, activation-aware), rtn (int4 round-to-nearest), int8 (default awq)",
    )
    cmd.add_argument("--group-size", type=positive_int, default=128, help="int4 group size (default 128)")
    cmd.add_argument(
        "--awq-layout",
        choices=LAYOUTS,
        default="folded",
        help="folded: one gate/up scale per layer folded into the norm, down's folded into up — plain W4A16 "
        "that stock readers compute right (default); per-expert: a scale per expert and projection, a "
        "format only Specter reads (docs/draft.md)",
    )
    cmd.add_argument(
        "--calib-file",
        type=_existing_file,
        default=None,
        help="calibration text (default: the packaged calibration.txt)",
    )
    cmd.add_argument(
        "--calib-tokens", type=positive_int, default=4096, help="calibration tokens (default 4096)"
    )
    cmd.add_argument(
        "--calib-generate",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also calibrate on the target's greedy continuations of N windows of the calibration text "
        "(default 0: text only; 32 was tried, docs/draft.md)",
    )
    cmd.add_argument(
        "--calib-generate-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="tokens generated per window (default 64)",
    )
    return cmd


def run_quantize(args: argparse.Namespace) -> int:
    """Run ``specter quantize``; returns the process exit status."""
    from specter.draft.quantize.calibrate import GenerationSpec
    from specter.draft.quantize.model import quantize_model
    from specter.models.checkpoint import CheckpointError

    if not Path(args.model).expanduser().exists():
        return _fail(f"model folder {args.model!r} does not exist")
    _show_progress()
    try:
        report = quantize_model(
            args.model,
            args.out,
            method=args.method,
            calib_text=args.calib_file,
            calib_tokens=args.calib_tokens,
            group_size=args.group_size,
            progress=True,
            layout=args.awq_layout,
            generation=GenerationSpec(windows=args.calib_generate, new_tokens=args.calib_generate_tokens),
        )
    except (CheckpointError, ValueError) as exc:  # UnsupportedArchitectureError is a ValueError
        return _fail(str(exc))
    groups = report["group_sizes"]
    scheme = (
        "int8 per-channel"
        if report["method"] == "int8"
        else (f"{report['method']} int4, group {groups['gate_up']}/{groups['down']} (gate_up/down)")
    )
    print(
        f"wrote {args.out}: {scheme}, {report['packed_bytes'] / 1e6:.2f} MB packed experts "
        f"(target {report['target_expert_bytes'] / 1e6:.2f} MB), {report['calibration']['tokens']} calibration tokens, "
        f"{report['calibration']['generated']['tokens']} self-generated, "
        f"{report['rtn_fallback_experts']} RTN fallbacks"
        + (
            f", experts' relative output error {report['output_rel_err']:.4f} on the calibration inputs"
            if report.get("output_rel_err") is not None
            else ""
        )
    )
    return 0


def _fail(message: str) -> int:
    print(f"specter quantize: error: {message}", file=sys.stderr)
    return 1


def _show_progress() -> None:
    """Progress lines (INFO records of specter.draft) reach stderr even when the CLI is not verbose:
    records propagate to the root handlers whatever the root logger's own level."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(message)s")
    logging.getLogger("specter.draft").setLevel(logging.INFO)
