"""``specter bench --concurrency``: closed-loop clients batched on one target, figures that add up."""

from __future__ import annotations

import json

import pytest

from specter.cli import main as specter_main
from specter.eval import concurrency

PROMPTS = [[3, 17, 25, 9], [5, 6, 7], [40, 41, 2, 8, 11], [90, 1]]


def test_every_request_is_counted_and_batches_never_exceed_n(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    config = concurrency.ConcurrencyConfig(str(folder), PROMPTS, ["qwen2moe-pcie4"], ["demand-lru", "demand-host"],
                                           [1, 3], new_tokens=6, requests_per_client=2)
    results = concurrency.run(config, progress=False)
    rows = results["profiles"]["qwen2moe-pcie4"]["rows"]
    for policy in ("demand-lru", "demand-host"):
        one, three = rows[policy][1], rows[policy][3]
        assert one["window"] == 0
        assert one["requests"] == 2 and three["requests"] == 6
        assert one["tokens"] == 2 * 6 and three["tokens"] == 6 * 6
        assert one["mean_batch"] == 1.0 and 1.0 < three["mean_batch"] <= 3.0
        assert three["coverage"] >= one["coverage"] > 0  # more requests, more of each layer's experts per step
        assert one["tokens_per_s"] == pytest.approx(one["tokens"] / one["seconds"])
        for row in (one, three):  # no schedule of the same passes beats the bound (specter/bound.py)
            assert 0 < row["tokens_per_s"] <= row["bound_tokens_per_s"] * (1 + 1e-9)
    table = concurrency.table(results)
    assert "| demand-host | 0 | 3 |" in table and "× N=1" in table


def test_drafting_policies_without_a_draft_and_bad_counts_are_refused_by_name(tiny_dir, capsys):
    folder = tiny_dir("qwen2_moe")
    with pytest.raises(ValueError, match="give --draft"):
        concurrency.check(concurrency.ConcurrencyConfig(str(folder), PROMPTS, ["qwen2moe-pcie4"], ["specter"]))
    with pytest.raises(SystemExit) as exited:
        specter_main(["bench", "--model", str(folder), "--concurrency", "0,2"])
    assert exited.value.code == 2 and "--concurrency" in capsys.readouterr().err


def test_the_command_writes_its_table_and_json(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "import os", "class A:"]))
    code = specter_main(["bench", "--concurrency", "1,2", "--profiles", "qwen2moe-pcie4",  # the embedded model
                         "--num-prompts", "3", "--new-tokens", "4", "--prompts", str(prompts), "--out", str(tmp_path)])
    assert code == 0
    saved = json.loads((tmp_path / "concurrency.json").read_text())
    rows = saved["profiles"]["qwen2moe-pcie4"]["rows"]
    assert set(rows) == {"demand-lru", "demand-host", "specter-paper", "specter"}
    assert rows["specter-paper"]["1"]["window"] == 8  # its K; specter's is chosen per round (a mean)
    assert 0 < rows["specter"]["2"]["window"] <= 32
    assert rows["specter"]["2"]["mean_accepted"] > 0  # the shipped AWQ draft's rounds accept
    for policy, by_n in rows.items():  # drafting or not, batched or not: the bound holds
        for row in by_n.values():
            assert 0 < row["tokens_per_s"] <= row["bound_tokens_per_s"] * (1 + 1e-9), policy
    assert "qwen2moe-pcie4" in capsys.readouterr().out


def test_a_kept_row_goes_on_from_the_choosers_its_fresh_run_left(tiny_dir, monkeypatch):
    """``kept``: an adaptive policy runs again at each N from the K choosers its fresh run left (what a
    restarted ``specter serve`` starts from); a policy without a chooser gets no kept row."""
    folder = tiny_dir("qwen2_moe")
    made: list[tuple[dict | None, concurrency.Batcher]] = []

    class Recorded(concurrency.Batcher):
        def __init__(self, *args, choosers=None, **kwargs):
            super().__init__(*args, choosers=choosers, **kwargs)
            made.append((choosers, self))

    monkeypatch.setattr(concurrency, "Batcher", Recorded)
    config = concurrency.ConcurrencyConfig(str(folder), PROMPTS, ["qwen2moe-pcie4"], ["demand-lru", "specter"], [2],
                                           new_tokens=12, requests_per_client=2, draft=str(folder), kept=True)
    rows = concurrency.run(config, progress=False)["profiles"]["qwen2moe-pcie4"]["rows"]
    assert list(rows) == ["demand-lru", "specter", "specter kept"]
    assert rows["specter kept"][2]["tokens"] == rows["specter"][2]["tokens"] == 4 * 12
    (_, plain), (none, fresh), (kept, again) = made
    assert plain.choosers is None and none is None
    assert kept == fresh.chooser_states() and kept  # the fresh batcher's choosers, as it left them
    for n, state in kept.items():  # and the kept batcher went on from them: its samples add to theirs
        assert sum(again.choosers[n].samples.values()) >= sum(state["samples"].values())
    assert sum(sum(c.samples.values()) for c in again.choosers.values()) > sum(
        sum(s["samples"].values()) for s in kept.values())


def test_kept_choosers_without_concurrency_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exited:
        specter_main(["bench", "--kept-choosers"])
    assert exited.value.code == 2 and "--kept-choosers: only with --concurrency" in capsys.readouterr().err
