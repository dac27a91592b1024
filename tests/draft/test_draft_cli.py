"""``specter quantize`` end to end on a tiny model, and its one-line errors."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specter.draft.quantize.cli import add_quantize_command, run_quantize
from specter.draft.runner import DraftModel

WORDS = [f"w{i}" for i in range(127)]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specter")
    add_quantize_command(parser.add_subparsers(dest="command", required=True))
    return run_quantize(parser.parse_args(["quantize", *argv]))


def _with_tokenizer(src, folder):
    shutil.copytree(src, folder)
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_quantize_cli_end_to_end(plain_dir, tmp_path, capsys, caplog) -> None:
    model = _with_tokenizer(plain_dir("olmoe"), tmp_path / "model")
    gen = torch.Generator().manual_seed(0)
    text = " ".join(WORDS[i] for i in torch.randint(0, 127, (600,), generator=gen).tolist())
    (tmp_path / "calib.txt").write_text(text)
    out = tmp_path / "draft"
    argv = [
        "--model",
        str(model),
        "--out",
        str(out),
        "--calib-file",
        str(tmp_path / "calib.txt"),
        "--calib-tokens",
        "300",
        "--group-size",
        "64",
        "--calib-generate",
        "2",
        "--calib-generate-tokens",
        "8",
    ]
    assert _run(argv) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "awq int4" in captured.out
    assert "layer 0:" in caplog.text  # progress (the CLI's root handler prints it to stderr)
    report = json.loads((out / "draft_report.json").read_text())
    assert report["calibration"]["tokens"] == 300 and report["group_size_requested"] == 64
    assert report["calibration"]["generated"]["sequences"] == 2
    assert report["calibration"]["generated"]["tokens"] == 2 * (32 + 8)
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    draft = DraftModel.load(out, device="cpu", mode="dequant-cache")
    assert draft.forward(torch.tensor([[1, 2, 3]])).shape == (1, 3, 128)


def test_quantize_cli_int8_needs_no_calibration(plain_dir, tmp_path, capsys) -> None:
    assert _run(["--model", str(plain_dir("mixtral")), "--out", str(tmp_path / "d"), "--method", "int8"]) == 0
    assert "int8 per-channel" in capsys.readouterr().out
    assert json.loads((tmp_path / "d" / "draft_report.json").read_text())["num_bits"] == 8


def test_missing_model_folder(tmp_path, capsys) -> None:
    assert _run(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err and "nope" in err


def test_unsupported_architecture(tmp_path, capsys) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    assert _run(["--model", str(folder), "--out", str(tmp_path / "d"), "--method", "rtn"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unsupported architecture" in err and "llama" in err


def test_awq_on_a_model_without_tokenizer(plain_dir, tmp_path, capsys) -> None:
    (tmp_path / "calib.txt").write_text("some text")
    argv = [
        "--model",
        str(plain_dir("mixtral")),
        "--out",
        str(tmp_path / "d"),
        "--calib-file",
        str(tmp_path / "calib.txt"),
    ]
    assert _run(argv) == 1
    assert "tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--method", "gptq"], "--method"),
        (["--group-size", "0"], "--group-size"),
        (["--calib-tokens", "x"], "--calib-tokens"),
        (["--calib-file", "/no/such/file.txt"], "--calib-file"),
    ],
)
def test_bad_flags_exit_2(flags, needle, plain_dir, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _run(["--model", str(plain_dir("mixtral")), "--out", str(tmp_path / "d"), *flags])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_run_stopped_while_it_writes_leaves_the_earlier_draft_whole(plain_dir, tmp_path, monkeypatch) -> None:
    """Quantizing again into a folder that holds a draft: a run stopped while it writes (Ctrl-C or
    SIGTERM: a ``KeyboardInterrupt`` out of the weights' write, after part of the file) leaves the
    earlier draft byte for byte and nothing beside it; a run that finishes replaces the draft whole,
    keeps what else the folder held, and leaves nothing beside it either. Before, the earlier
    weights were deleted first and the new ones written in place."""
    from specter.draft.quantize import model as quantize_module

    out = tmp_path / "d"
    assert _run(["--model", str(plain_dir("mixtral")), "--out", str(out), "--method", "int8"]) == 0
    (out / "NOTES.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def torn(tensors, path, metadata=None):
        Path(path).write_bytes(b"part of the weights")
        raise KeyboardInterrupt

    rtn = ["--model", str(plain_dir("mixtral")), "--out", str(out), "--method", "rtn"]
    monkeypatch.setattr(quantize_module, "save_file", torn)
    with pytest.raises(KeyboardInterrupt):
        _run(rtn)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["d"]

    monkeypatch.setattr(quantize_module, "save_file", save_file)
    assert _run(rtn) == 0
    assert json.loads((out / "draft_report.json").read_text())["method"] == "rtn"
    assert (out / "NOTES.md").read_text() == "mine" and (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    assert DraftModel.load(out, device="cpu", mode="dequant-cache").forward(torch.tensor([[1, 2, 3]])).shape[-1] > 0


def test_an_out_that_is_a_file_is_refused_before_the_work(plain_dir, tmp_path, capsys, monkeypatch) -> None:
    from specter.draft.quantize import model as quantize_module

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(quantize_module, "build_dense", no_work)
    (tmp_path / "f").write_text("x")
    assert _run(["--model", str(plain_dir("mixtral")), "--out", str(tmp_path / "f"), "--method", "int8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is a file" in err and str(tmp_path / "f") in err
    assert _run(["--model", str(plain_dir("mixtral")), "--out", str(tmp_path / "f" / "d"), "--method", "int8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a folder this process can write into" in err
