#!/usr/bin/env python
"""Train the project's own small mixture-of-experts models on the Python standard library.

Two shipped models (see ``specter/assets/``):

* ``coarse`` -- Mixtral-style (``MixtralForCausalLM``): 8 experts, top-2.
* ``fine``   -- Qwen2-MoE-style (``Qwen2MoeForCausalLM``): 64 routed experts, top-4, one shared
  expert with its sigmoid gate. The fine-grained regime, where a short window of tokens does not
  touch every expert of a layer.

Everything is offline and deterministic: the corpus is the ``.py`` sources of this interpreter's
standard library (sorted by path, split by file), the tokenizer is a byte-level BPE trained on the
train split, seeds and data order are fixed and torch uses a fixed number of threads (``--threads``,
default 1: see ``DEFAULT_THREADS``).

The loss is next-token cross-entropy plus a *per-layer* Switch-style load-balance term
(``E * sum_e f_e * P_e`` computed for each layer separately, then averaged over layers); router
logits are captured with forward hooks on ``model.model.layers[i].mlp.gate``.

After training the model is cast to bf16, saved with ``save_pretrained``, reloaded from disk and
evaluated on the held-out split (loss, per-layer expert loads, distinct experts per token window).
A model card (``README.md``) and ``training_report.json`` are written next to the weights.

Examples::

    python scripts/train_small_moe.py --model fine --out specter/assets/moe-fine \
        --write-prompts specter/assets/prompts
    python scripts/train_small_moe.py --model coarse --out specter/assets/moe-coarse
    python scripts/train_small_moe.py --prompts-only                          # prompt files only
    python scripts/train_small_moe.py --model fine --out /tmp/fine --steps 20  # smoke run
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import shlex
import sys
import sysconfig
import time
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
HELDOUT_EVERY = 20  # file i (in sorted order) is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
# Directories left out of the corpus: third-party code, test suites, generated codec tables
# (encodings/) and the 750 KB English documentation dump (pydoc_data/).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)
WINDOWS = (1, 2, 4, 8, 16)
LOAD_LOW, LOAD_HIGH = 0.25, 4.0  # allowed expert load, as a multiple of uniform (1/E)
# One torch thread by default: on a 2-core machine that something else also uses, two OpenMP threads
# stall at every parallel region behind a descheduled thread (measured 3-10x slower than one thread).
DEFAULT_THREADS = 1


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


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """Architecture and optimisation settings of one shipped model."""

    name: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    balance_coef: float
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


RECIPES: dict[str, Recipe] = {
    "coarse": Recipe(
        name="coarse", steps=800, batch_size=4, seq_len=256, lr=3e-3, warmup=50, balance_coef=0.05
    ),
    "fine": Recipe(name="fine", steps=900, batch_size=4, seq_len=256, lr=3e-3, warmup=50, balance_coef=0.2),
}


def build_config(kind: str, tok: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model config of ``kind`` ("coarse" or "fine") for this tokenizer."""
    eot = tok.convert_tokens_to_ids(EOT)
    common = {
        "vocab_size": len(tok),
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "output_router_logits": False,  # the balance loss is added by this script, per layer
    }
    if kind == "coarse":
        return MixtralConfig(
            num_hidden_layers=4,
            intermediate_size=512,
            num_local_experts=8,
            num_experts_per_tok=2,
            **common,
        )
    if kind == "fine":
        return Qwen2MoeConfig(
            num_hidden_layers=4,
            intermediate_size=512,  # unused: every layer is sparse (decoder_sparse_step=1)
            moe_intermediate_size=64,
            shared_expert_intermediate_size=256,
            num_experts=64,
            num_experts_per_tok=4,
            norm_topk_prob=True,  # top-k weights sum to 1 (as Qwen3-MoE); with raw probs experts learn ~E/k x slower
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    raise ValueError(f"unknown model kind {kind!r}; expected 'coarse' or 'fine'")


def build_model(config: PretrainedConfig) -> PreTrainedModel:
    """A freshly initialised fp32 model for ``config`` (seed set by the caller)."""
    cls = MixtralForCausalLM if config.model_type == "mixtral" else Qwen2MoeForCausalLM
    model = cls(config)
    model.config.use_cache = False
    return model.float()


def moe_shape(config: PretrainedConfig) -> tuple[int, int]:
    """(number of routed experts, top-k) for a Mixtral or Qwen2-MoE config."""
    experts = config.num_local_experts if config.model_type == "mixtral" else config.num_experts
    return int(experts), int(config.num_experts_per_tok)


class RouterCapture:
    """Forward hooks on every layer's router; keeps (logits, top-k indices) of the last forward."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.logits: list[torch.Tensor | None] = []
        self.indices: list[torch.Tensor | None] = []
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            self.logits.append(None)
            self.indices.append(None)
            self._handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))

    def _hook(self, layer: int) -> Callable[[torch.nn.Module, tuple, tuple], None]:
        def hook(_module: torch.nn.Module, _inputs: tuple, output: tuple) -> None:
            logits, _scores, indices = output
            self.logits[layer] = logits
            self.indices[layer] = indices

        return hook

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()


def balance_loss(capture: RouterCapture, num_experts: int) -> torch.Tensor:
    """Switch-style ``E * sum_e f_e * P_e`` for each layer separately, averaged over layers.

    ``f_e`` is the share of routed token-slots that went to expert ``e`` (no gradient), ``P_e`` the
    mean router probability of ``e``. It equals 1 when routing is uniform.
    """
    terms = []
    for logits, indices in zip(capture.logits, capture.indices, strict=True):
        assert logits is not None and indices is not None, "router hook did not fire"
        probs = torch.softmax(logits.float(), dim=-1)
        counts = torch.bincount(indices.reshape(-1), minlength=num_experts).float()
        frac = counts / counts.sum()
        terms.append(num_experts * torch.sum(frac * probs.mean(dim=0)))
    return torch.stack(terms).mean()


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def batches(tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless (batch, seq_len + 1) windows of the token stream, shuffled per epoch with a fixed seed."""
    n_chunks = (len(tokens) - 1) // seq_len
    if n_chunks < batch_size:
        raise ValueError(f"token stream too short: {len(tokens)} tokens for batch {batch_size}x{seq_len}")
    starts = torch.arange(n_chunks) * seq_len
    offsets = torch.arange(seq_len + 1)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = starts[torch.randperm(n_chunks, generator=gen)]
        for b in range(n_chunks // batch_size):
            idx = order[b * batch_size : (b + 1) * batch_size, None] + offsets
            yield tokens[idx]


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to ``min_ratio``."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


@dataclass
class TrainStats:
    """What the training loop measured."""

    steps: int
    tokens_seen: int
    seconds: float
    final_train_loss: float  # mean CE over the last 50 steps
    final_aux: float
    history: list[dict[str, float]] = field(default_factory=list)


def train(model: PreTrainedModel, tokens: torch.Tensor, recipe: Recipe, steps: int, seed: int) -> TrainStats:
    """AdamW + warmup/cosine on CE + per-layer balance loss; a progress line every 50 steps."""
    num_experts, _ = moe_shape(model.config)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe.warmup, steps, recipe.min_lr_ratio))
    capture = RouterCapture(model)
    data = batches(tokens, recipe.seq_len, recipe.batch_size, seed)
    model.train()
    t0 = time.perf_counter()
    recent_ce: list[float] = []
    recent_aux: list[float] = []
    history: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        batch = next(data)
        logits = model(input_ids=batch[:, :-1]).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        aux = balance_loss(capture, num_experts)
        loss = ce + recipe.balance_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        sched.step()
        recent_ce = (recent_ce + [ce.item()])[-50:]
        recent_aux = (recent_aux + [aux.item()])[-50:]
        if step % 50 == 0 or step == steps:
            elapsed = time.perf_counter() - t0
            tok_s = step * recipe.batch_size * recipe.seq_len / elapsed
            eta = elapsed / step * (steps - step)
            row = {"step": step, "loss": _mean(recent_ce), "aux": _mean(recent_aux), "tok_s": tok_s}
            history.append(row)
            print(
                f"step {step:5d}/{steps}  loss {row['loss']:.4f}  aux {row['aux']:.4f}  "
                f"lr {sched.get_last_lr()[0]:.2e}  {tok_s:7.0f} tok/s  elapsed {elapsed / 60:5.1f} min  "
                f"ETA {eta / 60:5.1f} min",
                flush=True,
            )
    capture.remove()
    model.eval()
    return TrainStats(
        steps=steps,
        tokens_seen=steps * recipe.batch_size * recipe.seq_len,
        seconds=time.perf_counter() - t0,
        final_train_loss=_mean(recent_ce),
        final_aux=_mean(recent_aux),
        history=history,
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / max(1, len(xs))


# ----------------------------------------------------------------------------------------------
# Evaluation on the held-out split
# ----------------------------------------------------------------------------------------------


@dataclass
class EvalStats:
    """Held-out figures of one model."""

    loss: float
    perplexity: float
    tokens: int
    loads: list[list[float]]  # [layer][expert] share of routed token-slots
    distinct_per_window: dict[int, list[float]]  # window -> per-layer mean distinct experts

    def load_ratios(self) -> list[tuple[float, float]]:
        """Per layer (min, max) load as a multiple of uniform."""
        return [(min(layer) * len(layer), max(layer) * len(layer)) for layer in self.loads]

    def gates_ok(self) -> bool:
        """Every expert of every layer within [LOAD_LOW, LOAD_HIGH] x uniform."""
        return all(lo >= LOAD_LOW and hi <= LOAD_HIGH for lo, hi in self.load_ratios())


@torch.no_grad()
def evaluate(model: PreTrainedModel, tokens: torch.Tensor, seq_len: int, batch_size: int = 8) -> EvalStats:
    """Held-out CE over non-overlapping windows, expert loads and distinct experts per token window."""
    num_experts, _ = moe_shape(model.config)
    n_seq = (len(tokens) - 1) // seq_len
    if n_seq == 0:
        raise ValueError("held-out token stream shorter than one sequence")
    seqs = torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_seq)])
    capture = RouterCapture(model)
    n_layers = len(capture.logits)
    total_nll = 0.0
    masks: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    model.eval()
    for b in range(0, n_seq, batch_size):
        batch = seqs[b : b + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total_nll += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        for layer, idx in enumerate(capture.indices):
            assert idx is not None
            one_hot = F.one_hot(idx.reshape(len(batch), seq_len, -1), num_experts).sum(dim=2) > 0
            masks[layer].append(one_hot)
    capture.remove()
    n_tok = n_seq * seq_len
    loads: list[list[float]] = []
    distinct: dict[int, list[float]] = {w: [] for w in WINDOWS}
    for layer in range(n_layers):
        mask = torch.cat(masks[layer])  # (n_seq, seq_len, E) bool: expert used by token
        loads.append((mask.sum(dim=(0, 1)).double() / mask.sum()).tolist())
        csum = torch.cat([torch.zeros_like(mask[:, :1], dtype=torch.int32), mask.int().cumsum(dim=1)], dim=1)
        for w in WINDOWS:
            used = (csum[:, w:] - csum[:, :-w]) > 0  # (n_seq, seq_len - w + 1, E)
            distinct[w].append(used.sum(dim=-1).double().mean().item())
    loss = total_nll / n_tok
    return EvalStats(
        loss=loss, perplexity=math.exp(loss), tokens=n_tok, loads=loads, distinct_per_window=distinct
    )


# ----------------------------------------------------------------------------------------------
# Saving, report and model card
# ----------------------------------------------------------------------------------------------


def save_model(model: PreTrainedModel, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Cast to bf16 and save weights, config, generation config and tokenizer into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.use_cache = True
    eot = tok.convert_tokens_to_ids(EOT)
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False, max_new_tokens=128
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for path in out.iterdir():  # safetensors writes 0600; the files ship inside the package
        if path.is_file():
            path.chmod(0o644)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_report(
    args: argparse.Namespace,
    recipe: Recipe,
    model: PreTrainedModel,
    corpus: Corpus,
    token_counts: dict[str, int],
    stats: TrainStats,
    fp32_loss: float,
    ev: EvalStats,
    out: Path,
) -> dict:
    """All figures of the run, machine-readable."""
    num_experts, top_k = moe_shape(model.config)
    weights = out / "model.safetensors"
    ratios = ev.load_ratios()
    return {
        "model": args.model,
        "architecture": model.config.architectures[0] if model.config.architectures else type(model).__name__,
        "model_type": model.config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_experts": num_experts,
        "top_k": top_k,
        "config": _config_summary(model.config),
        "weights_file_bytes": weights.stat().st_size,
        "weights_sha256": sha256(weights),
        "data": {
            "corpus": "CPython standard library .py sources of the training interpreter",
            "python_version": platform.python_version(),
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "split": f"files sorted by relative path; file i held out when i % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1}",
            "train_files": len(corpus.train_files),
            "heldout_files": len(corpus.heldout_files),
            "train_tokens": token_counts["train"],
            "heldout_tokens": token_counts["heldout"],
            "vocab_size": model.config.vocab_size,
        },
        "training": {
            "command": command_line(),
            "seed": args.seed,
            "recipe": asdict(recipe),
            "steps": stats.steps,
            "tokens_seen": stats.tokens_seen,
            "epochs": stats.tokens_seen / token_counts["train"],
            "seconds": round(stats.seconds, 1),
            "final_train_loss": stats.final_train_loss,
            "final_balance_aux": stats.final_aux,
            "history": stats.history,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
        },
        "heldout": {
            "loss": ev.loss,
            "perplexity": ev.perplexity,
            "loss_fp32_before_bf16_cast": fp32_loss,
            "tokens_evaluated": ev.tokens,
            "note": "shipped bf16 weights, reloaded from disk, computed in fp32; non-overlapping 256-token windows",
        },
        "expert_load": {
            "bounds_vs_uniform": [LOAD_LOW, LOAD_HIGH],
            "per_layer_share": ev.loads,
            "per_layer_min_vs_uniform": [r[0] for r in ratios],
            "per_layer_max_vs_uniform": [r[1] for r in ratios],
            "within_bounds": ev.gates_ok(),
        },
        "distinct_experts_per_window": {
            str(w): {"per_layer": v, "mean": _mean(v)} for w, v in ev.distinct_per_window.items()
        },
    }


def _config_summary(config: PretrainedConfig) -> dict:
    keys = [
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
        "max_position_embeddings", "intermediate_size", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_local_experts", "num_experts", "num_experts_per_tok",
        "norm_topk_prob", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ]  # fmt: skip
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


def command_line() -> str:
    """The command that is running, as it could be typed again."""
    return "python scripts/train_small_moe.py " + shlex.join(sys.argv[1:])


def render_card(report: dict) -> str:
    """The model card (markdown) for ``report``."""
    return "\n".join(_card_setup(report) + _card_results(report))


def _card_setup(report: dict) -> list[str]:
    """Card sections: config, data, training."""
    cfg, data, tr = report["config"], report["data"], report["training"]
    e, k = report["num_experts"], report["top_k"]
    return [
        f"# Specter small MoE: `{report['model']}` ({report['architecture']})",
        "",
        "A small mixture-of-experts language model of Python source code, trained by the Specter project",
        "itself so that routing is learned (random weights route with tiny margins and say nothing about",
        "expert prediction). It is the benchmark target; its AWQ-quantized copy is the draft.",
        "",
        "## Config",
        "",
        f"* `model_type` = `{report['model_type']}`, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV heads), vocab {cfg['vocab_size']}, "
        f"max positions {cfg['max_position_embeddings']}, tied embeddings: {cfg['tie_word_embeddings']}",
        f"* {e} routed experts per layer, top-{k}"
        + (
            f", expert size {cfg['moe_intermediate_size']}, one shared expert of size "
            f"{cfg['shared_expert_intermediate_size']} with a sigmoid gate, norm_topk_prob={cfg['norm_topk_prob']}"
            if report["model_type"] == "qwen2_moe"
            else f", expert size {cfg['intermediate_size']} (top-k weights renormalised, as Mixtral)"
        ),
        f"* parameters: {report['num_parameters']:,}; `model.safetensors`: {report['weights_file_bytes']:,} bytes "
        f"(bf16, per-expert keys as transformers writes them)",
        f"* eos = bos = pad = `{EOT}` (id {cfg['eos_token_id']})",
        "",
        "## Data",
        "",
        f"* {data['corpus']} (Python {data['python_version']}), found with `sysconfig.get_paths()['stdlib']`.",
        f"* Excluded folders: {', '.join('`' + d + '`' for d in data['excluded_dirs'])} "
        "(third-party code, test suites, generated codec tables, the documentation dump).",
        f"* Split by file: {data['split']}: {data['train_files']} train files ({data['train_tokens']:,} tokens), "
        f"{data['heldout_files']} held-out files ({data['heldout_tokens']:,} tokens).",
        f"* Tokenizer: byte-level BPE (`tokenizers`), vocab {data['vocab_size']}, trained on the train split; "
        f"every file is preceded by `{EOT}`. Decoding round-trips text exactly.",
        "",
        "## Training",
        "",
        f"* {tr['steps']} steps of batch {tr['recipe']['batch_size']} x {tr['recipe']['seq_len']} tokens "
        f"({tr['tokens_seen']:,} tokens, {tr['epochs']:.2f} epochs), {tr['seconds'] / 60:.1f} min on "
        f"{tr['threads']} CPU thread(s), fp32, seed {tr['seed']}; {tr['wall_seconds_total'] / 60:.1f} min wall "
        "clock for the whole command (tokenizer, training, evaluation).",
        "* Budget: ~15 min of one core of a shared 2-core CPU per model, so the model is undertrained: it has "
        "learned, balanced routing for expert-offloading studies, not the skill to write good code.",
        f"* AdamW (betas 0.9/0.95, weight decay {tr['recipe']['weight_decay']}), peak lr {tr['recipe']['lr']}, "
        f"{tr['recipe']['warmup']} warmup steps, cosine to {tr['recipe']['min_lr_ratio']} x peak, "
        f"grad clip {tr['recipe']['grad_clip']}.",
        f"* Loss: next-token cross-entropy + {tr['recipe']['balance_coef']} x per-layer load balance "
        "(`E * sum_e f_e * P_e` per layer from hooks on each router, averaged over layers).",
        f"* Final train loss (mean of last 50 steps): {tr['final_train_loss']:.4f}; balance term "
        f"{tr['final_balance_aux']:.4f} (1.0 = uniform).",
        "* Prompt files shared by both models (`../prompts/`, written by `--write-prompts`): `heldout.jsonl`, "
        "8-32-token prompts cut at line boundaries from `def`/`class` lines of the held-out files; "
        "`calibration.txt`, ~64 KiB of train-split excerpts for the AWQ draft's calibration.",
        "",
    ]


def _card_results(report: dict) -> list[str]:
    """Card sections: held-out results, expert loads, distinct experts per window, how to reproduce."""
    cfg, tr, ho, load = report["config"], report["training"], report["heldout"], report["expert_load"]
    e = report["num_experts"]
    lines = [
        "## Held-out results",
        "",
        f"* Loss {ho['loss']:.4f} nats/token, perplexity {ho['perplexity']:.2f} over {ho['tokens_evaluated']:,} "
        f"tokens ({ho['note']}); fp32 weights before the bf16 cast: {ho['loss_fp32_before_bf16_cast']:.4f}.",
        "",
        f"Expert load per layer: share of routed token-slots, as a multiple of uniform (1/{e}). "
        f"Gate: every expert within {load['bounds_vs_uniform'][0]}x..{load['bounds_vs_uniform'][1]}x "
        f"-- **{'passed' if load['within_bounds'] else 'FAILED'}**.",
        "",
        "| layer | min share | max share | min / uniform | max / uniform |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, shares in enumerate(load["per_layer_share"]):
        lines.append(
            f"| {i} | {min(shares):.4f} | {max(shares):.4f} | {load['per_layer_min_vs_uniform'][i]:.2f} | "
            f"{load['per_layer_max_vs_uniform'][i]:.2f} |"
        )
    lines += [
        "",
        f"Distinct experts touched per layer by a window of consecutive held-out tokens (of {e}; "
        "sliding windows, mean over positions):",
        "",
        "| window | " + " | ".join(f"layer {i}" for i in range(cfg["num_hidden_layers"])) + " | mean |",
        "| --- " * (cfg["num_hidden_layers"] + 2) + "|",
    ]
    for w, row in report["distinct_experts_per_window"].items():
        lines.append(
            f"| {w} | " + " | ".join(f"{v:.2f}" for v in row["per_layer"]) + f" | {row['mean']:.2f} |"
        )
    lines += [
        "",
        "## Reproduce",
        "",
        "```",
        tr["command"],
        "```",
        "",
        f"torch {tr['torch']}, transformers {tr['transformers']}. Full figures, including per-expert loads and "
        "the loss curve: `training_report.json`.",
        "",
    ]
    return lines


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(RECIPES), help="which model to train")
    p.add_argument("--out", type=Path, help="output folder (weights, tokenizer, card, report)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads (part of the recipe)")
    p.add_argument("--balance-coef", type=float, default=None, help="per-layer balance loss coefficient")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument(
        "--write-prompts",
        type=Path,
        nargs="?",
        const=Path("specter/assets/prompts"),
        default=None,
        help="also (re)write heldout.jsonl and calibration.txt into this folder "
        "(default when given without a value: specter/assets/prompts)",
    )
    p.add_argument(
        "--prompts-only",
        action="store_true",
        help="train the tokenizer, write the prompt files (--write-prompts, default specter/assets/prompts) "
        "and the tokenizer (into --out if given), then stop without training a model",
    )
    args = p.parse_args(argv)
    if args.prompts_only:
        args.write_prompts = args.write_prompts or Path("specter/assets/prompts")
    elif args.model is None or args.out is None:
        p.error("--model and --out are required (unless --prompts-only)")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def recipe_for(args: argparse.Namespace) -> Recipe:
    """The model's recipe with command-line overrides applied."""
    base = RECIPES[args.model]
    overrides = {
        "steps": args.steps,
        "balance_coef": args.balance_coef,
        "lr": args.lr,
        "batch_size": args.batch_size,
    }
    return Recipe(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})


def set_determinism(seed: int, threads: int) -> None:
    """Fixed seeds and thread count."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


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


def print_summary(ev: EvalStats, fp32_loss: float, report: dict) -> None:
    """Held-out figures on stdout."""
    print(
        f"held-out loss {ev.loss:.4f} (ppl {ev.perplexity:.2f}); fp32 before cast {fp32_loss:.4f}", flush=True
    )
    for i, (lo, hi) in enumerate(ev.load_ratios()):
        print(f"layer {i}: expert load min {lo:.2f}x max {hi:.2f}x uniform", flush=True)
    for w, v in ev.distinct_per_window.items():
        print(f"window {w:2d}: {_mean(v):.2f} distinct experts per layer", flush=True)
    print(
        f"weights {report['weights_file_bytes'] / 1e6:.1f} MB; wall {report['training']['wall_seconds_total'] / 60:.1f} min",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Train, save, evaluate and document one model; non-zero exit if a quality gate fails."""
    args = parse_args(argv)
    set_determinism(args.seed, args.threads)
    wall0 = time.perf_counter()
    data = load_data()
    if args.write_prompts is not None:
        sizes = write_prompt_files(data.corpus, data.tok, args.write_prompts)
        print(f"prompt files written to {args.write_prompts}: {sizes}", flush=True)
    if args.prompts_only:
        if args.out is not None:
            data.tok.save_pretrained(args.out)
            print(f"tokenizer written to {args.out}", flush=True)
        return 0

    recipe = recipe_for(args)
    torch.manual_seed(args.seed)
    model = build_model(build_config(args.model, data.tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params:,} parameters; {recipe}", flush=True)
    stats = train(model, data.train_tokens, recipe, recipe.steps, args.seed)
    fp32_loss = evaluate(model, data.heldout_tokens, recipe.seq_len).loss

    save_model(model, data.tok, args.out)
    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    ev = evaluate(shipped, data.heldout_tokens, recipe.seq_len)
    report = build_report(args, recipe, shipped, data.corpus, data.counts(), stats, fp32_loss, ev, args.out)
    report["training"]["wall_seconds_total"] = round(time.perf_counter() - wall0, 1)
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (args.out / "README.md").write_text(render_card(report), encoding="utf-8")
    print_summary(ev, fp32_loss, report)
    if not ev.gates_ok():
        print(
            f"GATE FAILED: some expert load is outside {LOAD_LOW}x..{LOAD_HIGH}x uniform; "
            "raise --balance-coef and retrain",
            file=sys.stderr,
        )
        return 2
    print(f"saved to {args.out}; all gates passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
