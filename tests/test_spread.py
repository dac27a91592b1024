"""Where batch replicas go: one trio per GPU on a GPU cluster, round-robin over CPU nodes otherwise."""

from __future__ import annotations

import ray

from actors import batch


def _nodes(*ips: str, gpu: bool = False) -> list[dict]:
    return [{"Alive": True, "NodeManagerAddress": ip, "Resources": {"CPU": 8.0, **({"GPU": 1.0} if gpu else {})}}
            for ip in ips]


def test_cpu_nodes_take_replicas_round_robin(monkeypatch) -> None:
    dead = {"Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 8.0}}
    head = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 0.0}}  # no actors there
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("10.0.0.3", "10.0.0.2") + [dead, head])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    got = batch.spread(3)
    assert [p.get("node_ip") for p in got] == ["10.0.0.2", "10.0.0.3", "10.0.0.2"]
    assert not any(p["gpu"] for p in got)


def test_one_node_is_left_to_ray(monkeypatch) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("127.0.0.1"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert batch.spread(2) == [{"gpu": False}, {"gpu": False}]


def test_gpu_cluster_gives_each_trio_a_gpu_and_lets_ray_spread_them(monkeypatch) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: _nodes("10.0.0.2", "10.0.0.3", gpu=True))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    assert batch.spread(2) == [{"gpu": True}, {"gpu": True}]
