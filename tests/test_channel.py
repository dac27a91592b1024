"""ZeroMQ channels: endpoints, private ipc dirs, handshakes, timeouts, garbage between two processes.

Run as a script to measure PlanDelta round trips: ``python tests/test_channel.py [N]``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from specter.protocol import (
    MALFORMED,
    PROTOCOL_VERSION,
    UNKNOWN,
    WRONG_VERSION,
    DropFetch,
    Hello,
    PlanDelta,
    Shutdown,
    VersionMismatch,
    Welcome,
    encode,
)
from specter.remote.channel import Channel, ChannelError, ChannelTimeout
from specter.remote.endpoints import check_endpoint, endpoint, private_ipc_dir

# The peer process. "garbage": interleave good and bad frames, then wait for Shutdown.
# "echo": send every message back until Shutdown.
PEER = textwrap.dedent(
    """
    import sys
    from specter.remote.channel import Channel
    from specter.protocol import Hello, PlanDelta, Shutdown, encode
    mode, address = sys.argv[1], sys.argv[2]
    ch = Channel("pair", address, bind=False, peer="test", timeout_s=10)
    if mode == "garbage":
        ch.socket.send(b"\\xc1 before the handshake")
    ch.handshake("draft", 10)
    if mode == "garbage":
        bad = [
            b"\\xc1" + bytes(range(20)),
            encode(PlanDelta(9, 0, [1], [[2]], [[1.0]]))[:-3],
            encode(Shutdown("x")).replace(b"shutdown", b"shutdowX"),
            encode(Hello(99, "draft", 1)),
        ]
        for i in range(200):
            ch.send(PlanDelta(i, 0, [0, 1], [[i % 8, 3], [1, 2]], [[0.5, 0.5], [0.9, 0.1]]))
            if i % 5 == 4:
                ch.socket.send_multipart([b"two", b"parts"])
            else:
                ch.socket.send(bad[i % 5])
        ch.send(Shutdown("sent all"))
    while True:
        msg = ch.recv(20)
        if msg is None or isinstance(msg, Shutdown):
            break
        ch.send(msg)
    ch.close()
    """
)


def _peer(mode: str, address: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", PEER, mode, address], stderr=subprocess.PIPE)


def _finish(peer: subprocess.Popen[bytes], ch: Channel) -> None:
    ch.send(Shutdown("test over"))
    try:
        _, err = peer.communicate(timeout=20)
    finally:
        peer.kill()
    assert peer.returncode == 0, err.decode()
    ch.close()


def test_garbage_between_good_frames_is_dropped_and_counted(tmp_path: Path) -> None:
    with private_ipc_dir(tmp_path) as ipc:
        ch = Channel("pair", ipc.endpoint("plan"), bind=True, peer="draft", timeout_s=20)
        peer = _peer("garbage", ch.address)
        hello = ch.handshake("transfer")
        assert hello is not None and hello.role == "draft" and hello.pid == peer.pid
        got = []
        while not isinstance(msg := ch.recv(20), Shutdown):
            assert isinstance(msg, PlanDelta), msg
            got.append(msg.round)
        assert got == list(range(200))
        # 1 before the handshake, 40 raw, 40 truncated, 40 two-part; 40 unknown tags; 40 old Hellos
        assert ch.dropped == {MALFORMED: 121, UNKNOWN: 40, WRONG_VERSION: 40}
        assert ch.received == 2 + 200 + 1  # Hello + Welcome, the plans, the Shutdown (frames = received + dropped)
        _finish(peer, ch)


def _round_trips(ch: Channel, n: int) -> list[float]:
    plan = PlanDelta(7, 2, list(range(16)), [[1, 5, 9, 12, 2, 3, 4, 6]] * 16, [[0.125] * 8] * 16)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ch.send(plan)
        assert ch.recv(10) == plan
        times.append(time.perf_counter() - t0)
    return sorted(times)


def measure(kind: str, n: int, base: Path | None = None) -> list[float]:
    """Sorted round-trip seconds of a 16-layer PlanDelta to an echoing peer process."""
    with private_ipc_dir(base) as ipc:
        address = ipc.endpoint("echo") if kind == "ipc" else endpoint("tcp", 0)
        ch = Channel("pair", address, bind=True, peer="echo", timeout_s=20)
        peer = _peer("echo", ch.address)
        try:
            ch.handshake("bench")
            _round_trips(ch, min(n, 100))  # warm up
            return _round_trips(ch, n)
        finally:
            _finish(peer, ch)


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_plan_delta_round_trip_between_processes(kind: str, tmp_path: Path) -> None:
    # every round trip returns the same PlanDelta (checked in _round_trips); how fast is a benchmark
    # (`python tests/test_channel.py`, docs/wire.md), not a test: a loaded machine would fail it
    times = measure(kind, 300, tmp_path)
    assert len(times) == 300 and all(t > 0 for t in times)


def test_pair_handshake_in_process_then_messages(tmp_path: Path) -> None:
    with private_ipc_dir(tmp_path) as ipc:
        a = Channel("pair", ipc.endpoint("x"), bind=True, peer="b", timeout_s=60)
        b = Channel("pair", ipc.endpoint("x"), bind=False, peer="a", timeout_s=60)
        other = threading.Thread(target=b.handshake, args=("verifier",))
        other.start()
        hello = a.handshake("draft")
        other.join()
        assert hello is not None and hello.role == "verifier" and b.peer_hello is not None
        a.send(DropFetch(3))
        assert b.recv(60) == DropFetch(3)
        a.close()
        b.close()


def test_push_pull_handshake_and_timeouts() -> None:
    pull = Channel("pull", endpoint("tcp", 0), bind=True, peer="draft")
    push = Channel("push", pull.address, bind=False, peer="transfer")
    assert push.handshake("draft", 60) is None
    push.send(DropFetch(1))
    hello = pull.handshake("transfer", 60)
    assert hello is not None and hello.role == "draft"
    assert pull.recv(60) == DropFetch(1)
    t0 = time.monotonic()
    assert pull.recv(0.05) is None
    assert time.monotonic() - t0 < 10.0  # it gave up (a hang would not)
    with pytest.raises(ChannelError, match="cannot send"):
        pull.send(DropFetch(1))
    push.close()
    pull.close()


def test_silent_peer_times_out_with_peer_and_endpoint_named(tmp_path: Path) -> None:
    with private_ipc_dir(tmp_path) as ipc:
        for bind in (True, False):
            ch = Channel("pair", ipc.endpoint(f"silent{bind}"), bind=bind, peer="ghost-verifier")
            with pytest.raises(ChannelTimeout, match=r"no handshake from ghost-verifier at ipc://.*silent"):
                ch.handshake("draft", 0.2)
            ch.close()
        lonely = Channel("push", ipc.endpoint("nobody"), bind=True, peer="nobody")
        with pytest.raises(ChannelTimeout, match="nobody"):
            lonely.send(DropFetch(1), timeout_s=0.1)
        lonely.close()


@pytest.mark.parametrize("reply", [Hello(99, "verifier", 1), Welcome(99, "verifier")])
def test_handshake_version_mismatch_is_a_clear_error(tmp_path: Path, reply: Hello | Welcome) -> None:
    with private_ipc_dir(tmp_path) as ipc:
        ch = Channel("pair", ipc.endpoint("v"), bind=True, peer="verifier", timeout_s=5)
        raw = zmq.Context.instance().socket(zmq.PAIR)
        raw.connect(ch.address)
        raw.send(encode(Hello(PROTOCOL_VERSION, "verifier", 1)) if isinstance(reply, Welcome) else encode(reply))
        if isinstance(reply, Welcome):
            raw.send(encode(reply))
        speaks = rf"handshake with verifier at ipc://.*version 99.*speaks {PROTOCOL_VERSION}"
        with pytest.raises(VersionMismatch, match=speaks):
            ch.handshake("draft")
        raw.close(linger=0)
        ch.close()


@pytest.mark.parametrize(
    "address",
    [
        "tcp://10.0.0.1:5555",
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://eth0:5555",
        "tcp://127.0.0.1;10.0.0.1:5555",
        "tcp://example.com:80",
        "tcp://[::]:5555",
        "pgm://eth0;239.192.1.1:5555",
        "udp://127.0.0.1:5555",
        "127.0.0.1:5555",
    ],
)
def test_non_loopback_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match="loopback|refused|expected"):
        check_endpoint(address)
    with pytest.raises(ValueError):
        Channel("pull", address, bind=True)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://192.0.2.7:5555", "tcp://[::]:*"])
def test_only_an_explicit_expose_flag_allows_a_non_loopback_tcp_endpoint(address: str) -> None:
    with pytest.raises(ValueError, match="not a loopback|expected"):
        check_endpoint(address)
    assert check_endpoint(address, expose=True) == address
    with pytest.raises(ValueError, match="not a loopback"):
        endpoint("tcp", 0, host="0.0.0.0")
    assert endpoint("tcp", 0, host="0.0.0.0", expose=True) == "tcp://0.0.0.0:*"
    with pytest.raises(ValueError, match="bad host or port"):
        check_endpoint("tcp://0.0.0.0:http", expose=True)


def test_a_channel_binds_wildcard_only_when_exposed() -> None:
    with pytest.raises(ValueError, match="not a loopback"):
        Channel("pull", "tcp://0.0.0.0:*", bind=True)
    ch = Channel("pull", "tcp://0.0.0.0:*", bind=True, expose=True)
    assert ch.address.startswith("tcp://0.0.0.0:")
    ch.close()
    ch = Channel("pull", endpoint("tcp", 0), bind=True)
    assert ch.address.startswith("tcp://127.0.0.1:")  # what ZeroMQ actually bound
    ch.close()


def test_loopback_and_ipc_endpoints() -> None:
    assert endpoint("tcp", 5555) == "tcp://127.0.0.1:5555"
    assert endpoint("tcp", 0) == "tcp://127.0.0.1:*"
    for ok in ("tcp://[::1]:5", "tcp://localhost:5", "tcp://127.0.0.2:5", "ipc:///tmp/x.sock"):
        assert check_endpoint(ok) == ok
    with pytest.raises(ValueError, match="over 107"):
        endpoint("ipc", "s", directory="/tmp/" + "d" * 120)
    with pytest.raises(ValueError, match="socket name"):
        endpoint("ipc", "../escape", directory="/tmp")
    with pytest.raises(ValueError, match="port"):
        endpoint("tcp", 70000)


def test_ipc_dir_is_private_and_cleaned_up(tmp_path: Path) -> None:
    ipc = private_ipc_dir(tmp_path)
    assert stat.S_IMODE(os.stat(ipc.path).st_mode) == 0o700
    ch = Channel("pull", ipc.endpoint("sock"), bind=True)
    sock = Path(ch.address.removeprefix("ipc://"))
    assert sock.exists() and sock.parent == ipc.path
    ch.close()
    assert not sock.exists()
    with pytest.raises(ChannelError, match="closed"):
        ch.recv(0)
    ipc.cleanup()
    assert not ipc.path.exists()


def test_drop_logging_is_rate_limited(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with private_ipc_dir(tmp_path) as ipc:
        ch = Channel("pull", ipc.endpoint("g"), bind=True, peer="noisy")
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(ch.address)
        for _ in range(50):
            raw.send(msgpack.packb(["no-such-tag"]))
        raw.send(encode(DropFetch(9)))
        with caplog.at_level("WARNING", logger="specter.remote.channel"):
            assert ch.recv(5) == DropFetch(9)
        assert ch.dropped[UNKNOWN] == 50
        assert len([r for r in caplog.records if "dropped" in r.message]) == 1
        raw.close(linger=0)
        ch.close()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    for kind in ("ipc", "tcp"):
        t = measure(kind, n)
        pct = {p: t[min(int(p / 100 * n), n - 1)] * 1e6 for p in (50, 90, 99)}
        print(
            f"{kind}: PlanDelta round trip over {n}: p50 {pct[50]:.0f} µs, p90 {pct[90]:.0f} µs, p99 {pct[99]:.0f} µs"
        )
