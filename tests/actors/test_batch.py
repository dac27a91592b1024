"""Batch jobs through replicas of the actors: results once each, resume, bad requests, faults.

The reference is transformers' greedy ``generate`` on the same checkpoint. Faults: an actor of a
replica is killed (``ray.kill`` or SIGKILL of its worker) or stopped (SIGSTOP: a silent peer) while
the batch runs; the batch must still finish with every prompt exactly once, identical to the
reference, the silent peer detected by a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from faults import KillInRequest
from transformers import AutoModelForCausalLM

from actors.batch import BatchOptions, run_batch
from actors.launcher import launch
from specter.config import LinkConfig, SlotConfig
from specter.eval.jobs import BatchItem, ResultsFile, errors_path

LINK = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)
NEW = 8
TIMEOUT_S = 20.0  # the replica's waits; a killed peer is seen well before (``specter/remote/peers.py``)
LONG = 96  # the request a fault lands in: long enough that the kill, fired inside it, lands inside it
TEXTS = ["alpha beta", "gamma", "delta epsilon zeta", "eta theta", "iota kappa lambda mu", "nu"]


def encode(text: str) -> list[int]:
    return [1 + (ord(c) * 7) % 120 for c in text]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def reference(models) -> dict[str, list[int]]:
    model = AutoModelForCausalLM.from_pretrained(models[0], experts_implementation="eager")
    out = {}
    for i, text in enumerate(TEXTS):
        ids = encode(text)
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out[f"p{i}"] = gen[0, len(ids) :].tolist()
    return out


@pytest.fixture(scope="module")
def long_reference(models) -> list[int]:
    """transformers' greedy continuation of prompt p1 to ``LONG`` tokens."""
    model = AutoModelForCausalLM.from_pretrained(models[0], experts_implementation="eager")
    ids = encode(TEXTS[1])
    gen = model.generate(torch.tensor([ids]), max_new_tokens=LONG, min_new_tokens=LONG, do_sample=False)
    return gen[0, len(ids) :].tolist()


def _items(n: int = len(TEXTS)) -> list[BatchItem]:
    return [BatchItem(f"p{i}", TEXTS[i], i + 1, NEW, 0.0, 0) for i in range(n)]


def _options(models, replicas: int = 1, **kw) -> BatchOptions:
    folder, draft = models
    return BatchOptions(str(folder), str(draft), SlotConfig(fraction=0.25), LINK, policy="specter+fixed", window=3,
                        replicas=replicas, **kw)


def _read(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_two_replicas_every_prompt_once_identical_then_resume(local_ray, models, reference, tmp_path) -> None:
    out = tmp_path / "results.jsonl"
    results = ResultsFile(out)
    report = run_batch(_items(), results, out, _options(models, replicas=2), encode, decode)
    results.close()
    rows = _read(out)
    assert sorted(r["id"] for r in rows) == sorted(reference)
    for row in rows:
        assert row["tokens"] == reference[row["id"]], row["id"]
        assert row["text"] == decode(row["tokens"])
        assert row["stats"]["new_tokens"] == NEW and row["stats"]["policy"] == "specter+fixed"
    assert report.finished == len(TEXTS) and report.failed == 0 and report.restarts == 0
    # A re-run resumes: nothing to do, nothing written twice, no replica launched.
    launched = []
    results = ResultsFile(out)
    report = run_batch(_items(), results, out, _options(models), encode, decode,
                       launcher=lambda *a, **k: launched.append(a) or launch(*a, **k))
    results.close()
    assert report.skipped == len(TEXTS) and report.finished == 0
    assert _read(out) == rows


def test_a_batch_hands_its_k_chooser_on(local_ray, models, reference, tmp_path) -> None:
    """``specter batch`` keeps its K chooser between runs as ``generate`` does: given a state (``{}``:
    none), the report carries the chooser of the replica that served most, and the next batch's replica
    starts from it; the results hold only tokens, text and stats, identical to the reference."""
    items = _items(3)
    first = ResultsFile(tmp_path / "a.jsonl")
    report = run_batch(items, first, tmp_path / "a.jsonl", _specter(models, {}), encode, decode)
    first.close()
    assert report.finished == 3 and report.chooser is not None and report.chooser["requests"] == 3
    second = ResultsFile(tmp_path / "b.jsonl")
    again = run_batch(items, second, tmp_path / "b.jsonl", _specter(models, report.chooser), encode, decode)
    second.close()
    assert again.chooser is not None and again.chooser["requests"] == 6  # went on from the first batch's
    for out in ("a.jsonl", "b.jsonl"):
        rows = _read(tmp_path / out)
        assert {row["id"]: row["tokens"] for row in rows} == {k: reference[k] for k in ("p0", "p1", "p2")}
        assert all(set(row) == {"id", "text", "tokens", "stats"} for row in rows)


def _specter(models, chooser) -> BatchOptions:
    folder, draft = models
    return BatchOptions(str(folder), str(draft), SlotConfig(fraction=0.25), LINK, policy="specter", window=3,
                        chooser=chooser)


def test_resume_after_a_torn_line_runs_only_the_rest(local_ray, models, reference, tmp_path) -> None:
    out = tmp_path / "results.jsonl"
    first = {"id": "p0", "text": "", "tokens": reference["p0"], "stats": {}}
    out.write_text(json.dumps(first) + "\n" + '{"id": "p1", "text": "tor')  # killed mid-write
    results = ResultsFile(out)
    assert results.done == {"p0"} and results.repaired > 0
    seen: list[str] = []
    report = run_batch(_items(3), results, out, _options(models), encode, decode,
                       on_result=lambda r: seen.append(r["id"]))
    results.close()
    assert sorted(seen) == ["p1", "p2"] and report.skipped == 1
    rows = _read(out)
    assert [r["id"] for r in rows].count("p1") == 1 and len(rows) == 3
    assert all(r["tokens"] == reference[r["id"]] for r in rows)


def test_ctrl_c_stops_specter_batch_between_prompts_and_keeps_what_finished(local_ray, tmp_path, capsys) -> None:
    """Ctrl-C (a real SIGINT, once the first result is in) in ``specter batch``: the loop stops between
    prompts, the replica's actors are gone, the finished results stay (each transformers' own, what the
    next run skips), and the command says how many are left and how to go on, with status 130 and no
    traceback."""
    from transformers import AutoTokenizer

    from specter.assets import ASSETS
    from specter.cli import main

    model = ASSETS / "moe-fine"
    prompts = {f"q{i}": f"def step_{i}(x):" for i in range(8)}
    src, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in prompts.items()))

    def ctrl_c_after_the_first_result() -> None:
        while not (out.exists() and out.read_text()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, lambda *_: None)  # one landing outside the batch's loop: not pytest's
    watcher = threading.Thread(target=ctrl_c_after_the_first_result, daemon=True)
    watcher.start()
    try:
        code = main(["batch", str(src), "--out", str(out), "--model", str(model), "--policy", "demand-lru",
                     "--max-new-tokens", "6", "--link", "sim:4"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    rows = _read(out)
    left = len(prompts) - len(rows)
    assert code == 130 and left > 0, err[-3000:]
    assert f"specter batch: interrupted, {left} left" in err and "Traceback" not in err
    assert f"re-run the same command to go on with the {left} left" in err
    assert ResultsFile(out).done == {row["id"] for row in rows}  # what the next run skips
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ref = AutoModelForCausalLM.from_pretrained(str(model), experts_implementation="eager", dtype=torch.float32)
    for row in rows:
        ids = tokenizer.encode(prompts[row["id"]])
        assert row["tokens"] == ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    deadline = time.monotonic() + 60
    while [a for a in ray.util.list_named_actors() if a.startswith("specter-r")] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [a for a in ray.util.list_named_actors() if a.startswith("specter-r")]


def test_a_bad_request_is_recorded_and_the_rest_finish(local_ray, models, reference, tmp_path) -> None:
    out = tmp_path / "results.jsonl"
    items = _items(3)
    items[1].max_new_tokens = 10_000  # past the tiny model's 256-position context: the verifier refuses
    results = ResultsFile(out)
    report = run_batch(items, results, out, _options(models), encode, decode)
    results.close()
    assert report.failed == 1 and report.restarts == 0 and report.finished == 2
    assert sorted(r["id"] for r in _read(out)) == ["p0", "p2"]
    errors = [json.loads(line) for line in errors_path(out).read_text().splitlines()]
    assert errors[0]["id"] == "p1" and "max_new_tokens" in errors[0]["error"] and "context" in errors[0]["error"]


@pytest.mark.parametrize(
    # Every role and both ways of killing appear; scripts/fault_drill.py runs the full 3 x 2 matrix.
    ("role", "how"), [("transfer", "ray.kill"), ("draft", "SIGKILL"), ("verifier", "SIGKILL")]
)
def test_killed_actor_mid_batch_every_prompt_once_and_identical(local_ray, models, reference, long_reference,
                                                               tmp_path, caplog, role, how) -> None:
    out = tmp_path / "results.jsonl"
    items = _items(4)
    items[1].max_new_tokens = LONG  # the second request, the one the kill lands in
    want = dict(reference, p1=long_reference)
    results = ResultsFile(out)
    fault = KillInRequest(role, how, nth=2).start()
    with caplog.at_level(logging.WARNING, logger="actors.batch"):
        report = run_batch(items, results, out, _options(models, timeout_s=TIMEOUT_S), encode, decode)
    results.close()
    failures = [r.getMessage() for r in caplog.records if r.name == "actors.batch" and "failed on 'p1'" in r.getMessage()]
    if role != "verifier":  # the verifier waits on it: told that its process is gone, not at the timeout
        assert any(f"the {role} process (pid " in m and "has exited" in m for m in failures), failures
    fault.join()
    assert fault.fired is not None, fault.error
    # it fired inside the second request, before that request had finished
    assert fault.fired["requests"] == 2 and 1 <= fault.fired["committed"] < LONG, fault.fired
    rows = _read(out)
    assert sorted(r["id"] for r in rows) == ["p0", "p1", "p2", "p3"]  # each exactly once
    assert all(r["tokens"] == want[r["id"]] for r in rows)
    assert report.failed == 0 and report.restarts >= 1 and report.retried >= 1, report
    assert not errors_path(out).exists()


def test_silent_transfer_peer_is_a_timeout_not_a_hang(local_ray, models) -> None:
    folder, draft = models
    handle = launch(folder, draft, SlotConfig(fraction=0.25), LINK, policy="demand-lru", replica="silent",
                    timeout_s=3.0)
    pid = ray.get(handle.transfer.pid.remote())
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(Exception, match="(?i)timed out|not ready|within|did not finish"):
            handle.generate(encode("a long enough prompt to need experts"), NEW, window=0, policy="demand-lru")
        assert time.monotonic() - start < 30
    finally:
        os.kill(pid, signal.SIGCONT)
        handle.shutdown(timeout_s=2.0)
