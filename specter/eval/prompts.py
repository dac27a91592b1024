"""Prompt sets: JSONL files of ``{"id", "prompt"}`` lines, tokenized with the model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from specter.assets import ASSETS

HELDOUT = ASSETS / "prompts" / "heldout.jsonl"


def read_jsonl(path: str | Path) -> list[dict]:
    """Every line of a JSONL file as a dict, with the line number in errors."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{path}:{number}: expected an object with a non-empty string 'prompt'")
        rows.append(row)
    return rows


def load_prompts(model_dir: str | Path, path: str | Path | None = None, count: int | None = None) -> list[list[int]]:
    """The first ``count`` prompts of ``path`` (default: the shipped held-out set) as token ids."""
    rows = read_jsonl(path or HELDOUT)[:count]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer.encode(row["prompt"]) for row in rows]
