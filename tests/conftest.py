"""Shared fixtures: tiny checkpoints of every family, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import save_tiny  # noqa: E402

hf_logging.disable_progress_bar()
torch.set_num_threads(1)  # two cores: leave one to the link thread and the other test work
# `specter generate` keeps its K chooser between runs (specter/plan/window_store.py): never in the home of
# whoever runs the tests, and no test's run starts from another's; the tests of it name their own folder
os.environ["SPECTER_CHOOSER_CACHE"] = "none"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_dir(family)`` → a saved tiny checkpoint of that family (cached for the session)."""
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            cache[family] = save_tiny(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return make

