"""The benchmark harness: profiles reproduce ρ, summaries compute the ratios they claim."""

from __future__ import annotations

import json

import pytest

from specter.cli import main as specter_main
from specter.draft.quantize.model import quantize_model
from specter.eval import bench
from specter.timing.profiles import PROFILES


def test_profile_rho_and_simulated_bandwidth():
    p = PROFILES["mixtral-pcie4"]
    assert p.miss_s == pytest.approx(64 * 352_321_536 / 25e9)
    # The simulated link gives the CPU model the same rho: one fully-missed token = rho steps.
    bw = p.sim_bandwidth(cpu_step_s=0.01, bytes_per_token=1_600_000)
    assert 1_600_000 / bw / 0.01 == pytest.approx(p.rho)
    assert 5 < PROFILES["qwen2moe-pcie4"].rho < PROFILES["dsv2lite-pcie4"].rho < PROFILES["mixtral-pcie4"].rho


def test_budget_is_the_profiles_unless_given():
    config = bench.BenchConfig("m", "d", [[1]], ["dsv2lite-pcie4"])
    assert bench.budget_for(config, PROFILES["dsv2lite-pcie4"]).fraction == 16 / 64  # published main case
    assert bench.budget_for(config, PROFILES["mixtral-pcie4"]).fraction == 32 / 256
    config.budget = 0.5
    assert bench.budget_for(config, PROFILES["dsv2lite-pcie4"]).fraction == 0.5


def _run(tpot: float, **extra) -> dict:
    base = dict(tpot_s=tpot, new_tokens=10, hit_rate=0.5, misses=4, bytes_moved=2_000_000, link_busy_fraction=0.5,
                wait_s=0.1, window=0)
    return base | extra


def test_summary_and_bar_arithmetic():
    runs = {
        "demand-lru": [_run(0.30), _run(0.10), _run(0.20)],
        "specter": [_run(0.05, recall=0.95, mean_accepted=2.0, window=4), _run(0.10, recall=0.95), _run(0.08)],
        "oracle": [_run(0.07), _run(0.07), _run(0.07)],
        "specter-paper": [_run(0.2)] * 3,
        "specmoeoff": [_run(0.09)] * 3,
    }
    summary = bench.summarize(runs)
    assert summary["specter"]["tpot_s"] == pytest.approx(0.08)  # median
    assert summary["specter"]["speedup"] == pytest.approx(0.20 / 0.08)
    assert summary["demand-lru"]["misses_per_token"] == pytest.approx(12 / 30)
    results = {"profiles": {"a": {"rho": 30.0, "link_bytes_per_s": 1e6, "summary": summary},
                            "b": {"rho": 20.0, "link_bytes_per_s": 1e6, "summary": summary}}}
    verdicts = {claim: ok for claim, ok, _ in bench.bar(results)}
    assert verdicts["specter >= 2.0x faster than demand-lru under >= 2 profiles"]
    assert verdicts["[a] specter >= 1.2x faster than specter-paper"]
    assert not verdicts["[a] specter >= 1.2x faster than specmoeoff"]  # 0.09 / 0.08 = 1.125
    assert verdicts["[a] specter within 1.15x of oracle"]  # 0.08 / 0.07 = 1.14
    assert "specter" in bench.table(results)


def test_bench_runs_every_policy_on_a_tiny_model(tiny_dir, tmp_path):
    folder = tiny_dir("qwen2_moe")
    config = bench.BenchConfig(str(folder), str(folder), [[3, 17, 25, 9], [5, 6, 7]], ["qwen2moe-pcie4"],
                               policies=["demand-lru", "specter", "specter+last", "oracle"], new_tokens=6,
                               k_candidates=(1, 3))
    results = bench.run(config, progress=False)
    summary = results["profiles"]["qwen2moe-pcie4"]["summary"]
    assert results["clock"] == "virtual" and results["profiles"]["qwen2moe-pcie4"]["rho"] == pytest.approx(
        PROFILES["qwen2moe-pcie4"].rho)
    again = bench.run(config, progress=False)["profiles"]["qwen2moe-pcie4"]["summary"]
    assert {p: s["tpot_s"] for p, s in again.items()} == {p: s["tpot_s"] for p, s in summary.items()}
    assert results["profiles"]["qwen2moe-pcie4"]["budget"] == PROFILES["qwen2moe-pcie4"].budget == 0.25
    assert set(summary) == {"demand-lru", "specter", "specter+last", "oracle"}
    assert summary["demand-lru"]["speedup"] == pytest.approx(1.0)
    # the draft is the target itself: every expert of the verify pass is predicted once the extra
    # draft forward routes the K-th token's position too (without it, that position is not)
    assert summary["specter+last"]["recall"] == pytest.approx(1.0)
    assert 0.5 < summary["specter"]["recall"] < 1.0
    # specter chooses K per round (under its default cap); the oracle runs at the K that specter's
    # schedule at one fixed K scanned best.
    scan = results["window_scan"]["specter+fixed"]
    assert set(scan) == {1, 3} and results["windows"]["oracle"] == min(scan, key=scan.get)
    assert results["windows"]["specter"] == 32 and "specter" not in results["window_scan"]
    # the scan's recall covers K of the K+1 verified positions (no extra draft forward): it grows with K
    recall = results["window_recall"]["specter+fixed"]
    assert 0.5 < recall[1] < recall[3] < 1.0
    files = bench.save(results, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "results.json").read_text())["profiles"]
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    assert {f.name for f in files} >= {"tpot.png", "speedup.png", "time_split.png", "recall_vs_k.png"}


def test_graphed_steps_on_the_as_built_clock_are_made_ready_first_and_dispatch_less(tiny_dir, tmp_path, capsys,
                                                                                     caplog):
    """``--graphs``: the steps a GPU replays (each piece one launch) at the graphs' calibration, every token
    count made ready before the timed runs; the eager steps' run of the same prompts dispatches more."""
    folder = tiny_dir("qwen2_moe")
    quantize_model(str(folder), str(tmp_path / "draft"), method="int8", progress=False)  # a draft that graphs
    runs = {}
    for graphs in (False, True):
        config = bench.BenchConfig(str(folder), str(tmp_path / "draft"), [[3, 17, 25, 9], [5, 6, 7]],
                                   ["qwen2moe-pcie4"],
                                   policies=["demand-lru", "specter+fixed"], new_tokens=6, k_candidates=(1, 3),
                                   clock="as-built", graphs=graphs)
        runs[graphs] = bench.run(config, progress=False)
    eager, graphed = runs[False], runs[True]
    # an int8 draft: its experts do not take the int4 kernel, so as built it runs its dequantized cache, said so
    assert eager["draft_mode"] == graphed["draft_mode"] == "dequant-cache"
    assert "do not all take the int4 kernel" in caplog.text
    assert graphed["graphs"] and "h200-graphs" in graphed["dispatch"] and "h200-eager" in eager["dispatch"]
    for policy in ("demand-lru", "specter+fixed"):
        before, after = (r["profiles"]["qwen2moe-pcie4"]["runs"][policy] for r in (eager, graphed))
        assert all("cold_steps" not in run for run in before)
        assert all(run["cold_steps"] == 0 for run in after)  # no timed step ran a count first or captured
        for a, b in zip(before, after, strict=True):
            assert b["dispatch_s"] < a["dispatch_s"] and b["new_tokens"] == a["new_tokens"]
    assert "as-built clock, graphed steps" in bench.table(graphed)
    with pytest.raises(ValueError, match="graphs: .*as-built"):
        bench.run(bench.BenchConfig(str(folder), str(folder), [[3]], ["qwen2moe-pcie4"], graphs=True),
                  progress=False)
    with pytest.raises(SystemExit) as exited:
        specter_main(["bench", "--model", str(folder), "--graphs"])
    assert exited.value.code == 2 and "--graphs" in capsys.readouterr().err


def test_the_as_built_clock_runs_the_int4_draft_where_its_experts_take_the_kernel():
    """As built, the draft is the one a profile's memory holds beside its target: its experts in int4, a
    step's routed pairs gathered (what ``DraftModel.last_compute`` tells the clock to charge)."""
    from specter.assets import DEFAULT_DRAFT, DEFAULT_MODEL

    for graphs in (False, True):
        config = bench.BenchConfig(str(DEFAULT_MODEL), str(DEFAULT_DRAFT), [[3, 17, 25, 9]], ["qwen2moe-pcie4"],
                                   policies=["specter+fixed"], new_tokens=4, windows={"specter": 2},
                                   clock="as-built", graphs=graphs)
        assert bench.run(config, progress=False)["draft_mode"] == "int4-kernel"


def test_a_host_variant_alone_gets_its_k_from_a_scan_not_its_default(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    config = bench.BenchConfig(str(folder), str(folder), [[3, 17, 25, 9]], ["qwen2moe-pcie4"],
                               policies=["demand-lru", "specter-paper+host"], new_tokens=4, k_candidates=(1, 3))
    results = bench.run(config, progress=False)
    scan = results["window_scan"]["specter-paper+host"]
    assert set(scan) == {1, 3} and results["windows"]["specter-paper+host"] == min(scan, key=scan.get)
    assert results["profiles"]["qwen2moe-pcie4"]["summary"]["specter-paper+host"]["window"] in (1, 3)


@pytest.mark.parametrize("via", ["ray", "processes"])
def test_bench_actors_column_runs_specter_through_the_actors(tiny_dir, via):
    """Through Ray actors, or the same roles as plain processes (``--actors-via processes``: no Ray)."""
    folder = tiny_dir("mixtral")
    config = bench.BenchConfig(str(folder), str(folder), [[3, 17, 25, 9]], ["qwen2moe-pcie4"],
                               policies=["demand-lru", "specter"], windows={"specter": 3}, new_tokens=5,
                               actors=True, clock="wall", actors_via=via)
    if via == "processes":
        import ray

        assert not ray.is_initialized()
    results = bench.run(config, progress=False)
    assert results["actors_via"] == via
    if via == "processes":
        assert not ray.is_initialized()  # no Ray started for them
    runs = results["profiles"]["qwen2moe-pcie4"]["runs"]
    # both draft (a fresh specter drafts its second round) and commit the same tokens; how many
    # rounds each takes after that follows K choices made from wall-clock timings
    assert runs[bench.ACTORS][0]["rounds"] > 0 and runs["specter"][0]["rounds"] > 0
    assert runs[bench.ACTORS][0]["new_tokens"] == runs["specter"][0]["new_tokens"] == 5
    label = "actors (plain processes) overhead" if via == "processes" else "actors overhead"
    assert any(label in claim for claim, _, _ in bench.bar(results))
    assert ("roles as plain processes" in bench.table(results)) == (via == "processes")


def test_each_actors_column_is_held_against_the_in_process_run_that_drafts_as_it_does():
    """``specter@actors`` drafts each round after the last (unpipelined), ``specter@pipelined`` during the verify
    pass, as the in-process engine does by default: each column's overhead is against its own kind."""
    summary = {"specter+fixed": {"tpot_s": 0.010, "ahead_asked": 40}, "specter+fixed+nopipe": {"tpot_s": 0.014},
               "specter+fixed@actors": {"tpot_s": 0.0144}, "specter+fixed@pipelined": {"tpot_s": 0.0099}}
    results = {"actors_policy": "specter+fixed", "actors_via": "processes", "profiles": {"a": {"summary": summary}}}
    checks = {claim: (ok, numbers) for claim, ok, numbers in bench.bar(results)}
    assert checks["[a] actors (plain processes) overhead <= 5% of TPOT (against specter+fixed+nopipe in process)"] == \
        (True, "+2.9%")
    assert checks["[a] pipelined actors (plain processes) overhead <= 5% of TPOT (against specter+fixed in process)"] == \
        (True, "-1.0%")
    legacy = {"specter@actors" if k.endswith("@actors") else "specter@pipelined" if "@" in k else k: v
              for k, v in summary.items()}  # results of 2026-12-06 and before: "specter@…" whatever the policy
    assert [(c, ok, n) for c, ok, n in bench.bar({**results, "profiles": {"a": {"summary": legacy}}})] == \
        [(c, ok, n) for c, ok, n in bench.bar(results)]
    del summary["specter+fixed+nopipe"]  # no unpipelined run in process: the unpipelined column is held against nothing
    claims = [claim for claim, _, _ in bench.bar(results)]
    assert [c for c in claims if "overhead" in c] == [
        "[a] pipelined actors (plain processes) overhead <= 5% of TPOT (against specter+fixed in process)"]


def test_the_actors_columns_are_named_by_the_policy_they_run():
    config = bench.BenchConfig("m", "d", [[1]], ["qwen2moe-pcie4"], actors=True, actors_policy="demand-lru",
                               actors_schedules=("transfer", "verifier"))
    assert bench.actor_columns(config) == [("demand-lru@actors", "transfer", False),
                                           ("demand-lru@pipelined", "transfer", True),
                                           ("demand-lru@actors-v", "verifier", False),
                                           ("demand-lru@pipelined-v", "verifier", True)]
    assert (bench.ACTORS, bench.PIPELINED) == ("specter@actors", "specter@pipelined")  # the default policy's



def test_the_table_of_a_policy_that_does_not_draft_through_the_actors_has_no_pipelining_line():
    """``--actors-policy demand-lru``: its pipelined column drafts nothing, so there is no ahead count to print."""
    row = {"tpot_s": 0.01, "speedup": 1.0, "hit_rate": 0.5, "misses_per_token": 1.0, "mb_per_token": 1.0,
           "link_busy": 0.5, "recall": 0.0, "accepted": 0.0, "window": 0}
    summary = {"demand-lru": row, "demand-lru@actors": row, "demand-lru@pipelined": row}
    text = bench.table({"clock": "wall", "actors_policy": "demand-lru",
                        "profiles": {"a": {"rho": 1.0, "link_bytes_per_s": 1e6, "summary": summary}}})
    assert "demand-lru@pipelined " in text and "rounds drafted ahead" not in text
    rows = [line for line in text.splitlines() if line.startswith(("policy", "demand-lru"))]
    assert len({line.index(" 0 ") for line in rows[1:]}) == 1  # the columns line up past the longest name
