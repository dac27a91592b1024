"""Fixtures for the draft tests: small default-initialised checkpoints and their drafts, built once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import CONFIGS
from transformers import AutoModelForCausalLM, MixtralConfig

from specter.draft.quantize.model import quantize_model

# Hidden 64 and expert intermediate 32: every projection fits torch's CPU int4 kernel
# (output dim a multiple of 16, group 32 or 64).
KERNEL_CONFIG = MixtralConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def save_plain(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny checkpoint with transformers' own initialisation (small weights, stable routing)."""
    torch.manual_seed(seed)
    config = KERNEL_CONFIG if family == "kernel" else CONFIGS[family]
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def calib_ids() -> list[int]:
    return torch.randint(0, 128, (384,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="session")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``plain_dir(family)`` → a saved default-init tiny checkpoint (``kernel`` for KERNEL_CONFIG)."""
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            cache[family] = save_plain(family, tmp_path_factory.mktemp(f"plain_{family}"))
        return cache[family]

    return make


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, plain_dir, calib_ids) -> Callable[[str, str], Path]:
    """``draft_dir(family, method)`` → the quantized draft folder of ``plain_dir(family)``."""
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, method: str) -> Path:
        if (family, method) not in cache:
            out = tmp_path_factory.mktemp(f"draft_{family}_{method}")
            quantize_model(
                plain_dir(family), out, method=method, calib_ids=calib_ids, cap=128, grid=10, progress=False
            )
            cache[(family, method)] = out
        return cache[(family, method)]

    return make
