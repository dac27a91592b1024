"""``specter serve --policy specter`` keeps its K choosers between runs: a server stopped with Ctrl-C
(or, the second one, SIGTERM to its process group) leaves its batcher's choosers (one per number of requests drafting together) in ``--chooser-cache``,
and the next server of the same setup starts from them, says so, and answers with the same text."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
from serve_process import serving

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def", "for i in range(10):"]


def _serve(cache: Path, log_path: Path, how: str) -> tuple[list[str], str]:
    """One server's life: start it, complete the four prompts at once (greedy), stop it ``how``
    (``serve_process.stop``); its texts and log."""
    with serving(["--policy", "specter", "--chooser-cache", str(cache)], log_path, how) as (url, _, _):

        def complete(prompt: str) -> str:
            body = {"model": "moe-fine", "prompt": prompt, "max_tokens": 24, "temperature": 0}
            return str(httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
    return texts, log_path.read_text()


def test_a_restarted_server_starts_from_the_choosers_the_last_one_kept(tmp_path):
    cache = tmp_path / "choosers"
    first, log = _serve(cache, tmp_path / "first.log", "ctrl-c")
    assert "K choosers kept" not in log
    said = (f"specter: stopped serving 'moe-fine': {len(PROMPTS)} request(s) completed, 0 cancelled by their "
            "client, 0 refused with 429 (queue full), 0 failed")
    assert log.rstrip().splitlines()[-1] == said, log[-2000:]  # its last line, after Ray's about the stop
    [kept_file] = list(cache.iterdir())
    record = json.loads(kept_file.read_text())
    assert record["requests"] == len(PROMPTS) and record["setup"]["server"] is True
    assert record["choosers"] and all(int(n) >= 1 for n in record["choosers"])
    samples = {n: sum(state["samples"].values()) for n, state in record["choosers"].items()}

    # stopped as a service manager stops it: SIGTERM to its process group (before: the embedded Ray's
    # processes died with it and the server's stop waited 60 s on them, then ended with status 1)
    second, log = _serve(cache, tmp_path / "second.log", "sigterm-group")
    assert f"K choosers kept from {len(PROMPTS)} earlier request(s)" in log
    assert said in log, log[-2000:]
    assert second == first  # greedy: the same text whatever K the choosers play
    record = json.loads(kept_file.read_text())
    assert record["requests"] == 2 * len(PROMPTS)
    for n, count in samples.items():  # the second server went on from the first one's choosers
        assert sum(record["choosers"][n]["samples"].values()) >= count
    assert list(cache.iterdir()) == [kept_file]  # the same setup, the same file
