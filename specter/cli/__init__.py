"""``specter`` command line: ``specter generate …``.

Bad flags exit with status 2 and one line naming the flag; load errors exit with status 1 and
one line naming the thing at fault; Ctrl-C (SIGINT) exits with status 130 and one line ("specter:
interrupted"), SIGTERM (``kill``, ``ray job stop``) with 143 ("specter: terminated"), SIGHUP (the
terminal closed) with 129 ("specter: hung up"), once what the command started (Ray, the actors, the
role processes) is stopped (``specter.signals``). None prints a traceback. ``batch`` stops between
prompts and keeps what finished; a running ``serve`` stops with 0 (``actors/serve.py``).

``entry`` is the command itself (the console script and ``python -m specter.cli``): ``main``, then the
process's exit handlers, then the process ends without the interpreter's teardown of every module
(torch, transformers, Ray), which took 1.4 s after an in-process ``generate`` and 1.7 s after one
through Ray on a 2-core CPU, with nothing left to do: every command has closed, flushed or fsynced
what it wrote and stopped what it started (Ray, the role processes) before it returns.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn

from specter.cli.args import build_parser
from specter.signals import (
    HUNG_UP,
    INTERRUPTED,
    TERMINATED,
    exit_status,
    signal_of,
    stopped_word,
    terminating,
)

__all__ = ["HUNG_UP", "INTERRUPTED", "TERMINATED", "build_parser", "entry", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        with terminating():
            return _run(args, parser)
    except KeyboardInterrupt as exc:  # the commands' ``finally`` and ``with`` blocks have stopped what they started
        signum = signal_of(exc)
        print(f"specter: {stopped_word(signum)}", file=sys.stderr)
        return exit_status(signum)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # the commands import torch (a second): only once the arguments parsed, so ``--help`` answers at once
    from specter.cli.bench import run_bench
    from specter.cli.commands import _batch, _generate, _serve
    from specter.draft.quantize.cli import run_quantize
    from specter.models.checkpoint import CheckpointError
    from specter.remote.roles.base import RoleStartError

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


def entry() -> NoReturn:
    """``specter``: ``main``'s status, once the exit handlers have run and the output is flushed.
    An exception from ``main`` (a bad flag's ``SystemExit`` too) leaves through the normal exit."""
    code = main()
    atexit._run_exitfuncs()  # what a normal exit runs first: Ray's, multiprocessing's, weakref finalizers
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (``| head``), or a stream closed
            stream.flush()
    os._exit(code)
