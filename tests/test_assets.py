"""The project's own small trained MoE checkpoints shipped in ``specter/assets/``.

They are produced by ``scripts/train_small_moe.py``; these tests check what the rest of the project
relies on: they load with the stock transformers classes, they are the promised shapes, routing is
balanced on held-out text, the tokenizer round-trips, and the model actually predicts code.
"""

from __future__ import annotations

import json
import math
import platform
import sysconfig
import tokenize
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "specter" / "assets"
PROMPTS = ASSETS / "prompts"
EOT = "<|endoftext|>"
MAX_WEIGHT_BYTES = 40 * 1000 * 1000
LOAD_LOW, LOAD_HIGH = 0.25, 4.0

# name -> (model_type, routed experts (min), top-k, shared expert)
EXPECTED = {
    "moe-fine": ("qwen2_moe", 32, 4, True),
    "moe-coarse": ("mixtral", 8, 2, False),
}
MODELS = sorted(EXPECTED)


def _num_experts(config) -> int:
    return config.num_local_experts if config.model_type == "mixtral" else config.num_experts


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded() -> dict:
    """Each model (fp32) and its tokenizer, loaded once."""
    torch.set_num_threads(1)
    out = {}
    for n in MODELS:
        model = AutoModelForCausalLM.from_pretrained(ASSETS / n, dtype=torch.float32)
        model.eval()
        out[n] = (model, AutoTokenizer.from_pretrained(ASSETS / n))
    return out


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, str]]:
    with open(PROMPTS / "heldout.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _report(name: str) -> dict:
    return json.loads((ASSETS / name / "training_report.json").read_text(encoding="utf-8"))


def test_weights_within_size_limit_and_bf16(name: str) -> None:
    weights = ASSETS / name / "model.safetensors"
    assert weights.is_file(), f"{weights} missing"
    assert weights.stat().st_size <= MAX_WEIGHT_BYTES, f"{name}: {weights.stat().st_size} bytes"
    config = json.loads((ASSETS / name / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(weights, "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_config_facts(name: str, loaded: dict) -> None:
    model, tok = loaded[name]
    model_type, min_experts, top_k, shared = EXPECTED[name]
    cfg = model.config
    assert cfg.model_type == model_type
    assert _num_experts(cfg) >= min_experts
    if name == "moe-coarse":
        assert _num_experts(cfg) == 8
    assert cfg.num_experts_per_tok == top_k
    assert cfg.max_position_embeddings >= 1024
    eot = tok.convert_tokens_to_ids(EOT)
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == eot
    assert model.generation_config.eos_token_id == eot
    mlp = model.model.layers[0].mlp
    if shared:
        assert cfg.shared_expert_intermediate_size > 0
        assert mlp.shared_expert_gate.out_features == 1  # the sigmoid gate of the shared expert
    else:
        assert not hasattr(mlp, "shared_expert")


def test_experts_are_stored_per_expert_on_disk(name: str, loaded: dict) -> None:
    cfg = loaded[name][0].config
    with safe_open(ASSETS / name / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    last = _num_experts(cfg) - 1
    if cfg.model_type == "mixtral":
        expected = {f"model.layers.0.block_sparse_moe.experts.{last}.w{i}.weight" for i in (1, 2, 3)}
    else:
        expected = {f"model.layers.0.mlp.experts.{last}.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert expected <= keys


def test_tokenizer_round_trips_and_is_shared(name: str, loaded: dict, prompts: list[dict[str, str]]) -> None:
    tok = loaded[name][1]
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert 3500 <= len(tok) <= 4200
    assert tok.eos_token == tok.bos_token == tok.pad_token == EOT
    text = "def f(x):\n\treturn x ** 2  # größer, \u2603\n" + prompts[0]["prompt"]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # BPE merges something
    shared = {(ASSETS / n / "tokenizer.json").read_bytes() for n in MODELS}
    assert len(shared) == 1, "the models must share one tokenizer"


def test_card_and_report(name: str, loaded: dict) -> None:
    cfg = loaded[name][0].config
    card = (ASSETS / name / "README.md").read_text(encoding="utf-8")
    report = _report(name)
    assert "python scripts/train_small_moe.py" in card and report["training"]["command"] in card
    assert "held-out" in card.lower()
    assert report["training"]["seconds"] <= 20 * 60
    loss = report["heldout"]["loss"]
    assert math.isfinite(loss) and loss < math.log(cfg.vocab_size)
    shares = report["expert_load"]["per_layer_share"]
    n_experts = _num_experts(cfg)
    assert len(shares) == cfg.num_hidden_layers
    for layer, row in enumerate(shares):
        assert len(row) == n_experts
        assert abs(sum(row) - 1.0) < 1e-6
        lo, hi = min(row) * n_experts, max(row) * n_experts
        assert lo >= LOAD_LOW and hi <= LOAD_HIGH, f"{name} layer {layer}: load {lo:.2f}..{hi:.2f} x uniform"


def test_fine_model_is_fine_grained() -> None:
    report = _report("moe-fine")
    distinct = {int(w): v["mean"] for w, v in report["distinct_experts_per_window"].items()}
    assert distinct[1] == pytest.approx(report["top_k"])
    windows = sorted(distinct)
    assert all(distinct[a] < distinct[b] for a, b in zip(windows, windows[1:], strict=False))
    assert distinct[4] < report["num_experts"] / 2  # a 4-token window touches well under half the experts


def test_greedy_generation_decodes(name: str, loaded: dict, prompts: list[dict[str, str]]) -> None:
    model, tok = loaded[name]
    enc = tok(prompts[0]["prompt"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert len(new) > 0
    assert tok.decode(new, skip_special_tokens=True) or EOT in tok.decode(new)


def test_heldout_loss_recomputed(name: str, loaded: dict, prompts: list[dict[str, str]]) -> None:
    model, tok = loaded[name]
    nll, n = 0.0, 0
    for p in prompts[:4]:
        ids = torch.tensor([[tok.eos_token_id, *tok.encode(p["prompt"], add_special_tokens=False)]])
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        nll += out.loss.item() * (ids.shape[1] - 1)
        n += ids.shape[1] - 1
    loss = nll / n
    assert math.isfinite(loss)
    assert loss < math.log(model.config.vocab_size) - 1.0, f"{name}: held-out prompt loss {loss:.2f}"


def test_prompt_and_calibration_files(loaded: dict, prompts: list[dict[str, str]]) -> None:
    tok = loaded["moe-fine"][1]
    assert len(prompts) >= 40
    assert len({p["id"] for p in prompts}) == len(prompts)
    heldout_files = {p["id"].rsplit(":", 1)[0] for p in prompts}
    calibration = (PROMPTS / "calibration.txt").read_text(encoding="utf-8")
    for p in prompts:
        assert 8 <= len(tok.encode(p["prompt"], add_special_tokens=False)) <= 32, p["id"]
        assert p["prompt"].endswith("\n")  # cut at a line boundary
    assert 48 * 1024 <= len(calibration.encode("utf-8")) <= 80 * 1024
    assert len(heldout_files) >= 10  # spread over many held-out files


def test_prompts_are_real_heldout_code(prompts: list[dict[str, str]]) -> None:
    if _report("moe-fine")["data"]["python_version"] != platform.python_version():
        pytest.skip("prompts were cut from another Python version's standard library")
    data = _report("moe-fine")["data"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    excluded = set(data["excluded_dirs"])
    files = sorted(
        p.relative_to(stdlib).as_posix()
        for p in stdlib.rglob("*.py")
        if not excluded.intersection(p.relative_to(stdlib).parts)
    )
    heldout = set(files[19::20])  # the split rule the report states: file i held out when i % 20 == 19
    assert "held out when i % 20 == 19" in data["split"]
    assert len(heldout) == data["heldout_files"]
    for p in prompts:
        assert p["id"].rsplit(":", 1)[0] in heldout, f"{p['id']} is not a held-out file"
        rel, line = p["id"].rsplit(":", 1)
        with tokenize.open(stdlib / rel) as f:
            lines = f.read().splitlines(keepends=True)
        assert "".join(lines[int(line) - 1 :]).startswith(p["prompt"]), p["id"]
