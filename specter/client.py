"""``from specter.client import Client``: the Ray client, imported lazily (``specter`` itself never
imports Ray). The class lives in ``actors/client.py``."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Client":
        from actors.client import Client

        return Client
    raise AttributeError(f"module 'specter.client' has no attribute {name!r}")
