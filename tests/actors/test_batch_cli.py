"""`specter batch` end to end on the shipped model: text in, results out, bad lines, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specter.assets import ASSETS

MODEL, DRAFT = ASSETS / "moe-fine", ASSETS / "moe-fine-awq"
NEW = 6
PROMPTS = {"a": "def parse_args(argv):", "b": "import os\n", "c": "class Config:"}


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
    src = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": "a", "prompt": PROMPTS["a"]}), '{"id": "bad", "prompt": 7}',
             json.dumps({"id": "b", "prompt": PROMPTS["b"], "max_new_tokens": 3}),
             json.dumps({"id": "c", "prompt": PROMPTS["c"]})]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"

    code, stderr = _batch_here(capsys, str(src), "--out", str(out), "--on-bad-line", "stop")
    assert code == 1 and f"{src}:2: 'prompt' must be a string" in stderr
    assert not out.exists()  # nothing ran

    cache = tmp_path / "choosers"
    first = _batch(str(src), "--out", str(out), "--chooser-cache", str(cache))
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(list(cache.iterdir())) == 1 and "K chooser kept" not in first.stderr
    assert f"{src}:2:" in first.stderr and "3 to run" in first.stderr and "3 finished, 0 failed" in first.stderr
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["a", "b", "c"]
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    ref = AutoModelForCausalLM.from_pretrained(str(MODEL), experts_implementation="eager", dtype=torch.float32)
    for ident, row in rows.items():
        ids = tokenizer.encode(PROMPTS[ident])
        n = 3 if ident == "b" else NEW
        want = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        assert row["tokens"] == want, ident
        assert row["text"] == tokenizer.decode(want)
        assert row["stats"]["policy"] == "specter" and row["stats"]["new_tokens"] == len(want)

    code, stderr = _batch_here(capsys, str(src), "--out", str(out))
    assert code == 0 and "3 already in" in stderr and "0 to run" in stderr
    assert len(out.read_text().splitlines()) == 3

    # another batch of the same setup starts from the K chooser the first one left (speed only)
    again = _batch(str(src), "--out", str(tmp_path / "again.jsonl"), "--chooser-cache", str(cache))
    assert again.returncode == 0 and "K chooser kept from 3 earlier request(s)" in again.stderr, again.stderr[-3000:]
    assert {row["id"]: row["tokens"] for row in map(json.loads, (tmp_path / "again.jsonl").read_text().splitlines())} \
        == {ident: row["tokens"] for ident, row in rows.items()}
    assert json.loads(next(cache.iterdir()).read_text())["chooser"]["requests"] == 6
