"""A running replica under a short fuzz (issue 8): both sockets get garbage, every frame is counted
by the actor that read it, nothing stops serving, and the output stays token-identical. Also: what
a running replica exposes (ipc sockets in a 0700 directory, 0600 shared memory).

The long run (100 000 frames per socket on the shipped model) is ``scripts/fuzz_wire.py``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from tiny_models import noisy_copy

from actors.launcher import EngineHandle, launch
from specter.config import LinkConfig, SlotConfig
from specter.remote.fuzz_replica import fuzz_engine

PROMPT = [5, 99, 17, 42, 8, 63, 21]
FRAMES = 3000  # per socket


@pytest.fixture(scope="module")
def engine(local_ray, tiny_dir, tmp_path_factory) -> Iterator[EngineHandle]:
    folder = tiny_dir("mixtral")
    draft = noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d")
    # unsealed: the fuzzer connects peers of its own to the sockets after wiring
    handle = launch(folder, draft, SlotConfig(fraction=0.5), LinkConfig.parse("sim:4"), policy="specter",
                    sealed=False)
    yield handle
    handle.shutdown()


def test_fuzzed_sockets_count_every_frame_and_output_is_unchanged(engine) -> None:
    report = fuzz_engine(engine, PROMPT, 8, FRAMES, seed=11, rounds=2)
    assert report["tokens_identical"] and len(report["reference"]) == 8
    for role in ("transfer", "draft"):
        got = report[role]
        assert sum(got["sent"].values()) == got["frames"] == FRAMES and got["uncounted"] == 0, got
        assert got["serving"], f"the {role} actor stopped serving"
        assert min(got["dropped"].values()) > 0, got["dropped"]  # malformed, unknown, wrong_version
        assert got["refused"]["out_of_range"] > 0 and got["refused"]["unexpected"] > 0, got["refused"]
        assert got["received"] == got["accepted"] + sum(got["refused"].values())
    verifier = report["verifier"]  # its end of the pair socket, fed from the draft's side
    assert sum(verifier["sent"].values()) == verifier["frames"] == FRAMES and verifier["uncounted"] == 0, verifier
    assert min(verifier["dropped"].values()) > 0, verifier["dropped"]
    assert report["transfer"]["refused"]["unknown_id"] > 0
    transfer = report["transfer"]
    # accepted: only harmless well-formed ones (LinkTiming(True) out of turn, rare lucky flips)
    assert transfer["refused"]["duplicate_id"] == 0
    assert transfer["accepted"] <= sum(transfer["sent"][c] for c in ("out_of_order", "wrong_types", "bit_flipped"))
    assert report["draft"]["refused"]["failed"] == 0
    assert ray.get(engine.transfer.counters.remote())["rejected"] >= sum(report["transfer"]["refused"].values())


def test_a_running_replica_listens_only_on_private_ipc_and_maps_private_memory(engine) -> None:
    info = ray.get(engine.transfer.info.remote())
    ipc_dir = Path(info["ipc_dir"])
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700 and ipc_dir.stat().st_uid == os.getuid()
    sockets = sorted(ipc_dir.iterdir())
    assert [p.name for p in sockets] == ["draft.sock", "transfer.sock"]
    assert info["endpoint"] == f"ipc://{ipc_dir / 'transfer.sock'}"
    assert all(stat.S_ISSOCK(p.stat().st_mode) for p in sockets)
    shm = [Path("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith(engine.prefix)]
    assert len(shm) >= 3  # slot data, seq table, counters
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in shm), [oct(p.stat().st_mode) for p in shm]
