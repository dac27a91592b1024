"""POSIX shared-memory segments as the actors use them: created 0600 and untracked by
multiprocessing (their creator unlinks them), attached by name, unlinked by prefix after a crash,
and the memory fence the seqlock readers and writers pair."""

from __future__ import annotations

import _posixshmem
import logging
import os
import re
import secrets
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = re.compile(r"[A-Za-z0-9_.-]{4,200}")
_FENCE = threading.Lock()


class SharedSlotsError(RuntimeError):
    """Shared slots could not be created, attached or written."""


def new_prefix(tag: str = "specter") -> str:
    """A fresh, unguessable name prefix: ``{tag}-{pid}-{random}``."""
    return f"{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def unlink_prefix(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every shared-memory segment whose name starts with ``prefix`` (e.g. after the
    creating process was killed); returns the names removed. Linux (``/dev/shm``) only."""
    check_prefix(prefix)
    names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)] if os.path.isdir(shm_dir) else []
    removed = [n for n in names if shm_unlink(n)]
    if removed:
        log.info("removed shared memory %s", ", ".join(removed))
    return removed


def fence() -> None:
    """A full memory barrier: a lock's acquire/release is an atomic read-modify-write that neither
    the CPU nor the C compiler moves loads or stores across (docs/wire.md, "Fences")."""
    _FENCE.acquire()
    _FENCE.release()


def check_prefix(prefix: str) -> None:
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"shared memory prefix {prefix!r}: use 4-200 letters, digits, '_', '.', '-'")


def segment_name(shm: SharedMemory) -> str:
    return shm.name.lstrip("/")


def _untrack(shm: SharedMemory) -> None:
    """Before 3.13 even an attached segment is tracked, and unlinked when *this* process exits."""
    if sys.version_info < (3, 13):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def open_shared(name: str, size: int) -> SharedMemory:
    """Create a 0600 shared-memory segment of ``size`` bytes, untracked by multiprocessing (the owner unlinks it)."""
    try:
        shm = SharedMemory(name, create=True, size=max(size, 1))
    except FileExistsError:
        raise SharedSlotsError(
            f"shared memory {name!r} exists already: use a fresh prefix (new_prefix())"
        ) from None
    _untrack(shm)
    return shm


def attach_shared(name: str) -> SharedMemory:
    try:
        shm = SharedMemory(name)
    except FileNotFoundError:
        raise SharedSlotsError(f"shared memory {name!r} does not exist (creator gone or unlinked?)") from None
    _untrack(shm)
    return shm


def close_shared(shm: SharedMemory | None) -> None:
    if shm is None:
        return
    try:
        shm.close()
    except BufferError:  # a view of the storage is still alive somewhere; unmapped at exit
        log.warning("shared memory %s is still referenced; it stays mapped until those views die", shm.name)


def shm_unlink(name: str) -> bool:
    """Unlink one segment; False when there is none (or it is another user's)."""
    if not name:
        return False
    try:
        _posixshmem.shm_unlink("/" + name.lstrip("/"))
    except FileNotFoundError:
        return False
    except PermissionError:
        log.warning("shared memory %s belongs to someone else; left alone", name)
        return False
    return True


def unlink_all(names: list[str]) -> None:
    for name in names:
        shm_unlink(name)
