"""Draft fidelity: how closely a draft's routing and tokens follow the target's.

Both models run teacher-forced over the same token sequence (a prompt plus the target's own
greedy continuation), so every position has the same context on both sides. Measures:

* **top-k set agreement** per MoE layer: fraction of positions where the draft's top-k expert
  set equals the target's;
* **window recall@K**: for every window of K consecutive positions (sliding, stride 1) and every
  layer, ``|∪ draft ∩ ∪ target| / |∪ target|``, averaged over windows and layers;
* **next-token agreement**: fraction of positions where the draft's argmax equals the target's;
* **mean accepted length**: accepted draft tokens per round of greedy speculation through
  ``specter.engine.Engine`` (pooled: all accepted tokens / all rounds).

Beside them (not part of the AWQ-vs-RTN verdict): the draft's relative logit error
``‖z_draft − z_target‖ / ‖z_target‖`` and the mean KL divergence of the draft's next-token
distribution from the target's, pooled over the scored positions.

Routing is scored at the positions of the generated tokens (the ones a decode step processes),
next-token agreement at the positions that predict them. The report (rows, tables, the AWQ-vs-RTN
verdict) is ``specter/eval/fidelity_report.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specter.models.routing import Routing

WINDOWS = (1, 2, 4, 8, 16)


class TeacherForced(Protocol):
    """A model with ``forward(input_ids, cache)`` and the routing of its last call."""

    @property
    def last_routing(self) -> Routing: ...

    def new_cache(self) -> Any: ...

    def forward(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor: ...


# -- the measures, on routing tensors ------------------------------------------------------------
def _ids(ids: torch.Tensor) -> torch.Tensor:
    return ids.reshape(-1, ids.shape[-1]).long().cpu()


def set_equal(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Bool (N,): whether the draft's top-k set equals the target's at each of N positions."""
    d, t = _ids(draft_ids), _ids(target_ids)
    if d.shape != t.shape:
        raise ValueError(f"routing: draft ids {tuple(d.shape)} and target ids {tuple(t.shape)} differ in shape")
    return (d.sort(dim=-1).values == t.sort(dim=-1).values).all(dim=-1)


def expert_mask(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(N, E) bool: which experts each position routes to."""
    ids = _ids(ids)
    mask = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool)
    mask.scatter_(1, ids, True)
    return mask


def window_union(mask: torch.Tensor, window: int) -> torch.Tensor:
    """(N - window + 1, E) bool: the experts used anywhere in each sliding window of positions."""
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    counts = torch.cat([torch.zeros(1, mask.shape[1], dtype=torch.long), mask.long().cumsum(0)])
    return (counts[window:] - counts[:-window]) > 0


def window_recall(
    draft_ids: torch.Tensor, target_ids: torch.Tensor, window: int, num_experts: int | None = None
) -> torch.Tensor:
    """Recall of each sliding window (float (W,)): ``|D ∪ ∩ T ∪| / |T ∪|``; empty when N < window."""
    d, t = _ids(draft_ids), _ids(target_ids)
    if d.shape[0] != t.shape[0]:
        raise ValueError(f"routing: draft has {d.shape[0]} positions, target {t.shape[0]}")
    if num_experts is None:
        num_experts = int(max(d.max(), t.max())) + 1 if d.numel() else 1
    du = window_union(expert_mask(d, num_experts), window)
    tu = window_union(expert_mask(t, num_experts), window)
    return (du & tu).sum(-1).double() / tu.sum(-1).clamp(min=1).double()


# -- pooling over prompts ------------------------------------------------------------------------
@dataclass
class FidelityTally:
    """Sums of every measure over sequences; ``summary()`` turns them into fractions."""

    windows: tuple[int, ...] = WINDOWS
    set_hits: dict[int, list[int]] = field(default_factory=dict)  # layer -> [equal, positions]
    recall: dict[int, dict[int, list[float]]] = field(default_factory=dict)  # K -> layer -> [sum, windows]
    token_hits: int = 0
    tokens: int = 0
    logit_err: float = 0.0  # Σ ‖z_d − z_t‖² over scored positions
    logit_ref: float = 0.0  # Σ ‖z_t‖²
    kl: float = 0.0  # Σ KL(p_t ‖ p_d)

    def add(
        self,
        draft_routing: Routing,
        target_routing: Routing,
        draft_logits: torch.Tensor,
        target_logits: torch.Tensor,
        routing_positions: slice,
        logit_positions: slice,
        num_experts: int | None = None,
    ) -> None:
        """One sequence: routings per layer over all T positions, logits (T, V) or (1, T, V)."""
        if set(draft_routing) != set(target_routing):
            raise ValueError(
                f"routing: draft MoE layers {sorted(draft_routing)} differ from target's {sorted(target_routing)}"
            )
        for layer in sorted(target_routing):
            d = _ids(draft_routing[layer][0])[routing_positions]
            t = _ids(target_routing[layer][0])[routing_positions]
            same = set_equal(d, t)
            hit = self.set_hits.setdefault(layer, [0, 0])
            hit[0] += int(same.sum())
            hit[1] += same.numel()
            for k in self.windows:
                r = window_recall(d, t, k, num_experts)
                acc = self.recall.setdefault(k, {}).setdefault(layer, [0.0, 0])
                acc[0] += float(r.sum())
                acc[1] += r.numel()
        d_tok = draft_logits.reshape(-1, draft_logits.shape[-1])[logit_positions].argmax(-1)
        t_tok = target_logits.reshape(-1, target_logits.shape[-1])[logit_positions].argmax(-1)
        self.token_hits += int((d_tok.cpu() == t_tok.cpu()).sum())
        self.tokens += t_tok.numel()
        self.add_logit_error(draft_logits, target_logits, logit_positions)

    def add_logit_error(self, draft_logits: torch.Tensor, target_logits: torch.Tensor, positions: slice) -> None:
        """Accumulate the relative-logit-error and KL sums over ``positions`` of (T, V) logits."""
        d = draft_logits.reshape(-1, draft_logits.shape[-1])[positions].double().cpu()
        t = target_logits.reshape(-1, target_logits.shape[-1])[positions].double().cpu()
        self.logit_err += float((d - t).pow(2).sum())
        self.logit_ref += float(t.pow(2).sum())
        log_t, log_d = t.log_softmax(-1), d.log_softmax(-1)
        self.kl += float((log_t.exp() * (log_t - log_d)).sum())

    def summary(self) -> dict[str, Any]:
        """Per-layer and pooled fractions (NaN where nothing was counted)."""
        per_layer = {layer: fraction(h, n) for layer, (h, n) in sorted(self.set_hits.items())}
        recall_layer = {
            k: {layer: fraction(s, n) for layer, (s, n) in sorted(by_layer.items())}
            for k, by_layer in sorted(self.recall.items())
        }
        recall = {}
        for k, by_layer in sorted(self.recall.items()):
            s = sum(v[0] for v in by_layer.values())
            n = sum(v[1] for v in by_layer.values())
            recall[k] = fraction(s, n)
        values = list(per_layer.values())
        return {
            "topk_set_per_layer": per_layer,
            "topk_set_mean": sum(values) / len(values) if values else math.nan,
            "topk_set_min": min(values) if values else math.nan,
            "topk_set_min_layer": min(per_layer, key=per_layer.__getitem__) if per_layer else None,
            "recall": recall,
            "recall_per_layer": recall_layer,
            "next_token": fraction(self.token_hits, self.tokens),
            "logit_rel_err": math.sqrt(fraction(self.logit_err, self.logit_ref)) if self.logit_ref else math.nan,
            "kl": fraction(self.kl, self.tokens),
            "positions": next(iter(self.set_hits.values()))[1] if self.set_hits else 0,
            "tokens": self.tokens,
        }


def fraction(a: float, b: float) -> float:
    """``a / b``, NaN where nothing was counted (``b`` 0)."""
    return a / b if b else math.nan


# -- the teacher-forced passes -------------------------------------------------------------------
@torch.inference_mode()
def target_pass(model: Any, recorder: Any, ids: Sequence[int]) -> tuple[torch.Tensor, Routing]:
    """Logits (T, V) fp32 and per-layer routing of one teacher-forced target forward."""
    recorder.last.clear()
    out = model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=False)
    return out.logits[0].float().cpu(), {k: (_ids(v[0]), v[1]) for k, v in recorder.last.items()}


@torch.inference_mode()
def draft_pass(draft: TeacherForced, ids: Sequence[int]) -> tuple[torch.Tensor, Routing]:
    """Logits (T, V) fp32 and per-layer routing of one teacher-forced draft forward (fresh cache)."""
    logits = draft.forward(torch.tensor([list(ids)]), draft.new_cache())
    return logits.reshape(-1, logits.shape[-1]).float().cpu(), {
        k: (_ids(v[0]), v[1]) for k, v in draft.last_routing.items()
    }


@torch.inference_mode()
def measure_teacher_forced(
    draft: TeacherForced,
    sequences: Iterable[tuple[list[int], int, torch.Tensor, Routing]],
    windows: tuple[int, ...] = WINDOWS,
    num_experts: int | None = None,
    region: str = "generated",
) -> list[FidelityTally]:
    """One tally per (ids, prompt_len, target logits, target routing) sequence; ``merge`` pools them.

    ``region``: ``generated`` scores the continuation (routing at the generated tokens' positions,
    logits at the positions that predict them); ``prompt`` scores the prompt itself (real text:
    routing at every prompt position, logits at the positions that predict prompt tokens 1..P-1).
    """
    if region not in ("generated", "prompt"):
        raise ValueError(f"region: 'generated' or 'prompt', got {region!r}")
    tallies = []
    for ids, prompt_len, t_logits, t_routing in sequences:
        d_logits, d_routing = draft_pass(draft, ids)
        tally = FidelityTally(windows)
        if region == "generated":
            routing_positions, logit_positions = slice(prompt_len, len(ids)), slice(prompt_len - 1, len(ids) - 1)
        else:
            routing_positions, logit_positions = slice(0, prompt_len), slice(0, prompt_len - 1)
        tally.add(d_routing, t_routing, d_logits, t_logits, routing_positions, logit_positions, num_experts)
        tallies.append(tally)
    return tallies


@torch.inference_mode()
def logit_error_on_text(model: Any, draft: TeacherForced, ids: Sequence[int], chunk: int = 512) -> dict[str, float]:
    """Relative logit error and mean KL of ``draft`` against the HF ``model`` over ``ids`` (e.g.
    the calibration text), run in independent chunks of ``chunk`` tokens."""
    tally = FidelityTally(())
    for start in range(0, len(ids), chunk):
        part = list(ids[start : start + chunk])
        out = model(input_ids=torch.tensor([part], device=model.device), use_cache=False)
        d_logits, _ = draft_pass(draft, part)
        tally.add_logit_error(d_logits, out.logits[0].float().cpu(), slice(None))
        tally.tokens += len(part)
    return {"logit_rel_err": math.sqrt(fraction(tally.logit_err, tally.logit_ref)), "kl": fraction(tally.kl, tally.tokens),
            "tokens": tally.tokens}


def merge(tallies: Iterable[FidelityTally]) -> FidelityTally:
    """The sum of several tallies (same windows)."""
    out: FidelityTally | None = None
    for t in tallies:
        if out is None:
            out = FidelityTally(t.windows)
        for layer, (h, n) in t.set_hits.items():
            acc = out.set_hits.setdefault(layer, [0, 0])
            acc[0] += h
            acc[1] += n
        for k, by_layer in t.recall.items():
            for layer, (total, windows) in by_layer.items():
                racc = out.recall.setdefault(k, {}).setdefault(layer, [0.0, 0])
                racc[0] += total
                racc[1] += windows
        out.token_hits += t.token_hits
        out.tokens += t.tokens
        out.logit_err += t.logit_err
        out.logit_ref += t.logit_ref
        out.kl += t.kl
    if out is None:
        raise ValueError("merge: no tallies")
    return out


def measure_acceptance(
    target: Any, draft: Any, prompts: Sequence[list[int]], new_tokens: int, window: int,
    expected: Sequence[list[int]] | None = None,
) -> dict[str, Any]:
    """Greedy speculation with ``draft`` proposing ``window`` tokens a round.

    ``per_prompt`` holds (accepted draft tokens, rounds, drafted tokens) per prompt;
    ``mean_accepted`` pools them (all accepted / all rounds).
    """
    from specter.engine import Engine

    engine = Engine(target, draft, window)
    per_prompt = []
    same = 0
    for i, prompt in enumerate(prompts):
        tokens, stats = engine.generate(list(prompt), new_tokens)
        accepted = sum(i * c for i, c in enumerate(stats.extra["accepted_hist"]))
        per_prompt.append((accepted, int(stats.extra["rounds"]), int(stats.extra["drafted"])))
        if expected is not None:
            same += tokens == list(expected[i])
    accepted, rounds, drafted = (sum(p[j] for p in per_prompt) for j in range(3))
    return {
        "window": window,
        "mean_accepted": fraction(accepted, rounds),
        "acceptance_rate": fraction(accepted, drafted),
        "accepted": accepted,
        "rounds": rounds,
        "drafted": drafted,
        "per_prompt": per_prompt,
        "lossless_prompts": same if expected is not None else None,
    }
