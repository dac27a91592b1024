"""Where batch replicas go: Ray spreads them on a cuda link (a trio claims a whole GPU), round-robin over
CPU nodes otherwise."""

from __future__ import annotations

import ray

from actors import batch
from specter.config import LinkConfig

SIM = LinkConfig()
CUDA = LinkConfig(kind="cuda")


def _nodes(*ips: str, gpu: bool = False) -> list[dict]:
    return [{"Alive": True, "NodeManagerAddress": ip, "Resources": {"CPU": 8.0, **({"GPU": 1.0} if gpu else {})}}
            for ip in ips]


def test_cpu_nodes_take_replicas_round_robin(monkeypatch) -> None:
    dead = {"Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 8.0}}
    head = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 0.0}}  # no actors there
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("10.0.0.3", "10.0.0.2") + [dead, head])
    got = batch.spread(3, SIM)
    assert [p.get("node_ip") for p in got] == ["10.0.0.2", "10.0.0.3", "10.0.0.2"]


def test_one_node_is_left_to_ray(monkeypatch) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("127.0.0.1"))
    assert batch.spread(2, SIM) == [{}, {}]


def test_a_cuda_link_lets_ray_spread_the_trios_over_the_gpus(monkeypatch) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("10.0.0.2", "10.0.0.3", gpu=True))
    assert batch.spread(2, CUDA) == [{}, {}]


def test_a_sim_link_on_gpu_nodes_goes_round_robin_and_claims_no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("10.0.0.2", "10.0.0.3", gpu=True))
    assert batch.spread(2, SIM) == [{"node_ip": "10.0.0.2"}, {"node_ip": "10.0.0.3"}]
