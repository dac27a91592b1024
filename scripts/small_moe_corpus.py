"""The small MoE models' data: the standard-library corpus, its byte-level BPE tokenizer, the token
streams of both splits, and the prompt files (held-out prompts, calibration text) shared by both models.

Used by ``scripts/train_small_moe.py``.
"""

from __future__ import annotations

import ast
import json
import sysconfig
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
HELDOUT_EVERY = 20  # file i (in sorted order) is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
# Directories left out of the corpus: third-party code, test suites, generated codec tables
# (encodings/) and the 750 KB English documentation dump (pydoc_data/).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)


# ----------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ----------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """The standard-library sources, split by file into train and held-out."""

    root: Path
    train_files: list[Path]
    heldout_files: list[Path]

    def rel(self, path: Path) -> str:
        """Path relative to the stdlib root, with forward slashes."""
        return path.relative_to(self.root).as_posix()


def stdlib_root() -> Path:
    """The folder holding this interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder not found: {root}")
    return root


def find_corpus(root: Path) -> Corpus:
    """List the corpus files sorted by path and split them deterministically by file."""
    files = sorted(
        (p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if len(files) < 2 * HELDOUT_EVERY:
        raise RuntimeError(f"only {len(files)} .py files found under {root}; is this a full Python install?")
    train = [p for i, p in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [p for i, p in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return Corpus(root=root, train_files=train, heldout_files=heldout)


def read_source(path: Path) -> str:
    """Read a Python source file honouring its coding declaration; normalise line endings."""
    with tokenize.open(path) as f:
        return f.read().replace("\r\n", "\n")


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style) with ``<|endoftext|>`` as its only special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_files(tok: PreTrainedTokenizerFast, texts: Sequence[str]) -> torch.Tensor:
    """One token stream: every file preceded by ``<|endoftext|>``."""
    eot = tok.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def check_round_trip(tok: PreTrainedTokenizerFast, texts: Sequence[str]) -> None:
    """Fail loudly if decoding does not give back the encoded text."""
    for text in texts:
        back = tok.decode(tok.encode(text, add_special_tokens=False))
        if back != text:
            raise RuntimeError("tokenizer round trip failed: decode(encode(text)) != text")


@dataclass
class Data:
    """Corpus, tokenizer and the two token streams."""

    corpus: Corpus
    tok: PreTrainedTokenizerFast
    train_tokens: torch.Tensor
    heldout_tokens: torch.Tensor

    def counts(self) -> dict[str, int]:
        """Token counts of the two splits."""
        return {"train": len(self.train_tokens), "heldout": len(self.heldout_tokens)}


def load_data() -> Data:
    """Find the corpus, train the tokenizer and tokenize both splits."""
    corpus = find_corpus(stdlib_root())
    train_texts = [read_source(p) for p in corpus.train_files]
    heldout_texts = [read_source(p) for p in corpus.heldout_files]
    print(
        f"corpus: {len(train_texts)} train / {len(heldout_texts)} held-out files under {corpus.root}",
        flush=True,
    )
    tok = train_tokenizer(train_texts)
    check_round_trip(tok, heldout_texts[:5])
    data = Data(corpus, tok, encode_files(tok, train_texts), encode_files(tok, heldout_texts))
    counts = data.counts()
    print(
        f"tokens: {counts['train']:,} train / {counts['heldout']:,} held-out (vocab {len(tok)})", flush=True
    )
    return data


# ----------------------------------------------------------------------------------------------
# Prompts and calibration text (for the benchmark and the AWQ draft)
# ----------------------------------------------------------------------------------------------


def extract_prompt(lines: list[str], start: int, tok: PreTrainedTokenizerFast, max_tokens: int) -> str:
    """Whole lines from ``start`` while the prompt stays within ``max_tokens`` tokens."""
    prompt = ""
    for line in lines[start : start + 12]:
        candidate = prompt + line
        if len(tok.encode(candidate, add_special_tokens=False)) > max_tokens:
            break
        prompt = candidate
    return prompt


def definition_lines(source: str) -> list[int]:
    """0-based line numbers of every ``def``/``class`` statement (decorators excluded), in order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    nodes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return sorted({n.lineno - 1 for n in ast.walk(tree) if isinstance(n, nodes)})


def heldout_prompts(
    corpus: Corpus, tok: PreTrainedTokenizerFast, per_file: int = 2, min_tokens: int = 8, max_tokens: int = 32
) -> list[dict[str, str]]:
    """Up to ``per_file`` prompts per held-out file, each starting at a real ``def``/``class`` line."""
    prompts: list[dict[str, str]] = []
    for path in corpus.heldout_files:
        source = read_source(path)
        lines = source.splitlines(keepends=True)
        taken = 0
        for i in definition_lines(source):
            if taken >= per_file:
                break
            prompt = extract_prompt(lines, i, tok, max_tokens)
            if len(tok.encode(prompt, add_special_tokens=False)) >= min_tokens:
                prompts.append({"id": f"{corpus.rel(path)}:{i + 1}", "prompt": prompt})
                taken += 1
    return prompts


def calibration_text(corpus: Corpus, target_bytes: int = 64 * 1024, pieces: int = 32) -> str:
    """About ``target_bytes`` of train-split text: line-aligned excerpts of at most ``target_bytes / pieces``
    bytes from evenly spaced train files (each from a third of the way in, past the header), until full."""
    per_piece = target_bytes // pieces
    step = max(1, len(corpus.train_files) // pieces)
    order = [p for offset in range(step) for p in corpus.train_files[offset::step]]
    out: list[str] = []
    size = 0
    for path in order:
        if size >= target_bytes:
            break
        text = read_source(path)
        start = text.find("\n", len(text) // 3) + 1
        excerpt = text[start : start + min(per_piece, target_bytes - size)]
        excerpt = excerpt[: excerpt.rfind("\n") + 1]
        if excerpt.strip():
            out.append(excerpt)
            size += len(excerpt.encode("utf-8")) + 1
    return "\n".join(out)


def write_prompt_files(corpus: Corpus, tok: PreTrainedTokenizerFast, prompts_dir: Path) -> dict[str, int]:
    """Write ``heldout.jsonl`` and ``calibration.txt``; return their sizes."""
    prompts_dir.mkdir(parents=True, exist_ok=True)
    prompts = heldout_prompts(corpus, tok)
    if len(prompts) < 40:
        raise RuntimeError(f"only {len(prompts)} held-out prompts found (need >= 40)")
    with open(prompts_dir / "heldout.jsonl", "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    calib = calibration_text(corpus)
    (prompts_dir / "calibration.txt").write_text(calib, encoding="utf-8")
    return {"heldout_prompts": len(prompts), "calibration_bytes": len(calib.encode("utf-8"))}
