"""Record what every routed expert of the target actually sees on calibration text.

The target is built the way Specter runs it (dense parts through transformers, every routed
expert in one ``ExpertStore``) and its MoE layers are sent, through the loader's ``specter``
experts hook, to a recorder that computes exactly transformers' eager expert loop while it
keeps, per (layer, expert), the inputs routed to it, the intermediate activation
``act(gate x) * up x`` that ``down`` receives, and the router weight each token gives the
expert's output (what the expert's error is multiplied by in the layer's output). A seeded
reservoir keeps at most ``cap`` tokens per expert, spread uniformly over everything recorded, so
memory stays bounded.

Besides the calibration text, the target's **own greedy continuations** are recorded
(``GenerationSpec``): windows taken evenly from the calibration tokens are continued by the
target, and each window plus its continuation is run as one sequence. What the target writes
(repetitive loops, for small models) is what a draft must follow at run time, and plain text
alone does not show the quantizer those activations (docs/draft.md). Only calibration tokens
are used as prompts, and everything is deterministic (greedy decoding, fixed window positions).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specter.assets import ASSETS
from specter.experts.store import ExpertStore
from specter.models.greedy import greedy_continuation
from specter.models.loader import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_CALIBRATION = ASSETS / "prompts" / "calibration.txt"


@dataclass
class ExpertInputs:
    """Calibration inputs of one expert: ``x`` (n, H) and ``h`` (n, I), fp32; ``seen`` counts all
    tokens routed to it (``n = min(seen, cap)``); ``w`` (n,) the router weight of each kept token
    (None: not recorded)."""

    x: torch.Tensor
    h: torch.Tensor
    seen: int = 0
    w: torch.Tensor | None = None


@dataclass(frozen=True)
class GenerationSpec:
    """Self-generated calibration: ``windows`` prompts of ``prompt_tokens`` calibration tokens,
    evenly spaced over the calibration ids, each greedily continued by the target for
    ``new_tokens`` tokens. ``windows`` 0 switches it off."""

    windows: int = 32
    prompt_tokens: int = 32
    new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.windows < 0:
            raise ValueError(f"windows (self-generated calibration prompts) must be >= 0, got {self.windows}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be a positive integer, got {self.prompt_tokens}")
        if self.new_tokens < 1:
            raise ValueError(f"new_tokens must be a positive integer, got {self.new_tokens}")


NO_GENERATION = GenerationSpec(windows=0)


def prompt_windows(token_ids: list[int], windows: int, length: int) -> list[list[int]]:
    """``windows`` slices of ``length`` consecutive ids (fewer if ``token_ids`` is shorter),
    starting at evenly spaced offsets from the first id to the last full window."""
    length = min(length, len(token_ids))
    last = len(token_ids) - length
    if windows < 1 or length < 1:
        return []
    starts = sorted({round(i * last / max(1, windows - 1)) for i in range(windows)}) if windows > 1 else [0]
    return [list(token_ids[s : s + length]) for s in starts]


class _Reservoir:
    """At most ``cap`` rows of (x, h), a uniform sample of all rows offered (Algorithm R)."""

    def __init__(self, cap: int, hidden: int, intermediate: int, generator: torch.Generator):
        self.x = torch.empty(cap, hidden)
        self.h = torch.empty(cap, intermediate)
        self.w = torch.empty(cap)
        self.cap = cap
        self.seen = 0
        self.gen = generator

    def add(self, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        fill = max(0, min(x.shape[0], self.cap - self.seen))
        self.x[self.seen : self.seen + fill] = x[:fill]
        self.h[self.seen : self.seen + fill] = h[:fill]
        self.w[self.seen : self.seen + fill] = w[:fill]
        rest = x.shape[0] - fill
        if rest:
            # Row number t (0-based) replaces a random slot with probability cap / (t + 1).
            t = torch.arange(self.seen + fill, self.seen + x.shape[0], dtype=torch.float64)
            slots = (torch.rand(rest, generator=self.gen, dtype=torch.float64) * (t + 1)).long()
            for row in (slots < self.cap).nonzero().flatten().tolist():
                self.x[slots[row]] = x[fill + row]
                self.h[slots[row]] = h[fill + row]
                self.w[slots[row]] = w[fill + row]
        self.seen += x.shape[0]

    def result(self) -> ExpertInputs:
        n = min(self.seen, self.cap)
        return ExpertInputs(self.x[:n].clone(), self.h[:n].clone(), self.seen, self.w[:n].clone())


class CalibrationRecorder:
    """The experts runner used while calibrating: eager expert maths on the store's blobs, plus
    recording. Attached to every experts module as ``_specter_runner``."""

    def __init__(self, store: ExpertStore, cap: int = 512, seed: int = 0):
        if cap < 1:
            raise ValueError(f"cap (calibration tokens kept per expert) must be positive, got {cap}")
        self.store = store
        self.cap = cap
        self.gen = torch.Generator().manual_seed(seed)
        self.recording = True
        self.generated: list[list[int]] = []  # self-generated sequences (prompt + continuation)
        self._res: dict[tuple[int, int], _Reservoir] = {}

    def forward(
        self,
        module: Any,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Same result as transformers' eager experts loop; records each expert's inputs."""
        final = torch.zeros_like(hidden)
        for expert in sorted(set(top_k_index.flatten().tolist())):
            top_k_pos, token_idx = torch.where((top_k_index == expert).T)
            gate_up, down = self.store.shape.split(self.store.blob(layer, expert))
            x = hidden[token_idx]
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            h = module.act_fn(gate) * up
            weight = top_k_weights[token_idx, top_k_pos]
            out = F.linear(h, down) * weight[:, None]
            final.index_add_(0, token_idx, out.to(hidden.dtype))
            if self.recording:
                self._reservoir(layer, expert).add(x.float(), h.float(), weight.float())
        return final

    def _reservoir(self, layer: int, expert: int) -> _Reservoir:
        key = (layer, expert)
        if key not in self._res:
            shape = self.store.shape
            self._res[key] = _Reservoir(self.cap, shape.hidden, shape.intermediate, self.gen)
        return self._res[key]

    def inputs(self, layer: int) -> list[ExpertInputs | None]:
        """Per expert of ``layer``: its recorded inputs, or None if no token was routed to it."""
        out: list[ExpertInputs | None] = []
        for expert in range(self.store.num_experts):
            res = self._res.get((layer, expert))
            out.append(res.result() if res is not None and res.seen else None)
        return out


@torch.inference_mode()
def record_expert_inputs(
    loaded: LoadedModel,
    store: ExpertStore,
    token_ids: list[int],
    cap: int = 512,
    seq_len: int = 512,
    seed: int = 0,
    progress: bool = False,
    generation: GenerationSpec = NO_GENERATION,
) -> CalibrationRecorder:
    """Run the target over ``token_ids`` in chunks of ``seq_len``, then over its own greedy
    continuations of windows of ``token_ids`` (``generation``), and record expert inputs.

    Args:
        loaded: the dense-loaded target (``specter.models.loader.build_dense``).
        store: every routed expert of the target (``load_store``).
        token_ids: calibration tokens.
        cap: at most this many tokens kept per expert.
        seq_len: tokens per forward pass (capped by the model's context length).
        seed: reservoir sampling seed.
        progress: log each chunk.
        generation: self-generated calibration (default: none); the sequences are kept in
            ``recorder.generated``.
    """
    if not token_ids:
        raise ValueError("token_ids (calibration tokens) is empty")
    vocab = int(loaded.config.vocab_size)
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise ValueError(
            f"token_ids must lie in [0, {vocab}); got ids in [{min(token_ids)}, {max(token_ids)}]"
        )
    seq_len = min(seq_len, int(getattr(loaded.config, "max_position_embeddings", seq_len) or seq_len))
    recorder = CalibrationRecorder(store, cap, seed)
    for module in loaded.experts_modules.values():
        module.__dict__["_specter_runner"] = recorder
    try:
        ids = torch.tensor(token_ids, dtype=torch.long)
        chunks = ids.split(seq_len)
        for n, chunk in enumerate(chunks):
            loaded.model(input_ids=chunk[None], use_cache=False)
            if progress:
                log.info("calibration: chunk %d/%d (%d tokens)", n + 1, len(chunks), chunk.numel())
        _record_generated(loaded, recorder, token_ids, generation, seq_len, progress)
    finally:
        for module in loaded.experts_modules.values():
            module.__dict__.pop("_specter_runner", None)
    return recorder


def _record_generated(
    loaded: LoadedModel,
    recorder: CalibrationRecorder,
    token_ids: list[int],
    generation: GenerationSpec,
    seq_len: int,
    progress: bool,
) -> None:
    """Continue windows of the calibration ids with the target (not recorded: the decode steps
    see one token at a time), then record each window plus continuation as one sequence."""
    new_tokens = max(0, min(generation.new_tokens, seq_len - min(generation.prompt_tokens, len(token_ids))))
    windows = prompt_windows(token_ids, generation.windows, generation.prompt_tokens) if new_tokens else []
    for n, prompt in enumerate(windows):
        recorder.recording = False
        try:
            sequence = prompt + greedy_continuation(loaded.model, prompt, new_tokens)
        finally:
            recorder.recording = True
        loaded.model(input_ids=torch.tensor([sequence]), use_cache=False)
        recorder.generated.append(sequence)
        if progress and ((n + 1) % 8 == 0 or n + 1 == len(windows)):
            log.info("calibration: self-generated %d/%d (%d tokens each)", n + 1, len(windows), len(sequence))


def calibration_ids(
    model_dir: str | Path, calib_text: str | Path | None, calib_tokens: int
) -> list[int] | None:
    """Token ids of the calibration text (at most ``calib_tokens``), with the model's tokenizer.

    ``calib_text`` None means the packaged ``specter/assets/prompts/calibration.txt`` when it
    exists; returns None when there is no text to use. Raises ValueError for a missing file or a
    model folder without a tokenizer.
    """
    if calib_tokens < 1:
        raise ValueError(f"calib_tokens must be a positive integer, got {calib_tokens}")
    path = Path(calib_text) if calib_text is not None else DEFAULT_CALIBRATION
    if not path.is_file():
        if calib_text is not None:
            raise ValueError(f"calib_text: calibration file {str(path)!r} does not exist")
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises OSError, ValueError, … for a missing tokenizer
        raise ValueError(
            f"calib_text: {model_dir} has no usable tokenizer to encode {path.name} ({exc})"
        ) from exc
    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"][:calib_tokens]
    if not ids:
        raise ValueError(f"calib_text: {path} encodes to no tokens")
    if len(ids) < calib_tokens:
        log.warning("calibration text %s gives only %d tokens (%d asked)", path, len(ids), calib_tokens)
    return list(ids)
