"""`specter batch` end to end on the shipped model: text in, results out, bad lines, resume, a terminal
that closes under it."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specter.assets import ASSETS
from specter.eval.jobs import ResultsFile

MODEL, DRAFT = ASSETS / "moe-fine", ASSETS / "moe-fine-awq"
NEW = 6
PROMPTS = {"a": "def parse_args(argv):", "b": "import os\n", "c": "class Config:", "d": "def fibonacci(n):"}
JOB_STOP = "the f"  # the job's --stop, for the lines without their own: a's text has it, spanning two tokens


def _args(*args: str) -> list[str]:
    return ["batch", *args, "--model", str(MODEL), "--draft", str(DRAFT), "--policy", "specter", "--window", "3",
            "--max-new-tokens", str(NEW), "--link", "sim:4"]


def _batch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "specter.cli", *_args(*args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _batch_here(capsys, *args: str) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """``specter batch`` in this process, for the runs that end before any Ray would start (a bad line
    with ``--on-bad-line stop``, nothing left to run): its exit status and stderr."""
    import ray

    from specter.cli import main

    capsys.readouterr()
    code = main(_args(*args))
    assert not ray.is_initialized()  # they never start one
    return code, capsys.readouterr().err


def test_batch_cli_generates_skips_bad_lines_and_resumes(tmp_path, capsys) -> None:
    """Results equal transformers' greedy ``generate`` — with ``stop_strings`` where a line has its own
    ``stop`` (d) or takes the job's ``--stop`` (the others), each ending before its stop; a bad line is
    named and skipped; a re-run resumes; a second batch of the same setup starts from the K chooser."""
    src = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": "a", "prompt": PROMPTS["a"]}), '{"id": "bad", "prompt": 7}',
             json.dumps({"id": "b", "prompt": PROMPTS["b"], "max_new_tokens": 3}),
             json.dumps({"id": "c", "prompt": PROMPTS["c"]}),
             json.dumps({"id": "d", "prompt": PROMPTS["d"], "max_new_tokens": 40, "stop": ["get", "never"]})]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"

    code, stderr = _batch_here(capsys, str(src), "--out", str(out), "--on-bad-line", "stop")
    assert code == 1 and f"{src}:2: 'prompt' must be a string" in stderr
    assert not out.exists()  # nothing ran

    cache = tmp_path / "choosers"
    first = _batch(str(src), "--out", str(out), "--chooser-cache", str(cache), "--stop", JOB_STOP)
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(list(cache.iterdir())) == 1 and "K chooser kept" not in first.stderr
    assert f"{src}:2:" in first.stderr and "4 to run" in first.stderr and "4 finished, 0 failed" in first.stderr
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["a", "b", "c", "d"]
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    ref = AutoModelForCausalLM.from_pretrained(str(MODEL), experts_implementation="eager", dtype=torch.float32)
    for ident, row in rows.items():
        ids = tokenizer.encode(PROMPTS[ident])
        n, stops = {"b": (3, [JOB_STOP]), "d": (40, ["get", "never"])}.get(ident, (NEW, [JOB_STOP]))
        want = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, stop_strings=stops,
                            tokenizer=tokenizer)[0, len(ids):].tolist()
        assert row["tokens"] == want, ident
        text = tokenizer.decode(want)
        assert row["text"] == text[:min([text.index(s) for s in stops if s in text] or [len(text)])]
        assert row["stats"]["policy"] == "specter" and row["stats"]["stop"] == (len(want) < n)
    assert rows["d"]["stats"]["stop"] and rows["d"]["stats"]["new_tokens"] < 40  # it ended at the stop
    assert rows["a"]["stats"]["stop"]  # at the job's

    code, stderr = _batch_here(capsys, str(src), "--out", str(out))
    assert code == 0 and "4 already in" in stderr and "0 to run" in stderr
    assert len(out.read_text().splitlines()) == 4

    # another batch of the same setup starts from the K chooser the first one left (speed only)
    again = _batch(str(src), "--out", str(tmp_path / "again.jsonl"), "--chooser-cache", str(cache), "--stop", JOB_STOP)
    assert again.returncode == 0 and "K chooser kept from 4 earlier request(s)" in again.stderr, again.stderr[-3000:]
    assert {row["id"]: row["tokens"] for row in map(json.loads, (tmp_path / "again.jsonl").read_text().splitlines())} \
        == {ident: row["tokens"] for ident, row in rows.items()}
    assert json.loads(next(cache.iterdir()).read_text())["chooser"]["requests"] == 8


def test_a_line_past_the_context_is_a_bad_line_before_any_replica_starts(tmp_path, capsys) -> None:
    """A line whose prompt + ``max_new_tokens`` + window exceed the model's context is named with its
    file and line before Ray starts — under ``--on-bad-line stop`` nothing runs (before: the job started,
    and the verifier refused that prompt once its turn came)."""
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"id": "ok", "prompt": PROMPTS["a"]}) + "\n"
                   + json.dumps({"id": "long", "prompt": PROMPTS["a"], "max_new_tokens": 1020}) + "\n")
    out = tmp_path / "results.jsonl"
    code, stderr = _batch_here(capsys, str(src), "--out", str(out), "--on-bad-line", "stop")
    assert code == 1 and not out.exists(), stderr
    assert f"{src}:2: max_new_tokens: prompt (" in stderr and "+ max_new_tokens (1020) + window (3)" in stderr
    assert "exceeds the model's context of 1024 positions" in stderr and "1 bad line(s)" in stderr


BOOT = "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.executable, sys.argv[1:])"


def test_a_closed_terminal_stops_specter_batch_between_prompts_and_keeps_its_chooser(tmp_path) -> None:
    """``specter batch`` in a terminal that closes (a window, an ssh connection that dropped; here the
    pty's master side closed once the first result is in): the kernel hangs the terminal up and sends
    SIGHUP. The batch stops between prompts as on Ctrl-C — status 129, the finished results kept for
    the next run, the K chooser saved — where before the signal killed it on the spot (the chooser
    lost), and its last lines, which the dead terminal would refuse, do not end it in an error."""
    src, out, cache = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl", tmp_path / "choosers"
    total = 24
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"def step_{i}(x):"}) + "\n" for i in range(total)))
    master, slave = pty.openpty()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    command = [sys.executable, "-m", "specter.cli", *_args(str(src), "--out", str(out), "--chooser-cache", str(cache))]
    # the command leads a session of its own with the pty as its controlling terminal, as a terminal starts one
    proc = subprocess.Popen([sys.executable, "-c", BOOT, *command], stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)
    os.close(slave)
    shown = bytearray()  # what the terminal showed: read on, or the command blocks on a full terminal
    deadline = time.monotonic() + 600
    try:
        while not (out.exists() and out.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    shown += os.read(master, 65536)
    finally:
        os.close(master)  # the terminal closes: SIGHUP to the command, which leads its session
    code = proc.wait(timeout=120)
    assert code == 129, f"status {code}; the terminal showed:\n{shown.decode(errors='replace')[-3000:]}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(rows) < total and len({row["id"] for row in rows}) == len(rows)
    assert ResultsFile(out).done == {row["id"] for row in rows}  # what the next run skips
    [kept] = list(cache.iterdir())
    assert json.loads(kept.read_text())["chooser"]["requests"] >= len(rows)
