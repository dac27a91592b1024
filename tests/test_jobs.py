"""Batch files without Ray: input lines, the results file (atomic lines, resume, no duplicates), progress."""

from __future__ import annotations

import io
import json
import os
import signal
import threading

import pytest

from specter.eval.jobs import (
    BatchLineError,
    Progress,
    ResultsFile,
    append_error,
    errors_path,
    interrupts,
    parse_line,
    read_batch,
)
from specter.signals import Terminated, signal_of


def _parse(text: str):
    return parse_line(text, 7, "in.jsonl", 32, 0.0, 0)


def test_a_good_line_takes_defaults_and_overrides() -> None:
    item = _parse('{"id": 3, "prompt": "def f():", "max_new_tokens": 5, "seed": 9}')
    assert (item.id, item.prompt, item.line, item.max_new_tokens, item.temperature, item.seed) == (
        "3", "def f():", 7, 5, 0.0, 9)


def test_a_lines_stop_strings_replace_the_jobs_default() -> None:
    line = '{"id": 1, "prompt": "x"%s}'
    assert parse_line(line % "", 1, "in.jsonl", 32, 0.0, 0, ("\n\n",)).stop == ("\n\n",)
    assert parse_line(line % ', "stop": "def"', 1, "in.jsonl", 32, 0.0, 0, ("\n\n",)).stop == ("def",)
    assert parse_line(line % ', "stop": ["a", "b"]', 1, "in.jsonl", 32, 0.0, 0).stop == ("a", "b")
    assert _parse(line % "").stop == ()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{not json", "not valid JSON"),
        ('["id", "prompt"]', "JSON object"),
        ('{"prompt": "x"}', "'id'"),
        ('{"id": "", "prompt": "x"}', "'id'"),
        ('{"id": true, "prompt": "x"}', "'id'"),
        ('{"id": "a"}', "'prompt' must be a string"),
        ('{"id": "a", "prompt": 12}', "'prompt' must be a string"),
        ('{"id": "a", "prompt": "   "}', "'prompt' must not be empty"),
        ('{"id": "a", "prompt": "x", "max_new_tokens": 0}', "'max_new_tokens'"),
        ('{"id": "a", "prompt": "x", "max_new_tokens": 1e12}', "'max_new_tokens'"),
        ('{"id": "a", "prompt": "x", "max_new_tokens": 99999999999}', "'max_new_tokens'"),
        ('{"id": "a", "prompt": "x", "temperature": -1}', "'temperature'"),
        ('{"id": "a", "prompt": "x", "temperature": NaN}', "'temperature'"),
        ('{"id": "a", "prompt": "x", "seed": -3}', "'seed'"),
        ('{"id": "a", "prompt": "x", "top_p": 0.5}', "unknown field"),
        ('{"id": "a", "prompt": "x", "stop": ""}', "'stop': expected a non-empty string or a list of up to 4"),
        ('{"id": "a", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "'stop'"),
        ('{"id": "a", "prompt": "x", "stop": 3}', "'stop'"),
    ],
)
def test_a_bad_line_names_file_line_and_field(text: str, field: str) -> None:
    with pytest.raises(BatchLineError, match=field) as info:
        _parse(text)
    assert str(info.value).startswith("in.jsonl:7: ") and info.value.line == 7


def test_read_batch_reports_every_bad_line_and_repeated_ids(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n\n{"id": "b"}\n{"id": "a", "prompt": "y"}\n{"id": "c", "prompt": "z"}\n')
    items, bad = read_batch(path, 16, 0.0, 0)
    assert [i.id for i in items] == ["a", "c"] and [i.line for i in items] == [1, 5]
    assert [e.line for e in bad] == [3, 4]
    assert "already used on line 1" in str(bad[1])


def test_read_batch_missing_or_binary_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_batch(tmp_path / "nope.jsonl", 16, 0.0, 0)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(BatchLineError, match="not UTF-8"):
        read_batch(tmp_path / "bin.jsonl", 16, 0.0, 0)


def test_results_file_appends_whole_lines_resumes_and_refuses_duplicates(tmp_path) -> None:
    out = tmp_path / "sub" / "results.jsonl"
    results = ResultsFile(out)
    results.append({"id": "a", "text": "t", "tokens": [1], "stats": {}})
    with pytest.raises(ValueError, match="'a' is already there"):
        results.append({"id": "a", "text": "t", "tokens": [1], "stats": {}})
    results.close()
    with open(out, "ab") as f:  # a kill in the middle of the next write
        f.write(b'{"id": "b", "te')
    again = ResultsFile(out)
    assert again.done == {"a"} and again.repaired == len(b'{"id": "b", "te')
    again.append({"id": "b", "text": "u", "tokens": [2], "stats": {}})
    again.close()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_results_file_that_is_not_ours_is_refused(tmp_path) -> None:
    out = tmp_path / "results.jsonl"
    out.write_text('{"id": "a"}\nhello\n')
    with pytest.raises(ValueError, match="results.jsonl:2: not a result line"):
        ResultsFile(out)


def test_a_results_path_that_cannot_be_a_results_file_is_one_line_naming_it(tmp_path) -> None:
    """A folder, or a path under a file, is refused with a ``ValueError`` naming it (``specter batch``
    prints it in one line, before Ray starts); before, ``IsADirectoryError``'s traceback."""
    with pytest.raises(ValueError, match=r"is a folder; name a file in it") as caught:
        ResultsFile(tmp_path)
    assert str(tmp_path) in str(caught.value)
    (tmp_path / "plain").write_text("")
    with pytest.raises(ValueError, match=r"plain is a file, not a folder"):
        ResultsFile(tmp_path / "plain" / "results.jsonl")


def test_errors_go_next_to_the_results(tmp_path) -> None:
    out = tmp_path / "results.jsonl"
    append_error(out, {"id": "x", "error": "boom"})
    assert errors_path(out).name == "results.errors.jsonl"
    assert json.loads(errors_path(out).read_text()) == {"id": "x", "error": "boom"}


def test_progress_line_counts_rate_and_eta() -> None:
    stream = io.StringIO()
    progress = Progress(4, stream=stream, every_s=0.0)
    progress.update(tokens=10)
    progress.update(failed=True)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[batch] 1/4 prompts") and "tok/s" in lines[0] and "ETA" in lines[0]
    assert "2/4 prompts" in lines[1] and "1 failed" in lines[1]


@pytest.mark.parametrize(("signum", "raised", "name"), [(signal.SIGINT, KeyboardInterrupt, "Ctrl-C"),
                                                       (signal.SIGTERM, Terminated, "SIGTERM"),
                                                       (signal.SIGHUP, Terminated, "SIGHUP (the terminal closed)")])
def test_ctrl_c_sigterm_or_sighup_in_a_job_is_a_flag_then_a_second_one_interrupts(capsys, signum, raised, name) -> None:
    """Inside ``interrupts`` the first SIGINT, SIGTERM or SIGHUP only sets the event, saying which (the
    job stops between prompts, and says so on stderr); a second raises (``Terminated`` for SIGTERM and
    SIGHUP); the handlers are back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with interrupts() as stop:
        os.kill(os.getpid(), signum)
        for _ in range(1000):  # the handler runs between two bytecodes of this thread
            if stop.is_set():
                break
        assert stop.is_set() and stop.signum == signum
        assert f"{name}: stopping" in capsys.readouterr().err
        with pytest.raises(raised) as caught:
            os.kill(os.getpid(), signum)
            for _ in range(1000):
                pass
        assert type(caught.value) is raised and signal_of(caught.value) == signum
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_outside_the_main_thread_a_job_keeps_pythons_sigint_handler_and_the_sigterm_one() -> None:
    seen = []

    def job() -> None:
        sigterm = signal.getsignal(signal.SIGTERM)
        with interrupts() as stop:
            seen.append((stop.is_set(), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM) is sigterm))

    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert seen == [(False, signal.default_int_handler, True)]
