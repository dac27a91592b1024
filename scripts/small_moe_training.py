"""Training and held-out evaluation of a small MoE model: router hooks, the per-layer balance loss, the
AdamW loop, and the held-out loss, expert loads and distinct experts per token window.

Used by ``scripts/train_small_moe.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from small_moe_model import Recipe, moe_shape
from transformers import PreTrainedModel

WINDOWS = (1, 2, 4, 8, 16)
LOAD_LOW, LOAD_HIGH = 0.25, 4.0  # allowed expert load, as a multiple of uniform (1/E)


# ----------------------------------------------------------------------------------------------
# Router hooks and the per-layer balance loss
# ----------------------------------------------------------------------------------------------


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
            row = {"step": step, "loss": mean(recent_ce), "aux": mean(recent_aux), "tok_s": tok_s}
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
        final_train_loss=mean(recent_ce),
        final_aux=mean(recent_aux),
        history=history,
    )


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean (0 for no values)."""
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
