"""Two policies of one bench run compared prompt by prompt: ``bench.per_prompt``, the line under each
profile's table, and scripts/per_prompt.py."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from specter.eval import bench
from specter.eval.bench import per_prompt as compare

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("per_prompt_script", ROOT / "scripts" / "per_prompt.py")
assert _spec is not None and _spec.loader is not None
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def _runs(mine: list[float], theirs: list[float]) -> dict[str, list[dict[str, float]]]:
    return {"specter": [{"tpot_s": t} for t in mine], "specter-paper+host+pipe": [{"tpot_s": t} for t in theirs]}


def test_the_per_prompt_ratios_are_summarised_as_by_hand() -> None:
    # Per prompt 0.5, 1.0, 1.2, 1.005: the ratio of the medians (1.1 / 1.5) is not the median ratio (1.0025).
    s = compare(_runs([1.0, 1.0, 1.2, 2.01], [2.0, 1.0, 1.0, 2.0]), "specter", "specter-paper+host+pipe")
    assert s["prompts"] == 4
    assert s["ratio_of_medians"] == pytest.approx(((1.0 + 1.2) / 2) / ((1.0 + 2.0) / 2))
    assert s["median_ratio"] == pytest.approx((1.0 + 1.005) / 2)
    assert s["geometric_mean"] == pytest.approx(math.exp(sum(map(math.log, (0.5, 1.0, 1.2, 1.005))) / 4))
    assert s["ratio_of_sums"] == pytest.approx(5.21 / 6.0)
    assert (s["best"], s["worst"]) == (pytest.approx(0.5), pytest.approx(1.2))
    assert (s["faster"], s["slower"]) == (1, 1)  # 1.005 is within 1 %


def test_a_missing_policy_or_unpaired_runs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="'oracle' is not in this run"):
        compare(_runs([1.0], [1.0]), "oracle", "specter")
    with pytest.raises(ValueError, match="not one run's pairs"):
        compare(_runs([1.0, 2.0], [1.0]), "specter", "specter-paper+host+pipe")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"profiles": {"qwen2moe-pcie4": {"runs": _runs([1.0], [1.0])}}}))
    with pytest.raises(SystemExit) as refused:
        script.main([str(results), "--against", "demand-lru"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and "qwen2moe-pcie4: policy 'demand-lru' is not in this run" in err and out == ""
    assert script.main([str(results)]) == 0
    out, _ = capsys.readouterr()
    assert "qwen2moe-pcie4" in out and "1.000" in out


def test_the_bench_table_gives_specter_per_prompt_against_the_fastest_other_policy() -> None:
    runs = {"demand-lru": [{"tpot_s": t} for t in (4.0, 4.0, 4.0)],
            "oracle": [{"tpot_s": t} for t in (0.5, 0.5, 0.5)],  # never the one compared with
            "specter-paper+host+pipe": [{"tpot_s": t} for t in (1.0, 2.0, 2.0)],
            "specter": [{"tpot_s": t} for t in (1.5, 1.0, 2.0)]}
    summary = bench.summarize({p: [dict(r, new_tokens=1, misses=0, bytes_moved=0, hit_rate=1.0, link_busy_fraction=0.0,
                                        wait_s=0.0) for r in items] for p, items in runs.items()})
    text = bench.table({"profiles": {"a": {"rho": 1.0, "link_bytes_per_s": 1e6, "summary": summary, "runs": runs}}})
    geo = (1.5 * 0.5 * 1.0) ** (1 / 3)  # per prompt 1.5, 0.5, 1.0
    assert (f"specter per prompt over specter-paper+host+pipe (the fastest other policy): geometric mean {geo:.3f}x, "
            "0.50-1.50x, faster on 1 and slower on 1 of 3 prompts") in text
    assert "per prompt" not in bench.table({"profiles": {"a": {"rho": 1.0, "link_bytes_per_s": 1e6, "summary": summary}}})
