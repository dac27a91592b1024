"""The verifier's side of offloaded experts when the host blobs live in the transfer actor.

``RemoteExperts`` is ``OffloadedExperts`` whose initial residency is filled by the transfer actor
(untimed copies through the ``RemoteLink``) instead of local copies. Its store is the transfer
actor's, mapped read-only (``specter/remote/shared_store.py``) and read only by host compute.
Everything else (policies, residency map, the MoE forward) is the in-process code, unchanged.
"""

from __future__ import annotations

from specter.experts.executor import OffloadedExperts
from specter.remote.link import RemoteLink


class RemoteExperts(OffloadedExperts):
    """``OffloadedExperts`` over a ``RemoteLink``."""

    def prefill_slots(self) -> None:
        """Same order as the in-process fill (expert 0 of every layer, then 1, …), done remotely."""
        link = self.link
        assert isinstance(link, RemoteLink)
        placements = self.claim_initial_slots()
        link.place(placements, self.timeout)
