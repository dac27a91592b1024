"""scripts/per_prompt.py: two policies of one bench run compared prompt by prompt."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from per_prompt import compare  # noqa: E402


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


def test_a_missing_policy_or_unpaired_runs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'oracle' is not in this run"):
        compare(_runs([1.0], [1.0]), "oracle", "specter")
    with pytest.raises(ValueError, match="not one run's pairs"):
        compare(_runs([1.0, 2.0], [1.0]), "specter", "specter-paper+host+pipe")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"profiles": {"qwen2moe-pcie4": {"runs": _runs([1.0], [1.0])}}}))
    run = subprocess.run([sys.executable, str(ROOT / "scripts/per_prompt.py"), str(results), "--against", "demand-lru"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "qwen2moe-pcie4: policy 'demand-lru' is not in this run" in run.stderr
    assert run.stdout == ""
    ok = subprocess.run([sys.executable, str(ROOT / "scripts/per_prompt.py"), str(results)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "qwen2moe-pcie4" in ok.stdout and "1.000" in ok.stdout
