"""``specter generate``: the CLI contract (flags, --json) and one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from specter.cli import main


def test_generate_json_matches_transformers(tiny_dir, capsys):
    folder = tiny_dir("qwen2_moe")
    code = main(["generate", "--model", str(folder), "--prompt-ids", "4,8,15,16,23", "--max-new-tokens", "6",
                 "--budget", "0.4", "--link", "sim:2,5", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([[4, 8, 15, 16, 23]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert result["tokens"] == out[0, 5:].tolist()
    stats = result["stats"]
    assert {"tpot_s", "hits", "misses", "bytes_moved"} <= set(stats)
    assert stats["hits"] + stats["misses"] > 0 and stats["tpot_s"] > 0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--budget", "1.5"], "--budget"),
        (["--budget", "abc"], "--budget"),
        (["--link", "pcie9"], "--link"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--policy", "magic"], "--policy"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--threads", "0"], "--threads"),
        (["--link", "cuda", "--processes", "--device", "cpu"], "--link"),  # no CUDA device to put it on
        (["--device", "tpu"], "--device"),
        (["--device", "cuda:99"], "--device"),  # no such CUDA device (none at all on a CPU machine)
        (["--stop", ""], "--stop"),
        (["--stop", "a"] * 5, "--stop"),  # up to four
        (["--stop", "x", "--json"], "--stop"),  # this checkpoint has no tokenizer to match text with
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(tiny_dir, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(tiny_dir("mixtral")), "--prompt-ids", "1,2"] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err


def test_load_errors_are_one_line_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "specter.cli", "generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"specter: error: model folder '{tmp_path / 'missing'}' does not exist"]


_ENTRY = """
import atexit, sys
from specter.cli import entry
atexit.register(lambda: print("exit handler ran", file=sys.stderr))
sys.argv = ["specter", *sys.argv[1:]]
entry()
"""


@pytest.mark.parametrize("good", [True, False])
def test_the_command_ends_with_mains_status_its_output_flushed_and_the_exit_handlers_run(tiny_dir, good):
    """``entry`` (the console script, ``python -m specter.cli``) skips the interpreter's teardown, not
    what a normal exit does first: the JSON line is all there, a registered exit handler ran, and the
    status is ``main``'s."""
    model = tiny_dir("olmoe") if good else tiny_dir("olmoe") / "missing"
    proc = subprocess.run([sys.executable, "-c", _ENTRY, "generate", "--model", str(model), "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == (0 if good else 1), proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "exit handler ran"
    if good:
        assert len(json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]) == 3


@pytest.mark.parametrize(("signum", "status", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                        (signal.SIGTERM, 143, "terminated"),
                                                        (signal.SIGHUP, 129, "hung up")])
def test_ctrl_c_sigterm_or_sighup_ends_a_command_with_its_status_and_one_line(tiny_dir, capsys, monkeypatch, signum,
                                                                               status, word):
    """Ctrl-C (SIGINT), SIGTERM (``kill``, ``ray job stop``) or SIGHUP (the terminal closed), a real
    signal inside a command: status 128 + the signal (as a shell gives one the signal killed), one line
    on stderr and no traceback, no result printed, what the command opened closed on the way out, and
    the SIGTERM and SIGHUP handlers back after."""
    from specter.engine import Engine
    from specter.target import OffloadedTarget

    closed = []
    close = OffloadedTarget.close
    monkeypatch.setattr(OffloadedTarget, "close", lambda self: (closed.append(self), close(self))[1])

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)
        for _ in range(10 ** 6):  # the handler runs between two bytecodes of this thread
            pass
        raise AssertionError(f"signal {signum} did not stop the command")

    monkeypatch.setattr(Engine, "generate_fresh", signalled)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_dir("mixtral")), "--prompt-ids", "1,2,3", "--json"]) == status
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines()[-1] == f"specter: {word}"
    assert "Traceback" not in captured.err and len(closed) == 1
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


@pytest.mark.parametrize("where", [[], ["--address", "none"], ["--processes"]])
def test_a_request_past_the_context_is_refused_before_a_model_loads_or_a_replica_starts(tiny_dir, capsys, monkeypatch,
                                                                                        where):
    """``--max-new-tokens`` past the model's context (from its config.json) is refused in one line
    naming the flag, before the model loads in process, the actors launch or the role processes
    start (a large model: minutes of each); before, only the engine said so, after all of that."""
    import actors.client
    import specter.remote.processes
    from specter.target import OffloadedTarget

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the request was checked")

    monkeypatch.setattr(OffloadedTarget, "load", no_work)
    monkeypatch.setattr(actors.client.Client, "__init__", no_work)
    monkeypatch.setattr(specter.remote.processes, "launch_processes", no_work)
    model = tiny_dir("mixtral")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert main(["generate", "--model", str(model), "--prompt-ids", "1,2,3", "--max-new-tokens", str(context),
                 *where]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("specter: error: max_new_tokens: prompt (3 tokens)")
    assert f"exceeds the model's context of {context} positions" in err


def test_budget_below_minimum_is_refused(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir("mixtral")), "--prompt-ids", "1", "--budget", "0.05"]) == 1
    assert "minimum is 2 slots" in capsys.readouterr().err


def test_link_profile_sets_a_simulated_link_from_the_measured_step(tiny_dir, capsys):
    folder = tiny_dir("mixtral")
    capsys.readouterr()
    assert main(["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                 "--link", "dsv2lite-pcie4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "clock wall (profile dsv2lite-pcie4, rho 13.1, link" in captured.err
    stats = json.loads(captured.out.strip().splitlines()[-1])["stats"]
    assert stats["misses"] >= 0 and stats["clock"] == "wall"


def test_threads_flag_sets_torch_threads_and_the_default_leaves_the_link_a_core(tiny_dir, capsys, monkeypatch):
    before = torch.get_num_threads()
    try:
        code = main(["generate", "--model", str(tiny_dir("mixtral")), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                     "--threads", "3", "--json"])
        assert code == 0 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    from specter.config import compute_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert compute_threads() == 7 and compute_threads(2) == 2
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert compute_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert compute_threads() == 5
    with pytest.raises(ValueError, match="threads"):
        compute_threads(0)


def test_the_embedded_model_drafts_with_its_shipped_draft_unless_told_otherwise(tiny_dir, capsys):
    """README: ``--draft`` defaults, for the embedded model, to its shipped AWQ draft when the run drafts;
    another model's drafting run still has to name its draft."""
    argv = ["generate", "--prompt-ids", "5,99,17,42", "--max-new-tokens", "4", "--link", "sim:2,5", "--json"]
    assert main(argv + ["--policy", "specter+fixed", "--window", "2"]) == 0
    drafted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(argv) == 0  # demand-lru: no draft loaded, none needed
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert drafted["tokens"] == plain["tokens"]  # lossless
    assert drafted["stats"]["rounds"] > 0 and drafted["stats"]["drafted"] > 0 and plain["stats"]["drafted"] == 0
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(tiny_dir("mixtral")), "--prompt-ids", "1,2", "--policy", "specter"])
    assert exc.value.code == 2 and "--draft" in capsys.readouterr().err


def test_the_command_lines_policy_and_option_lists_are_the_policies_own():
    """``specter/cli/names.py`` lists them without importing the policies; these are what they must be."""
    from specter.cli.names import OPTION_NAMES, POLICY_NAMES
    from specter.plan import OPTIONS, POLICIES

    assert tuple(POLICIES) == POLICY_NAMES
    assert tuple(OPTIONS) == OPTION_NAMES


def test_help_answers_without_importing_torch():
    """``specter --help`` and a command's ``--help`` build the whole parser and print it without torch
    (a second on two cores); a run imports it once its arguments parsed."""
    probe = ("import sys\nfrom specter.cli import main\n"
             "for argv in (['--help'], ['generate', '--help'], ['bench', '--help'], ['quantize', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit as exc:\n        assert exc.code == 0, (argv, exc.code)\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_generate_stops_at_a_stop_string_as_transformers_stop_strings_does(monkeypatch, capsys) -> None:
    """``--stop``: the request ends at the round that wrote the stop (fewer tokens made than asked), the
    tokens are transformers' ``generate(stop_strings=…)``'s, the text ends before the stop, and the
    printed text too; ``\\n`` is a newline."""
    from transformers import AutoTokenizer

    from specter.assets import ASSETS

    model, prompt, new = ASSETS / "moe-fine", "def fibonacci(n):", 48
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ref = AutoModelForCausalLM.from_pretrained(str(model), experts_implementation="eager", dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(prompt)])
    argv = ["generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", str(new)]
    for stops, policy in ((["th, se"], "demand-lru"), (["get", "\\n    \\n"], "specter")):
        read = [s.replace("\\n", "\n") for s in stops]
        want = ref.generate(ids, max_new_tokens=new, do_sample=False, stop_strings=read,
                            tokenizer=tokenizer)[0, ids.shape[1]:].tolist()
        assert len(want) < new
        stop_flags = [flag for stop in stops for flag in ("--stop", stop)]
        assert main(argv + stop_flags + ["--policy", policy, "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        text = tokenizer.decode(want)
        before = text[:min(text.index(s) for s in read if s in text)]
        assert out["tokens"] == want and out["text"] == before
        assert out["stats"]["stop"] and not out["stats"]["cancelled"] and out["stats"]["new_tokens"] < new
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        assert main(argv + stop_flags + ["--policy", policy]) == 0
        monkeypatch.undo()
        assert "".join(terminal.pieces) == prompt + before + "\n"
        assert f"ended at a stop string ({len(want)} tokens up to it)]" in capsys.readouterr().err


def test_a_prompt_file_or_standard_input_is_the_prompt_as_it_is(tmp_path, monkeypatch, capsys) -> None:
    """``--prompt-file`` (``-``: standard input) runs the file's exact text — its trailing newline
    included, which a shell's ``$(cat …)`` drops — as ``--prompt`` with that text does; a file that
    cannot be read, is not UTF-8 or holds only blanks ends with status 2 and one line naming it."""
    import io

    from specter.assets import ASSETS

    model, text = str(ASSETS / "moe-fine"), "def fibonacci(n):\n"
    (tmp_path / "p.py").write_text(text)
    args = ["generate", "--model", model, "--max-new-tokens", "6", "--json"]
    assert main(args + ["--prompt", text]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--prompt", text.rstrip()]) == 0  # what $(cat p.py) would give
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] != want["tokens"]
    assert main(args + ["--prompt-file", str(tmp_path / "p.py")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == want["tokens"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(args + ["--prompt-file", "-"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == want["tokens"]
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "blank.txt").write_text(" \n")
    for path, said in ((tmp_path / "nope.txt", "cannot read"), (tmp_path / "latin1.txt", "is not UTF-8 text"),
                       (tmp_path / "blank.txt", "must not be empty"), (tmp_path, "cannot read")):
        with pytest.raises(SystemExit) as exc:
            main(args + ["--prompt-file", str(path)])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and "--prompt-file" in err and said in err, err


class _Terminal:
    """A stdout that keeps each write apart."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_generate_prints_the_text_as_it_commits(monkeypatch, capsys) -> None:
    """``specter generate`` writes the prompt and then each piece of text as the engine commits its
    tokens, not all at the end: in all, the prompt, transformers' greedy text on the shipped model and a
    newline, as the whole-text print wrote it. (Through ``--address`` and ``--processes`` the same
    printer is fed by ``EngineHandle.stream`` and the verifier process's pipe: ``tests/actors``.)"""
    from transformers import AutoTokenizer

    from specter.assets import ASSETS
    from specter.engine import Engine

    model, prompt, new = ASSETS / "moe-fine", "def fibonacci(n):", 24
    terminal = _Terminal()
    written_at_commits: list[int] = []
    generate_fresh = Engine.generate_fresh

    def watched(self, *args, on_tokens=None, **kwargs):  # type: ignore[no-untyped-def]
        def on_commit(tokens):  # type: ignore[no-untyped-def]
            written_at_commits.append(len(terminal.pieces))
            on_tokens(tokens)

        return generate_fresh(self, *args, on_tokens=on_commit, **kwargs)

    monkeypatch.setattr(Engine, "generate_fresh", watched)
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", str(new)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.encode(prompt)
    ref = AutoModelForCausalLM.from_pretrained(str(model), experts_implementation="eager", dtype=torch.float32)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
    assert "".join(terminal.pieces) == prompt + tokenizer.decode(want) + "\n"
    assert terminal.pieces[0].startswith(prompt) and len(terminal.pieces) > 3
    assert written_at_commits[-1] > 1  # pieces were out before the last tokens committed
    assert "TPOT" in capsys.readouterr().err
