"""Fixtures of the actor tests: a local Ray per module, the tiny target and its noisy draft."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from tiny_models import noisy_copy


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        # Ray 2.60 otherwise writes ~/.ray/auth_token, which switches every later local cluster and
        # the `ray` CLI to token authentication (NOTES.md).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Mixtral target and a draft that mostly agrees with it."""
    folder = tiny_dir("mixtral")
    return folder, noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d")
