"""Specter's metrics reach Ray's Prometheus endpoint during a batch, each with sane values.

The scrape happens from inside the batch (its last ``on_result``), while the replica's actors are
alive, polling until every metric of ``actors.metrics.METRICS`` has been exported.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import ray

from actors.batch import BatchOptions, run_batch
from actors.cluster import start_local
from actors.metrics import METRICS
from specter.config import LinkConfig, SlotConfig
from specter.eval.jobs import BatchItem, ResultsFile

NEW = 8
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The endpoint's samples by metric name: [(labels, value)]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        match = LINE.match(line)
        if match and match.group(1).startswith("ray_specter_"):
            samples[match.group(1)].append((dict(LABEL.findall(match.group(2) or "")), float(match.group(3))))
    return samples


def _wanted(m) -> str:
    return m.prometheus + ("_count" if m.kind == "histogram" else "")


@pytest.fixture(scope="module")
def metrics_ray():
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    start_local(2, log_to_driver=False, _metrics_export_port=port)
    yield port
    ray.shutdown()


def test_every_metric_is_scraped_with_sane_values(metrics_ray, tiny_dir, tmp_path) -> None:
    port = metrics_ray
    folder = tiny_dir("mixtral")
    draft = folder  # the target as its own draft: every round drafted ahead stands, so its counters move
    items = [BatchItem(f"p{i}", "abcdefgh"[: 3 + i], i + 1, NEW, 0.0, 0) for i in range(3)]
    items[1].max_new_tokens = 10_000  # refused by the verifier: one request error
    options = BatchOptions(str(folder), str(draft), SlotConfig(fraction=0.25),
                           LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6), policy="specter+fixed", window=3)
    scraped: dict = {}

    def on_result(result: dict) -> None:
        if result["id"] != "p2":
            return
        # the transfer and draft actors publish once a second, the exporter scrapes on its own
        # schedule: poll until every metric is there (only a hang reaches the bound)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            samples = scrape(port)
            if all(_wanted(m) in samples for m in METRICS) and samples["ray_specter_requests_total"][0][1] >= 2:
                break
            time.sleep(0.5)
        scraped.update(samples)

    out = tmp_path / "results.jsonl"
    results = ResultsFile(out)
    run_batch(items, results, out, options, lambda t: [1 + ord(c) % 100 for c in t], str, on_result=on_result)
    results.close()

    missing = [_wanted(m) for m in METRICS if _wanted(m) not in scraped]
    assert not missing, f"not exported: {missing}"

    def total(name: str, **tags: str) -> float:
        return sum(v for labels, v in scraped[name] if all(labels.get(k) == t for k, t in tags.items()))

    assert total("ray_specter_requests_total", replica="r0", actor="verifier") == 2
    assert total("ray_specter_request_errors_total", actor="verifier") == 1
    assert total("ray_specter_request_errors_total", actor="driver") == 1
    assert total("ray_specter_tokens_generated_total", replica="r0") == 2 * NEW
    assert total("ray_specter_tpot_seconds_count") == 2
    assert 0 < total("ray_specter_tpot_seconds_sum") < 10
    assert total("ray_specter_accepted_length_count") == 2
    assert 0 <= total("ray_specter_accepted_length_sum") <= 2 * 3
    hits = total("ray_specter_expert_hits_total") + total("ray_specter_expert_inflight_total")
    assert hits + total("ray_specter_expert_misses_total") > 0
    assert total("ray_specter_bytes_moved_total", replica="r0", actor="transfer") > 0
    assert total("ray_specter_draft_rounds_total", replica="r0", actor="draft") > 0
    ahead = total("ray_specter_rounds_ahead_total", actor="verifier")
    assert ahead >= total("ray_specter_rounds_ahead_kept_total", actor="verifier") == 2  # one per request (K 3, 8 tokens)
    for gauge in ("ray_specter_hit_rate", "ray_specter_prediction_recall", "ray_specter_link_busy_fraction"):
        assert all(0.0 <= v <= 1.0 for _, v in scraped[gauge]), gauge
    assert total("ray_specter_prediction_recall", actor="verifier") > 0
    assert all(v >= 0 for _, v in scraped["ray_specter_queue_depth"])
    assert {labels["actor"] for labels, _ in scraped["ray_specter_queue_depth"]} >= {"driver", "verifier"}
    assert Path(out).read_text().count("\n") == 2
