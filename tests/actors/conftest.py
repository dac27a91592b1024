"""Fixtures of the actor tests: a local Ray per module, the tiny target and its noisy draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from tiny_models import noisy_copy

from actors.cluster import start_local


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        start_local(2, log_to_driver=False)  # loopback, token authentication, as every Ray we start
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Mixtral target and a draft that mostly agrees with it."""
    folder = tiny_dir("mixtral")
    return folder, noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d")
