"""Fault drill: kill each actor of a replica, both ways, mid-batch; check every result once and identical.

For each (role, how) in {transfer, draft, verifier} x {ray.kill, SIGKILL} it runs a batch of the
shipped held-out prompts through one replica, kills replica r0's ``role`` actor a moment after
the first result (while the next prompt runs), and compares the results file with a fault-free
run of the same prompts: same ids, each exactly once, same tokens. Prints one line per drill.

    python scripts/fault_drill.py [--prompts 5] [--new-tokens 24] [--model DIR --draft DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.batch import BatchOptions, run_batch  # noqa: E402
from actors.faults import kill_after_first  # noqa: E402
from specter.assets import ASSETS  # noqa: E402
from specter.config import LinkConfig, SlotConfig  # noqa: E402
from specter.jobs import BatchItem, ResultsFile, errors_path  # noqa: E402
from specter.prompts import HELDOUT, read_jsonl  # noqa: E402
from specter.target import _load_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ASSETS / "moe-fine"))
    parser.add_argument("--draft", default=str(ASSETS / "moe-fine-awq"))
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds after the first result to kill")
    parser.add_argument("--timeout", type=float, default=10.0, help="actors' peer timeout")
    args = parser.parse_args()
    rows = read_jsonl(HELDOUT)[: args.prompts]
    items = [BatchItem(str(i), row["prompt"], i + 1, args.new_tokens, 0.0, 0) for i, row in enumerate(rows)]
    tokenizer = _load_tokenizer(Path(args.model))
    assert tokenizer is not None
    options = BatchOptions(args.model, args.draft, SlotConfig(fraction=0.5), LinkConfig.parse("sim:4"),
                           policy="specter", window=4, timeout_s=args.timeout)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="specter-drill-"))

    def batch(name: str, hook=None):
        out = work / f"{name}.jsonl"
        results = ResultsFile(out)
        t0 = time.monotonic()
        report = run_batch(items, results, out, options, lambda t: list(tokenizer.encode(t)),
                           lambda ids: str(tokenizer.decode(ids)), on_result=hook)
        results.close()
        return report, [json.loads(line) for line in out.read_text().splitlines()], time.monotonic() - t0, out

    _, clean, wall, _ = batch("clean")
    want = {row["id"]: row["tokens"] for row in clean}
    print(f"fault-free: {len(clean)} prompts, {sum(map(len, want.values()))} tokens, {wall:.1f}s")
    failures = 0
    for role in ("transfer", "draft", "verifier"):
        for how in ("ray.kill", "SIGKILL"):
            report, rows, wall, out = batch(f"{role}-{how}", kill_after_first(role, how, args.delay))
            ids = [row["id"] for row in rows]
            once = sorted(ids) == sorted(want) and len(ids) == len(set(ids))
            same = all(row["tokens"] == want[row["id"]] for row in rows)
            ok = once and same and report.failed == 0 and not errors_path(out).exists()
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'}  kill {role:8s} by {how:8s}: {len(rows)}/{len(want)} results, "
                  f"each once: {once}, identical: {same}, restarts {report.restarts}, retried {report.retried}, "
                  f"failed {report.failed}, {wall:.1f}s")
    ray.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
