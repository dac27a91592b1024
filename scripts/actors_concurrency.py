"""Throughput of concurrent streams through the actors (what ``specter serve`` runs), wall clock:
``python scripts/actors_concurrency.py [MODEL [DRAFT]] --counts 1,4 --policies demand-lru,specter+fixed``.

One replica on a local Ray; for each policy (switched by one ``generate`` call, which rebuilds the
verifier's target from the initial residency) and each count N, N clients in a closed loop each stream
``--per-client`` prompts through ``VerifierActor.stream`` — continuously batched, a drafting policy's
rounds drafted in the draft actor for every request together. Policies and counts are interleaved over
``--repeats``; prints one JSON object: per policy and count, the median tokens per second, the median
per-request TPOT, the mean batch size, and the throughput over the same policy's N = 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.cluster import start_local  # noqa: E402
from actors.launcher import launch  # noqa: E402
from specter.assets import DEFAULT_MODEL  # noqa: E402
from specter.config import LinkConfig, SlotConfig  # noqa: E402
from specter.plan import drafts  # noqa: E402
from specter.target import load_tokenizer  # noqa: E402

TEXTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def", "for i in range(10):",
         "The capital of France", "SELECT name FROM", "while True:\n    ", "# a function that sorts"]


def _stream(verifier: Any, request_id: str, prompt: list[int], new: int) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for ref in verifier.stream.remote(request_id, prompt, new):
        stats = ray.get(ref).get("stats", stats)
    return stats


def _run(verifier: Any, prompts: list[list[int]], count: int, per_client: int, new: int, tag: str) -> dict[str, float]:
    """``count`` clients in a closed loop, ``per_client`` prompts each; throughput and medians."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(per_client):
            stats = _stream(verifier, f"{tag}-{c}-{r}", prompts[(c * per_client + r) % len(prompts)], new)
            with lock:
                results.append(stats)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(count)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t0
    tokens = sum(s["new_tokens"] for s in results)
    return {"tokens_per_s": tokens / elapsed, "tpot_s": statistics.median(s["tpot_s"] for s in results),
            "mean_batch": statistics.fmean(s["mean_batch"] for s in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("draft", nargs="?", default=f"{DEFAULT_MODEL}-awq")
    parser.add_argument("--policies", default="demand-lru,specter+fixed,specter")
    parser.add_argument("--counts", default="1,4")
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--link", default="sim:1,10", help="sim:GBPS[,LATENCY_US]")
    args = parser.parse_args()
    policies = args.policies.split(",")
    counts = [int(n) for n in args.counts.split(",")]
    gbps, _, latency = args.link.removeprefix("sim:").partition(",")
    link = LinkConfig(kind="sim", bandwidth=float(gbps) * 1e9, latency=float(latency or 10) * 1e-6)
    tokenizer = load_tokenizer(Path(args.model))
    prompts = [list(tokenizer(text)["input_ids"]) for text in TEXTS]
    start_local(3, log_to_driver=False)
    handle = launch(args.model, args.draft if any(drafts(p) for p in policies) else None,
                    SlotConfig(fraction=args.budget), link, policy=policies[0], draft_mode="dequant-cache")
    runs: dict[str, dict[int, list[dict[str, float]]]] = {p: {n: [] for n in counts} for p in policies}
    try:
        for repeat in range(args.repeats):
            for policy in policies:
                handle.generate(prompts[0], 4, policy=policy)  # the verifier runs it from here on (rebuilt)
                for count in counts:
                    runs[policy][count].append(
                        _run(handle.verifier, prompts, count, args.per_client, args.new_tokens, f"{policy}-{repeat}-{count}"))
                    print(f"repeat {repeat + 1}/{args.repeats} {policy} N={count}: "
                          f"{runs[policy][count][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    finally:
        handle.shutdown()
        ray.shutdown()
    out: dict[str, Any] = {"model": args.model, "link": args.link, "budget": args.budget, "new_tokens": args.new_tokens,
                           "per_client": args.per_client, "repeats": args.repeats, "clock": "wall", "policies": {}}
    for policy in policies:
        rows = {n: {key: statistics.median(r[key] for r in runs[policy][n]) for key in runs[policy][n][0]}
                for n in counts}
        for n in counts:
            rows[n]["x_one"] = rows[n]["tokens_per_s"] / rows[counts[0]]["tokens_per_s"]
        out["policies"][policy] = rows
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
