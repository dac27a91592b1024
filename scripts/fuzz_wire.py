"""Fuzz a running replica's sockets: ``python scripts/fuzz_wire.py [--frames 100000] [--json]``.

Launches one replica (transfer, verifier, draft actors) on a local Ray with the shipped MoE and its
AWQ draft, generates once fault-free, then sends ``--frames`` bad frames to each socket (the
transfer actor's pull socket, the draft actor's end of the pair socket, and the verifier's end of
it, sent from the draft's side while the draft's serving thread is paused) in ``--rounds`` bursts between
requests, generating after each burst. Prints what was sent by category, what each actor counted
(frames read, dropped per reason, refused per reason, accepted), whether the output stayed
token-identical, and the wall time. Exit status 1 if the output changed, a frame went uncounted or
an actor stopped serving. The frames and the rules are in ``specter/remote/fuzz.py``, the drive through
the actors in ``specter/remote/fuzz_replica.py`` (docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "specter" / "assets"


def _prompt(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model)).encode(text))


def _print(report: dict, wall_s: float) -> None:
    print(f"tokens identical to the fault-free run: {report['tokens_identical']} ({len(report['reference'])} tokens)")
    for role in ("transfer", "draft", "verifier"):
        got = report[role]
        print(f"\n{role}: sent {sum(got['sent'].values())} frames, the actor read {got['frames']} "
              f"(uncounted {got['uncounted']}), still serving: {got['serving']}")
        print("  sent by category: " + ", ".join(f"{k} {v}" for k, v in sorted(got["sent"].items())))
        print("  dropped by the channel: " + ", ".join(f"{k} {v}" for k, v in got["dropped"].items()))
        print("  refused by the server:  " + ", ".join(f"{k} {v}" for k, v in got["refused"].items()))
        print(f"  accepted (well-formed, harmless): {got['accepted']}; error answers not sent: {got['unsent_errors']}")
    print(f"\nwall time: {wall_s:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ASSETS / "moe-fine")
    parser.add_argument("--draft", type=Path, default=ASSETS / "moe-fine-awq")
    parser.add_argument("--frames", type=int, default=100_000, help="frames per socket")
    parser.add_argument("--rounds", type=int, default=4, help="bursts, each followed by a request")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    args = parser.parse_args()

    import ray

    from actors.cluster import start_local
    from actors.launcher import launch
    from specter.config import LinkConfig, SlotConfig
    from specter.remote.fuzz_replica import fuzz_engine

    start_local(2, log_to_driver=False)
    try:
        handle = launch(args.model, args.draft, SlotConfig(fraction=0.5), LinkConfig.parse("sim:4"), policy="specter",
                        sealed=False)  # the fuzzer connects peers of its own to the sockets
        try:
            t0 = time.perf_counter()
            report = fuzz_engine(handle, _prompt(args.model, args.prompt), args.new_tokens, args.frames,
                                 seed=args.seed, rounds=args.rounds, timeout_s=300)
            wall_s = time.perf_counter() - t0
        finally:
            handle.shutdown()
    finally:
        ray.shutdown()
    _print(report, wall_s)
    if args.json:
        print(json.dumps({**report, "wall_s": wall_s}))
    ok = report["tokens_identical"] and all(
        report[r]["uncounted"] == 0 and report[r]["serving"] for r in ("transfer", "draft", "verifier")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
