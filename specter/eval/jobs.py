"""Batch prompt jobs on disk: the input JSONL, the append-only results file, resume, progress.

Input lines are ``{"id", "prompt"}`` objects with optional ``max_new_tokens``, ``temperature``,
``seed`` and ``stop`` (a string or up to four: the text ends before the first, the tokens with the one
that completed it). Each result is one line ``{"id", "text", "tokens", "stats"}`` written with a single
``write`` and fsynced before the next prompt is handed out, so a killed job leaves at most one
torn last line, which ``ResultsFile`` cuts off on resume. Ids already in the results file are
skipped; ``ResultsFile.append`` refuses an id twice. Prompts that fail go to ``<out>.errors.jsonl``
(and are retried by the next run). Ctrl-C, SIGTERM or SIGHUP stops a job between prompts
(``interrupts``): what finished stays, and the same command goes on from it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from specter.serving.text import check_stops
from specter.signals import handling, raise_for, signal_name

MAX_NEW_TOKENS_CAP = 1 << 20  # "absurd" beyond this: refused on the line, not after hours of work


class BatchLineError(ValueError):
    """A malformed input line; the message starts with ``PATH:LINE:``."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


@dataclass
class BatchItem:
    """One prompt of a batch, with its own overrides of the job's defaults."""

    id: str
    prompt: str
    line: int
    max_new_tokens: int
    temperature: float
    seed: int
    stop: tuple[str, ...] = ()


def parse_line(
    text: str, number: int, path: str, max_new_tokens: int, temperature: float, seed: int,
    stop: tuple[str, ...] = (),
) -> BatchItem:
    """One input line as a ``BatchItem``; a ``BatchLineError`` names the line and the field."""
    where = f"{path}:{number}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})", number) from None
    if not isinstance(row, dict):
        raise BatchLineError(
            f"{where}: expected a JSON object with 'id' and 'prompt', got {type(row).__name__}", number
        )
    ident = row.get("id")
    if (
        isinstance(ident, bool)
        or not isinstance(ident, str | int)
        or (isinstance(ident, str) and not ident.strip())
    ):
        raise BatchLineError(f"{where}: 'id' must be a non-empty string or an integer, got {ident!r}", number)
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise BatchLineError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}", number)
    if not prompt.strip():
        raise BatchLineError(f"{where}: 'prompt' must not be empty", number)
    unknown = sorted(set(row) - {"id", "prompt", "max_new_tokens", "temperature", "seed", "stop"})
    if unknown:
        raise BatchLineError(
            f"{where}: unknown field(s) {unknown}; expected id, prompt, max_new_tokens, temperature, seed, stop",
            number,
        )
    n = row.get("max_new_tokens", max_new_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS_CAP:
        raise BatchLineError(
            f"{where}: 'max_new_tokens' must be an integer in 1..{MAX_NEW_TOKENS_CAP}, got {n!r}", number
        )
    t = row.get("temperature", temperature)
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise BatchLineError(f"{where}: 'temperature' must be a finite number >= 0, got {t!r}", number)
    s = row.get("seed", seed)
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63:
        raise BatchLineError(f"{where}: 'seed' must be an integer in [0, 2**63), got {s!r}", number)
    try:
        stops = check_stops(row["stop"], "'stop'") if "stop" in row else stop
    except ValueError as exc:
        raise BatchLineError(f"{where}: {exc}", number) from None
    return BatchItem(str(ident), prompt, number, n, float(t), s, stops)


def read_batch(
    path: str | Path, max_new_tokens: int, temperature: float, seed: int, stop: tuple[str, ...] = ()
) -> tuple[list[BatchItem], list[BatchLineError]]:
    """Every good line of ``path`` and every bad one's error (blank lines are skipped); the job's
    defaults for a line without its own ``max_new_tokens``, ``temperature``, ``seed`` and ``stop``.

    A repeated id is an error of the later line: results are keyed by id.
    """
    items: list[BatchItem] = []
    bad: list[BatchLineError] = []
    seen: dict[str, int] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"batch input {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise BatchLineError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            item = parse_line(text, number, str(path), max_new_tokens, temperature, seed, stop)
        except BatchLineError as exc:
            bad.append(exc)
            continue
        if item.id in seen:
            bad.append(
                BatchLineError(
                    f"{path}:{number}: id {item.id!r} already used on line {seen[item.id]}", number
                )
            )
            continue
        seen[item.id] = number
        items.append(item)
    return items, bad


class ResultsFile:
    """The append-only results JSONL: finished ids, one atomic fsynced line per result."""

    def __init__(self, path: str | Path):
        """Open (or create, with its folders) the results file and read the ids already in it.

        Raises:
            ValueError: ``path`` is a folder, cannot be read or written, or holds a line that is not a
                result (each names the path).
        """
        self.path = Path(path)
        self.done: set[str] = set()
        self.repaired = 0  # bytes of a torn last line cut off
        if self.path.is_dir():
            raise ValueError(f"results {self.path}: is a folder; name a file in it (e.g. {self.path / 'results.jsonl'})")
        above = next(p for p in self.path.parents if p.exists())
        if not above.is_dir():
            raise ValueError(f"results {self.path}: {above} is a file, not a folder")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._load()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"results {self.path}: cannot write it ({exc.strerror or exc})") from None

    def _load(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a line torn by a kill mid-write: never counted as done
            self.repaired = len(data) - end
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        for number, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                ident = json.loads(line)["id"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"results {self.path}:{number}: not a result line; refusing to append to it"
                ) from None
            self.done.add(str(ident))

    def append(self, result: dict[str, Any]) -> None:
        ident = str(result["id"])
        if ident in self.done:
            raise ValueError(f"results {self.path}: id {ident!r} is already there")
        line = (json.dumps(result, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, line)  # O_APPEND: one write, one line
        if written != len(line):
            raise OSError(f"results {self.path}: short write ({written} of {len(line)} bytes)")
        os.fsync(self._fd)
        self.done.add(ident)

    def close(self) -> None:
        os.close(self._fd)


def errors_path(out: str | Path) -> Path:
    """Where a job records prompts that failed: ``results.jsonl`` → ``results.errors.jsonl``."""
    out = Path(out)
    return out.with_name(out.stem + ".errors" + (out.suffix or ".jsonl"))


def append_error(out: str | Path, record: dict[str, Any]) -> None:
    """One error line (id or input line, and the message), fsynced."""
    with open(errors_path(out), "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Progress:
    """``[batch] 12/53 prompts  45.1 tok/s  ETA 1m05s`` on stderr: one rewritten line on a terminal,
    else a line at most every ``every_s`` seconds (job logs)."""

    def __init__(self, total: int, stream: TextIO | None = None, every_s: float = 5.0):
        self.total, self.done, self.tokens, self.failed = total, 0, 0, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self.t0 = time.monotonic()
        self._last = -math.inf

    def update(self, tokens: int = 0, failed: bool = False) -> None:
        self.done += 1
        self.tokens += tokens
        self.failed += failed
        now = time.monotonic()
        if self.tty or now - self._last >= self.every_s or self.done == self.total:
            self._last = now
            self.stream.write(("\r" if self.tty else "") + self.line() + ("" if self.tty else "\n"))
            self.stream.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.tokens / elapsed
        left = self.total - self.done
        eta = elapsed / self.done * left if self.done else math.inf
        failed = f"  {self.failed} failed" if self.failed else ""
        return f"[batch] {self.done}/{self.total} prompts  {rate:.1f} tok/s  ETA {_duration(eta)}{failed}"

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class StopSignal(threading.Event):
    """Set by the first SIGINT, SIGTERM or SIGHUP inside ``interrupts``; ``signum`` says which (0 until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.signum = 0


@contextlib.contextmanager
def interrupts() -> Iterator[StopSignal]:
    """Ctrl-C (SIGINT), SIGTERM (``kill``, ``ray job stop``) or SIGHUP (the terminal closed) as a
    request to stop between prompts: while inside, the first one sets the event (the job's loop sees it
    within its wait, gives up the prompts still running — the next run does them — and returns); a
    second raises ``KeyboardInterrupt`` (``Terminated`` for SIGTERM and SIGHUP), for a job that does
    not stop soon enough. ``specter.signals.handling``'s rules: a signal the process ignores stays
    ignored (``nohup``), the handlers are back afterwards, and outside the main thread, where no
    handler can be set, the event is never set."""
    stop = StopSignal()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise_for(signum)
        stop.signum = signum
        stop.set()
        name = signal_name(signum)
        with contextlib.suppress(OSError):  # stderr gone (a pipe closed): the stop goes on
            print(f"\n[batch] {name}: stopping; prompts still running are left to the next run "
                  f"({name.split(' ')[0]} again: at once)", file=sys.stderr, flush=True)

    with handling(on_signal):
        yield stop
