"""A stand-in role for the plain-process launcher's own tests: it answers what its process sees."""

from __future__ import annotations

import os


class EnvRole:
    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def close(self) -> None:
        pass
