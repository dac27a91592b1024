"""Wiring a launched replica: shared memory and sockets, the same for Ray actors and plain processes.

The transfer role makes the shared memory and binds its command socket; the draft binds its pair
socket and connects its plan socket to the transfer role; the verifier maps the memory, connects
both and handshakes; then the replica is sealed (``TransferRole.seal``: the shared memory and the
ipc directory lose their names, so a crash anywhere leaves nothing behind). ``call(role, method,
*args, timeout=…)`` is how the launcher reaches a role: ``ray.get`` on an actor method
(``actors/launcher.py``) or a pipe to a process (``specter/remote/processes.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from specter.remote.endpoints import endpoint

log = logging.getLogger(__name__)

Call = Callable[..., Any]  # call(role, method, *args, timeout=seconds) -> the method's result


def wire(call: Call, transfer: Any, verifier: Any, draft: Any | None, startup_s: float) -> tuple[str, int]:
    """Connect the roles of one replica; returns the transfer role's ipc directory and the slot count."""
    info = call(transfer, "info", timeout=startup_s)
    call(transfer, "start", startup_s, timeout=startup_s)
    draft_endpoint = None
    if draft is not None:
        wanted = endpoint("ipc", "draft", directory=info["ipc_dir"])
        draft_endpoint = call(draft, "bind", wanted, startup_s, timeout=startup_s)
        call(draft, "connect_plans", info["endpoint"], timeout=startup_s)
    slots = call(verifier, "connect", info["slots"], info["endpoint"], draft_endpoint, info["layout"],
                 timeout=startup_s)
    return str(info["ipc_dir"]), int(slots)


def seal(call: Call, transfer: Any, has_draft: bool, startup_s: float) -> None:
    """Unname the shared memory and the ipc directory once the peers are connected."""
    peers = ("verifier", "draft") if has_draft else ("verifier",)
    call(transfer, "seal", startup_s, peers, timeout=startup_s + 10)
