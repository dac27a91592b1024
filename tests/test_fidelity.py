"""The fidelity measures on hand-made routings, on a draft equal to the target, and the script end to end."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny
from transformers import AutoModelForCausalLM

from specter.draft.resident import ResidentDraft
from specter.eval.fidelity import (
    FidelityTally,
    measure_teacher_forced,
    merge,
    set_equal,
    target_pass,
    window_recall,
)
from specter.eval.fidelity_report import awq_verdict, row_measures
from specter.models.greedy import greedy_continuation
from specter.models.routing import RoutingRecorder

ROOT = Path(__file__).resolve().parent.parent
T = torch.tensor


def test_set_agreement_ignores_order_and_sees_one_wrong_expert():
    same = set_equal(T([[1, 2], [3, 4], [0, 7]]), T([[2, 1], [3, 5], [0, 7]]))
    assert same.tolist() == [True, False, True]


def test_recall_of_identical_routing_is_one_and_of_disjoint_routing_zero():
    ids = T([[0, 1], [2, 3], [1, 4], [5, 6]])
    for k in (1, 2, 4):
        assert window_recall(ids, ids, k).tolist() == [1.0] * (4 - k + 1)
    other = T([[7, 8], [9, 10], [11, 12], [13, 14]])
    assert window_recall(other, ids, 2, num_experts=16).tolist() == [0.0] * 3


def test_recall_on_a_hand_computed_case():
    target = T([[0, 1], [2, 3], [0, 1]])
    draft = T([[0, 2], [2, 3], [4, 5]])
    assert window_recall(draft, target, 1).tolist() == [0.5, 1.0, 0.0]
    # windows {0,1}: T = {0,1,2,3}, D = {0,2,3} -> 3/4; {1,2}: T = {0,1,2,3}, D = {2,3,4,5} -> 2/4
    assert window_recall(draft, target, 2).tolist() == [0.75, 0.5]
    assert window_recall(draft, target, 3).tolist() == [0.75]
    assert window_recall(draft, target, 4).numel() == 0  # shorter than the window: no window


def test_tally_pools_layers_positions_and_tokens():
    target = {1: (T([[0, 1], [2, 3], [0, 1]]), torch.ones(3, 2)), 2: (T([[4, 5], [4, 6], [5, 6]]), torch.ones(3, 2))}
    draft = {1: (T([[0, 2], [2, 3], [4, 5]]), torch.ones(3, 2)), 2: (T([[5, 4], [6, 4], [6, 5]]), torch.ones(3, 2))}
    t_logits = torch.eye(4)[[0, 1, 2, 3]]  # argmax 0 1 2 3
    d_logits = torch.eye(4)[[0, 1, 3, 3]]  # argmax 0 1 3 3
    tally = FidelityTally((1, 2))
    tally.add(draft, target, d_logits, t_logits, slice(0, 3), slice(0, 4))
    s = tally.summary()
    assert s["topk_set_per_layer"] == {1: pytest.approx(1 / 3), 2: 1.0}
    assert s["topk_set_mean"] == pytest.approx(2 / 3) and s["topk_set_min"] == pytest.approx(1 / 3)
    assert s["topk_set_min_layer"] == 1
    assert s["recall"][1] == pytest.approx((0.5 + 1 + 0 + 3) / 6)  # layer 2 all 1.0
    assert s["recall"][2] == pytest.approx((0.75 + 0.5 + 2) / 4)
    assert s["next_token"] == pytest.approx(3 / 4)
    # the routing slice applies: only position 1 scored -> both layers agree there
    only = FidelityTally((1,))
    only.add(draft, target, d_logits, t_logits, slice(1, 2), slice(0, 1))
    assert only.summary()["topk_set_mean"] == 1.0 and only.summary()["next_token"] == 1.0
    pooled = merge([tally, only]).summary()
    assert pooled["topk_set_per_layer"][1] == pytest.approx(2 / 4) and pooled["tokens"] == 5


def test_verdict_needs_no_worse_everywhere_and_better_somewhere():
    rtn = {"next_token": 0.8, "recall@4": 0.9}
    assert awq_verdict({"rtn": rtn, "awq": {"next_token": 0.85, "recall@4": 0.9}})["verdict"] == "PASS"
    fail = awq_verdict({"rtn": rtn, "awq": {"next_token": 0.95, "recall@4": 0.89}})
    assert fail["verdict"] == "FAIL" and fail["worse"] == ["recall@4"]
    assert awq_verdict({"rtn": rtn, "awq": dict(rtn)})["verdict"] == "FAIL"  # equal everywhere: not better
    v = awq_verdict({"rtn": rtn, "awq": {"next_token": 0.85, "recall@4": 0.9}},
                    {"next_token": (0.01, 0.09), "recall@4": (-0.02, 0.02)})
    assert v["clearly_better"] == ["next_token"] and v["clearly_worse"] == []


@pytest.fixture(scope="module")
def target_sequences(tiny_dir):
    folder = tiny_dir("qwen2_moe")
    model = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    recorder = RoutingRecorder(model)
    seqs = []
    for prompt in ([5, 99, 17, 42, 8, 63], [3, 1, 4, 1, 5, 9, 2, 6]):
        ids = prompt + greedy_continuation(model, prompt, 10)
        logits, routing = target_pass(model, recorder, ids)
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == ids[len(prompt):]  # teacher forcing == greedy
        seqs.append((ids, len(prompt), logits, routing))
    return folder, seqs


def test_draft_equal_to_target_agrees_everywhere_and_another_model_does_not(target_sequences, tmp_path):
    folder, seqs = target_sequences
    tallies = measure_teacher_forced(ResidentDraft(folder), seqs, (1, 2, 4, 8, 16), num_experts=8)
    s = merge(tallies).summary()
    assert s["positions"] == 20 and s["tokens"] == 20
    assert s["topk_set_mean"] == 1.0 and s["topk_set_min"] == 1.0 and s["next_token"] == 1.0
    assert all(s["recall"][k] == 1.0 for k in (1, 2, 4, 8))
    assert math.isnan(s["recall"][16])  # 10 positions per sequence: no window of 16
    stranger = ResidentDraft(save_tiny("qwen2_moe", tmp_path / "other", seed=7))
    s2 = merge(measure_teacher_forced(stranger, seqs, (1, 4), num_experts=8)).summary()
    assert s2["topk_set_mean"] < 0.5 and s2["recall"][1] < 0.8 and s2["next_token"] < 0.5
    assert s2["recall"][1] < s2["recall"][4] <= 1.0  # a wider window catches more
    row = row_measures(tallies, {})
    assert row["topk_set_mean"] == 1.0 and row["recall@4"] == 1.0


def _script():
    spec = importlib.util.spec_from_file_location("fidelity_script", ROOT / "scripts" / "fidelity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_end_to_end_writes_table_json_and_report(tiny_dir, tmp_path, capsys):
    folder = tiny_dir("mixtral")
    out, js = tmp_path / "fidelity.md", tmp_path / "fidelity.json"
    argv = ["--model", str(folder), "--random-prompts", "3", "--prompt-len", "6", "--new-tokens", "10",
            "--methods", "int8,rtn,fp", "--spec-windows", "2,4", "--out", str(out), "--json", str(js),
            "--work", str(tmp_path / "work")]
    assert _script().main(argv) == 0
    printed = capsys.readouterr().out
    for method in ("int8", "rtn", "fp"):
        assert f"| {method} |" in printed
    assert "accepted K=4" in printed and "AWQ vs RTN: n/a" in printed
    result = json.loads(js.read_text())["results"][0]
    rows = result["rows"]
    assert set(rows) == {"int8", "rtn", "fp"}
    assert set(rows["rtn"]) == {"topk_set_mean", "topk_set_min", "recall@1", "recall@2", "recall@4", "recall@8",
                                "recall@16", "next_token", "accepted@K=2", "accepted@K=4"}
    assert result["positions"] == 30 and result["target_teacher_forced_vs_generate"] == 1.0
    assert all(rows["fp"][k] == 1.0 for k in ("topk_set_mean", "recall@1", "recall@8", "next_token"))
    for method, row in rows.items():
        acc = result["methods"][method]["acceptance"]
        assert 0 <= row["accepted@K=4"] <= 4 and acc["4"]["lossless_prompts"] == 3  # speculation stays exact
        assert all(0 <= row[k] <= 1 for k in row if not k.startswith("accepted") and row[k] is not None)
    assert result["methods"]["fp"]["acceptance"]["4"]["acceptance_rate"] == 1.0
    assert result["prompt_positions"] == 18 and result["prompt_rows"]["fp"]["next_token"] == 1.0
    assert set(result["prompt_rows"]["rtn"]) == {k for k in rows["rtn"] if not k.startswith("accepted")}
    assert rows["rtn"]["next_token"] < 1.0 and rows["int8"]["topk_set_mean"] > 0.9
    report = out.read_text()
    assert "python scripts/fidelity.py --model" in report and report.count("| rtn |") == 3  # 2 tables + errors
    fp, rtn = result["methods"]["fp"], result["methods"]["rtn"]
    assert fp["calibration_text"]["tokens"] > 0 and fp["calibration_text"]["logit_rel_err"] < 1e-5
    assert fp["summary"]["logit_rel_err"] < 1e-5 and fp["summary"]["kl"] < 1e-8
    assert rtn["calibration_text"]["logit_rel_err"] > 1e-4 and rtn["prompt_region"]["kl"] > 0
    assert (tmp_path / "work" / f"{folder.name}-rtn" / "draft_report.json").is_file()


class _Replay:
    """A fake draft replaying given logits and routing (teacher-forced interface)."""

    def __init__(self, logits, routing):
        self.logits, self.last_routing = logits, routing

    def new_cache(self):
        return None

    def forward(self, input_ids, cache):
        assert input_ids.shape == (1, self.logits.shape[0])
        return self.logits[None]


def test_only_generated_positions_are_scored(target_sequences):
    _, seqs = target_sequences
    ids, plen, logits, routing = seqs[0]
    logits = logits.clone()
    logits[-1] = -logits[-1]  # the last position predicts past the sequence: never scored
    logits[: plen - 1] = -logits[: plen - 1]  # positions that predict prompt tokens: not scored
    wrong = {layer: ((i + 1) % 8, w) for layer, (i, w) in routing.items()}
    shifted = {layer: (torch.cat([wrong[layer][0][:plen], i[plen:]]), w) for layer, (i, w) in routing.items()}
    s = merge(measure_teacher_forced(_Replay(logits, shifted), [seqs[0]], (1, 2))).summary()
    assert s["next_token"] == 1.0 and s["topk_set_mean"] == 1.0 and s["recall"][2] == 1.0
    logits[plen - 1] = -logits[plen - 1]  # this one predicts the first generated token
    s = merge(measure_teacher_forced(_Replay(logits, wrong), [seqs[0]], (1,))).summary()
    assert s["next_token"] == pytest.approx(9 / 10) and s["topk_set_mean"] == 0.0


def test_prompt_region_scores_the_prompt_positions(target_sequences):
    _, seqs = target_sequences
    ids, plen, logits, routing = seqs[0]
    wrong = {layer: ((i + 1) % 8, w) for layer, (i, w) in routing.items()}
    generated_wrong = {layer: (torch.cat([i[:plen], wrong[layer][0][plen:]]), w) for layer, (i, w) in routing.items()}
    s = merge(measure_teacher_forced(_Replay(logits, generated_wrong), [seqs[0]], (1,), region="prompt")).summary()
    assert s["positions"] == plen and s["tokens"] == plen - 1
    assert s["topk_set_mean"] == 1.0 and s["next_token"] == 1.0
    s = merge(measure_teacher_forced(_Replay(logits, generated_wrong), [seqs[0]], (1,))).summary()
    assert s["topk_set_mean"] == 0.0
