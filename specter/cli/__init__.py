"""``specter`` command line: ``specter generate …``.

Bad flags exit with status 2 and one line naming the flag; load errors exit with status 1 and
one line naming the thing at fault. Neither prints a traceback.
"""

from __future__ import annotations

import logging
import sys

from specter.cli.args import build_parser
from specter.cli.bench import run_bench
from specter.cli.commands import _batch, _generate, _serve
from specter.draft.quantize.cli import run_quantize
from specter.models.checkpoint import CheckpointError
from specter.remote.roles.base import RoleStartError

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if args.command == "generate":
            return _generate(args, parser)
        if args.command == "batch":
            return _batch(args, parser)
        if args.command == "bench":
            return run_bench(args, parser)
        if args.command == "serve":
            return _serve(args, parser)
        if args.command == "quantize":
            return run_quantize(args)
    except (CheckpointError, ValueError, FileNotFoundError, TimeoutError, ConnectionError, RoleStartError) as exc:
        print(f"specter: error: {exc}", file=sys.stderr)
        return 1
    return 2

