"""Fault drill: kill each actor of a replica, both ways, mid-batch; check every result once and identical.

For each (role, how) in {transfer, draft, verifier} x {ray.kill, SIGKILL} it runs a batch of the
shipped held-out prompts through one replica, kills replica r0's ``role`` actor once its verifier
is inside the second request with tokens committed (``tests.actors.faults.KillInRequest``: tied to the
replica's state, not to a clock), and compares the results file with a fault-free run of the same
prompts: same ids, each exactly once, same tokens, and the kill seen inside the request. The second
prompt asks for ``--long-tokens`` so that a kill fired inside it lands inside it. One line per drill.

    python scripts/fault_drill.py [--prompts 5] [--new-tokens 24] [--long-tokens 96] [--model DIR --draft DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.batch import BatchOptions, run_batch  # noqa: E402
from actors.cluster import start_local  # noqa: E402
from specter.assets import ASSETS  # noqa: E402
from specter.config import LinkConfig, SlotConfig  # noqa: E402
from specter.eval.jobs import BatchItem, ResultsFile, errors_path  # noqa: E402
from specter.eval.prompts import HELDOUT, read_jsonl  # noqa: E402
from specter.target import load_tokenizer  # noqa: E402
from tests.actors.faults import KillInRequest  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ASSETS / "moe-fine"))
    parser.add_argument("--draft", default=str(ASSETS / "moe-fine-awq"))
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--long-tokens", type=int, default=96, help="new tokens of the second prompt (killed)")
    parser.add_argument("--timeout", type=float, default=10.0, help="actors' peer timeout")
    args = parser.parse_args()
    rows = read_jsonl(HELDOUT)[: args.prompts]
    items = [BatchItem(str(i), row["prompt"], i + 1, args.new_tokens, 0.0, 0) for i, row in enumerate(rows)]
    items[1].max_new_tokens = args.long_tokens
    tokenizer = load_tokenizer(Path(args.model))
    assert tokenizer is not None
    options = BatchOptions(args.model, args.draft, SlotConfig(fraction=0.5), LinkConfig.parse("sim:4"),
                           policy="specter+fixed", window=4, timeout_s=args.timeout)  # every round drafts: a
    # killed draft is always noticed (adaptive K may settle on 0, plain decoding, and never ask it again)
    start_local(2, log_to_driver=False)
    scratch = tempfile.TemporaryDirectory(prefix="specter-drill-")  # results files; removed at the end
    work = Path(scratch.name)

    def batch(name: str, fault: KillInRequest | None = None):
        out = work / f"{name}.jsonl"
        results = ResultsFile(out)
        t0 = time.monotonic()
        if fault is not None:
            fault.start()
        report = run_batch(items, results, out, options, lambda t: list(tokenizer.encode(t)),
                           lambda ids: str(tokenizer.decode(ids)))
        results.close()
        if fault is not None:
            fault.join()
        return report, [json.loads(line) for line in out.read_text().splitlines()], time.monotonic() - t0, out

    _, clean, wall, _ = batch("clean")
    want = {row["id"]: row["tokens"] for row in clean}
    print(f"fault-free: {len(clean)} prompts, {sum(map(len, want.values()))} tokens, {wall:.1f}s")
    failures = 0
    for role in ("transfer", "draft", "verifier"):
        for how in ("ray.kill", "SIGKILL"):
            fault = KillInRequest(role, how, nth=2)
            report, rows, wall, out = batch(f"{role}-{how}", fault)
            ids = [row["id"] for row in rows]
            once = sorted(ids) == sorted(want) and len(ids) == len(set(ids))
            same = all(row["tokens"] == want[row["id"]] for row in rows)
            seen = fault.fired or {}
            inside = seen.get("requests") == 2 and 1 <= seen.get("committed", 0) < args.long_tokens
            ok = once and same and inside and report.failed == 0 and report.retried >= 1 \
                and not errors_path(out).exists()
            failures += not ok
            where = f"killed at {seen.get('committed')}/{args.long_tokens} tokens of request 2" if inside \
                else f"not inside a request: {fault.fired or fault.error}"
            print(f"{'PASS' if ok else 'FAIL'}  kill {role:8s} by {how:8s}: {where}, {len(rows)}/{len(want)} "
                  f"results, each once: {once}, identical: {same}, restarts {report.restarts}, retried "
                  f"{report.retried}, failed {report.failed}, {wall:.1f}s")
    ray.shutdown()
    scratch.cleanup()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
