"""Stand-in roles for the plain-process launcher's own tests: one answers what its process sees (or
after a while), one is slow to build."""

from __future__ import annotations

import os
import time


class EnvRole:
    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def wait(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def close(self) -> None:
        pass


class SlowRole:
    """A role that takes ``seconds`` to build (a model still loading)."""

    def __init__(self, seconds: float):
        time.sleep(seconds)

    def close(self) -> None:
        pass
