"""Fuzzing a running replica: every socket that reads is fed ``FrameFuzzer``'s frames, and the
replica must still generate the same tokens and count every frame.

:func:`fuzz_engine` drives a launched replica (``actors.launcher.launch``): it pushes frames into
the transfer actor's pull socket from a second connection of its own, and into the draft actor's
pair socket through the verifier's connection (a ``pair`` socket admits one peer; between requests
the fuzzer borrows it, so every frame crosses the real connection into the draft's real decode
path), and into the verifier's end of that pair from the draft's side (the draft's serving thread
paused meanwhile, the verifier reading through its real decoder), then checks that the replica
still generates the same tokens and reads what each actor counted. Ray is imported only there.
The frames, and what is never sent, are ``specter/remote/fuzz.py``'s; ``scripts/fuzz_wire.py`` is
the command line.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import zmq

from specter.remote.endpoints import check_endpoint
from specter.remote.fuzz import FrameFuzzer, Target

# -- inside the actors (Ray's __ray_call__ runs these with the actor instance) ------------------

def actor_counts(actor: Any) -> dict[str, Any]:
    """A transfer or draft actor's counts: frames its channel read, dropped and refused."""
    channel, server = actor.channel, actor.server
    refused = dict(server.rejections)
    return {
        "frames": channel.received + sum(channel.dropped.values()),
        "received": channel.received,
        "dropped": dict(channel.dropped),
        "refused": refused,
        "accepted": channel.received - sum(refused.values()),
        "unsent_errors": getattr(server, "unsent", 0),
        "serving": bool(actor._thread is not None and actor._thread.is_alive()),
    }


def actor_target(actor: Any) -> Target:
    """The ranges of a transfer or draft actor."""
    server = actor.server
    if hasattr(server, "store"):
        return Target("transfer", tuple(server.store.layers), server.store.num_experts, server.slots.num_slots)
    return Target("draft", vocab_size=server.vocab_size, max_positions=server.max_positions)


def fuzz_through_verifier(verifier: Any, draft: Any, target: Target, seed: int, n: int, timeout_s: float) -> dict:
    """Run inside the verifier actor: send ``n`` frames on its pair socket to the draft, reading
    the draft's answers meanwhile, until the draft has read them all (its counts say so)."""
    import ray

    channel = verifier.proposer.channel
    start = ray.get(draft.__ray_call__.remote(actor_counts))["frames"]
    fuzzer, answers = FrameFuzzer(target, seed), 0

    def read_answers() -> None:  # the draft is busy or waits for us to read: read, then retry
        nonlocal answers
        answers += _drain(channel, 0.01)

    sent = _send_frames(channel, fuzzer, n, read_answers)
    deadline = time.monotonic() + timeout_s
    while ray.get(draft.__ray_call__.remote(actor_counts))["frames"] - start < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the draft read fewer than {n} frames within {timeout_s:.0f}s")
        answers += _drain(channel, 0.1)
    answers += _drain(channel, 0.5)
    return {"sent": dict(sent), "skipped": fuzzer.skipped, "answers": answers}


def draft_sends_to_verifier(draft: Any, target: Target, seed: int, n: int, timeout_s: float) -> dict:
    """Run inside the draft actor: pause its serving thread (so its pair socket has one user),
    send ``n`` frames to the verifier on it, then serve again."""
    fuzzer = FrameFuzzer(target, seed)
    deadline = time.monotonic() + timeout_s

    def wait_for_room() -> None:  # the verifier reads as fast as it can
        if time.monotonic() > deadline:
            raise TimeoutError(f"the verifier took fewer than {n} frames within {timeout_s:.0f}s")
        time.sleep(0.001)

    with draft.serving_paused(timeout_s) as channel:
        sent = _send_frames(channel, fuzzer, n, wait_for_room)
    return {"sent": dict(sent), "skipped": fuzzer.skipped}


def verifier_reads(verifier: Any, n: int, timeout_s: float) -> dict[str, Any]:
    """Run inside the verifier actor (idle between requests): read its pair socket through its
    real decoder until ``n`` more frames were received or dropped; returns what it counted."""
    channel = verifier.proposer.channel
    received, dropped = channel.received, dict(channel.dropped)
    deadline = time.monotonic() + timeout_s
    while channel.received - received + sum(channel.dropped.values()) - sum(dropped.values()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the verifier read fewer than {n} frames within {timeout_s:.0f}s")
        channel.recv(0.05)
    got = channel.received - received
    return {
        "frames": got + sum(channel.dropped.values()) - sum(dropped.values()),
        "received": got,
        "dropped": {k: v - dropped.get(k, 0) for k, v in channel.dropped.items()},
        "refused": {},
        "accepted": got,  # decoded: a request's round loop ignores what is not for its round
        "unsent_errors": 0,
        "serving": True,
    }


def _send_frames(channel: Any, fuzzer: FrameFuzzer, n: int, when_full: Callable[[], None]) -> Counter[str]:
    """Send ``n`` fuzzed frames on ``channel``'s socket without blocking, calling ``when_full``
    whenever the peer has no room yet; returns how many of each category were sent."""
    sent = Counter[str]()
    for _ in range(n):
        category, parts = fuzzer.frame()
        while True:
            try:
                channel.socket.send_multipart(parts, zmq.NOBLOCK)
                break
            except zmq.Again:
                when_full()
        sent[category] += 1
    return sent


def _drain(channel: Any, wait_s: float) -> int:
    got = 0
    while channel.recv(wait_s if got == 0 else 0) is not None:
        got += 1
    return got


# -- the driver ---------------------------------------------------------------------------------

def fuzz_pull_socket(endpoint: str, target: Target, seed: int, n: int, timeout_s: float = 60.0) -> dict:
    """Connect a second PUSH peer to a pull socket and send it ``n`` bad frames."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.connect(check_endpoint(endpoint))
    fuzzer, sent = FrameFuzzer(target, seed), Counter[str]()
    try:
        for _ in range(n):
            category, parts = fuzzer.frame()
            sock.send_multipart(parts)
            sent[category] += 1
    finally:
        sock.close(linger=int(timeout_s * 1000))  # linger: deliver what is queued
    return {"sent": dict(sent), "skipped": fuzzer.skipped}


def fuzz_engine(
    handle: Any, prompt: list[int], new_tokens: int, frames: int, seed: int = 0, rounds: int = 2,
    timeout_s: float = 120.0, **options: Any,
) -> dict[str, Any]:
    """Fuzz both sockets of a launched replica ``frames`` frames each, in ``rounds`` bursts between
    requests; after each burst the replica must generate what it generated before any.

    Returns:
        ``{"tokens_identical", "reference", "transfer": {...}, "draft": {...}}``: per socket the
        frames sent by category and the actor's own counts (read, dropped, refused, accepted).

    Raises:
        AssertionError: the output changed, an actor stopped serving, or a frame went uncounted.
    """
    import ray

    reference = handle.generate(prompt, new_tokens, **options)["tokens"]
    endpoint = ray.get(handle.transfer.info.remote())["endpoint"]
    actors = {"transfer": handle.transfer, "draft": handle.draft}
    targets = {role: ray.get(a.__ray_call__.remote(actor_target)) for role, a in actors.items()}
    targets["verifier"] = Target("verifier", vocab_size=targets["draft"].vocab_size,
                                 max_positions=targets["draft"].max_positions)
    actors["verifier"] = handle.verifier
    sent: dict[str, Counter[str]] = {role: Counter() for role in actors}
    counted: dict[str, list[dict[str, Any]]] = {role: [] for role in actors}
    identical, per_round = True, -(-frames // rounds)
    for r in range(rounds):
        n = min(per_round, frames - r * per_round)
        before = ray.get(handle.transfer.__ray_call__.remote(actor_counts))
        sent["transfer"].update(fuzz_pull_socket(endpoint, targets["transfer"], seed + 2 * r, n, timeout_s)["sent"])
        counted["transfer"].append(_delta(before, _wait_frames(handle.transfer, before["frames"] + n, timeout_s)))
        before = ray.get(handle.draft.__ray_call__.remote(actor_counts))
        call = handle.verifier.__ray_call__.remote(
            fuzz_through_verifier, handle.draft, targets["draft"], seed + 2 * r + 1, n, timeout_s
        )
        sent["draft"].update(ray.get(call)["sent"])
        counted["draft"].append(_delta(before, ray.get(handle.draft.__ray_call__.remote(actor_counts))))
        reads = handle.verifier.__ray_call__.remote(verifier_reads, n, timeout_s)
        sends = handle.draft.__ray_call__.remote(
            draft_sends_to_verifier, targets["verifier"], seed + 2 * rounds + r, n, timeout_s
        )
        sent["verifier"].update(ray.get(sends)["sent"])
        counted["verifier"].append(ray.get(reads))
        identical &= handle.generate(prompt, new_tokens, **options)["tokens"] == reference
    report: dict[str, Any] = {"tokens_identical": identical, "reference": reference}
    for role in actors:
        total = _sum(counted[role])
        total["uncounted"] = sum(sent[role].values()) - total["frames"]
        report[role] = {"target": asdict(targets[role]), "sent": dict(sent[role]), **total}
    return report


def _wait_frames(actor: Any, expected: int, timeout_s: float) -> dict[str, Any]:
    """The actor's counts once its channel has read ``expected`` frames in all."""
    import ray

    deadline = time.monotonic() + timeout_s
    while (counts := ray.get(actor.__ray_call__.remote(actor_counts)))["frames"] < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the actor read {counts['frames']} of {expected} frames within {timeout_s:.0f}s")
        time.sleep(0.05)
    return counts


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"serving": after["serving"]}
    for key in ("frames", "received", "accepted", "unsent_errors"):
        out[key] = after[key] - before[key]
    for key in ("dropped", "refused"):
        out[key] = {k: v - before[key].get(k, 0) for k, v in after[key].items()}
    return out


def _sum(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"serving": all(d["serving"] for d in deltas)}
    for key in ("frames", "received", "accepted", "unsent_errors"):
        out[key] = sum(d[key] for d in deltas)
    for key in ("dropped", "refused"):
        out[key] = {k: sum(d[key].get(k, 0) for d in deltas) for k in sorted({k for d in deltas for k in d[key]})}
    return out
