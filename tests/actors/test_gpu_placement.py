"""The card's trio on a GPU through Ray: a ``cuda`` link claims one whole GPU per replica, shared by its
three actors, so the transfer actor and the verifier see the same device (CUDA IPC needs it).

This machine has no GPU: the module's Ray declares two (``num_gpus=2``), which Ray hands out exactly
as it would real ones (``ray.get_gpu_ids``, ``CUDA_VISIBLE_DEVICES``). Past the placement the actors
find no CUDA in torch, which is the other half shown here: the launch ends with one line naming the
actor and the cause, and leaves no placement group and no shared memory behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray.util import placement_group_table
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.cluster import start_local
from actors.launcher import DEFAULT_SIM_LINK, cluster_link, launch, placement
from specter.config import LinkConfig, SlotConfig
from specter.remote.roles.base import RoleStartError

ROOT = Path(__file__).resolve().parents[2]
CUDA = LinkConfig(kind="cuda")
ROLES = ["transfer", "verifier", "draft"]


@pytest.fixture(scope="module")
def two_gpu_ray():
    if ray.is_initialized():  # an earlier module's Ray: this one needs GPUs declared
        ray.shutdown()
    start_local(2, num_gpus=2, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    """Stands where a role's actor stands and says which GPU Ray gave it."""

    def gpu(self) -> tuple[list[int], str | None]:
        return [int(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


def _trio(roles: list[str]) -> tuple[object, list[tuple[list[int], str | None]]]:
    bundles, options = placement(roles, CUDA)
    pg = placement_group(bundles, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    probes = [Probe.options(  # type: ignore[attr-defined]
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=options[r]["bundle"]),
        num_cpus=0.25, num_gpus=options[r]["gpus"]).remote() for r in roles]
    return pg, ray.get([p.gpu.remote() for p in probes], timeout=60)


def test_a_sim_link_claims_no_gpu_and_a_bundle_per_role() -> None:
    bundles, options = placement(ROLES, DEFAULT_SIM_LINK, 0.25, node_ip="10.0.0.2")
    assert bundles == [{"CPU": 0.25, "node:10.0.0.2": 0.001}] * 3
    assert [options[r] for r in ROLES] == [{"bundle": i, "gpus": 0} for i in range(3)]


def test_a_cuda_link_on_a_cluster_without_gpus_is_refused_before_any_actor(monkeypatch) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(ValueError, match="link: cuda .* this Ray cluster has none"):
        placement(ROLES, CUDA)
    assert cluster_link(None) == DEFAULT_SIM_LINK  # and no cuda by default there
    assert cluster_link(LinkConfig.parse("sim:4")) == LinkConfig.parse("sim:4")


def test_each_trio_shares_one_whole_gpu_and_trios_take_different_ones(two_gpu_ray) -> None:
    assert cluster_link(None) == CUDA  # the default on a cluster with GPUs
    groups = []
    try:
        for roles in (ROLES, ROLES[:2]):  # a replica with its draft, one without
            pg, seen = _trio(roles)
            groups.append(pg)
            assert len({tuple(ids) for ids, _ in seen}) == 1 and len(seen[0][0]) == 1, seen
            assert {visible for _, visible in seen} == {str(seen[0][0][0])}  # what torch would see as cuda:0
        assert [pg.bundle_specs for pg in groups] == [[{"CPU": 0.75, "GPU": 1.0}], [{"CPU": 0.5, "GPU": 1.0}]]
    finally:
        for pg in groups:
            remove_placement_group(pg)


def test_trios_on_distinct_gpus(two_gpu_ray) -> None:
    groups = []
    try:
        seen = []
        for _ in range(2):
            pg, got = _trio(ROLES)
            groups.append(pg)
            seen.append(got[0][0][0])
        assert sorted(seen) == [0, 1]
    finally:
        for pg in groups:
            remove_placement_group(pg)


def test_a_node_whose_torch_has_no_cuda_ends_the_launch_in_one_line_and_leaves_nothing(two_gpu_ray, tiny_dir) -> None:
    with pytest.raises(RoleStartError) as exc:
        launch(tiny_dir("mixtral"), None, SlotConfig(fraction=0.5), CUDA, policy="demand-lru", replica="nocuda",
               timeout_s=30, startup_timeout_s=120)
    message = str(exc.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("replica nocuda: the ") and "actor could not start" in message
    assert "cuda needs a CUDA device, and torch sees none" in message
    assert all(v["state"] == "REMOVED" for v in placement_group_table().values() if v["name"] == "specter-nocuda")
    # every segment of replica nocuda is named specter-nocuda-…: none is left (another Specter's may be there)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("specter-nocuda-")]


@pytest.mark.parametrize("command", ["generate", "serve", "batch"])
def test_the_cli_with_a_cuda_link_on_a_machine_without_cuda_says_so_in_one_line_before_ray_starts(
        tiny_dir, tmp_path, command) -> None:
    model = ["--model", str(tiny_dir("mixtral")), "--policy", "demand-lru", "--address", "local", "--link", "cuda"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    extra = {"generate": ["--prompt-ids", "1,2"], "serve": ["--port", "0"],
             "batch": [str(prompts), "--out", str(tmp_path / "out.jsonl")]}[command]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "specter.cli", command, *extra, *model],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specter: error:")]
    assert len(lines) == 1 and "link: cuda puts the actors on a GPU, and this machine has none" in lines[0], lines
    assert "Ray" not in proc.stderr.replace(lines[0], "")  # said before a Ray was started (Ray logs its start)


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own, as ``specter serve`` imports it
def test_the_cli_through_a_cluster_without_gpus_says_so_in_one_line(tiny_dir, monkeypatch, capsys, command) -> None:
    """Attached to a cluster (``--address auto``) whose resources name no GPU: the placement (generate) or
    ``specter serve`` before its Serve application refuses a ``cuda`` link in one line, and a serve leaves
    its Ray connection shut. The cluster is a stand-in: joining is a no-op, its resources have no GPU."""
    from specter.cli import main

    joined, shut = [], []
    monkeypatch.setattr("actors.cluster.init_ray", lambda *a, **k: joined.append(a))
    monkeypatch.setattr("actors.client.init_ray", lambda *a, **k: joined.append(a))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    model = ["--model", str(tiny_dir("mixtral")), "--policy", "demand-lru", "--address", "auto", "--link", "cuda"]
    extra = ["--prompt-ids", "1,2"] if command == "generate" else ["--port", "0"]
    assert main([command, *model, *extra]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specter: error: link: cuda puts the actors on a GPU, and this "
                                                   "Ray cluster has none"), lines
    assert joined and (shut if command == "serve" else True)
