"""SIGTERM and SIGHUP stop a command as Ctrl-C does (``specter.signals``): a signal the process was
started ignoring stays ignored (``nohup``), and a terminal that hung up is written to no more. Ray's
``ray.init`` does not take that away (``actors.cluster``): a program's own SIGTERM handler is back after it, a SIGTERM Ray's
handler took during it reaches the program's, and the embedded Ray's processes stay out of the
driver's process group, so a signal to the group (``timeout``, systemd, Slurm) finds them alive
while the driver stops them."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from actors import cluster
from specter.signals import STOPS, Terminated, handling, raise_terminated, signal_of, terminating


def _deliver() -> None:
    for _ in range(1000):  # the handler runs between two bytecodes of the main thread
        pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_inside_terminating_sigterm_or_sighup_raises_terminated_and_the_handlers_are_restored(signum) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(Terminated) as caught, terminating():
        assert all(signal.getsignal(sig) is not old for sig, old in before.items())
        os.kill(os.getpid(), signum)
        _deliver()
    assert isinstance(caught.value, KeyboardInterrupt) and signal_of(caught.value) == signum
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    """``nohup`` starts a command with SIGHUP ignored, a shell script its background jobs with SIGINT
    ignored: ``handling`` leaves those as they are (and restores the others)."""
    before = {sig: signal.getsignal(sig) for sig in STOPS}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        seen: list[int] = []
        with handling(lambda signum, frame: seen.append(signum)):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)
            _deliver()
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


HUNG_UP = textwrap.dedent("""
    import os, signal, sys
    from specter.signals import handling

    seen = []
    with handling(lambda signum, frame: seen.append((signum, os.readlink("/proc/self/fd/2")))):
        os.kill(os.getpid(), signal.SIGHUP)  # by hand, the terminal still there: it stays
        for _ in range(1000):
            pass
        print("ready", flush=True)
        while os.isatty(2):  # until the test closes the terminal
            pass
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(1000):
            pass
        print("written after the hangup", file=sys.stderr, flush=True)  # on the hung-up terminal: EIO
    with open(sys.argv[1], "w") as f:
        f.write(repr(seen))
""")


def test_on_sighup_a_hung_up_terminal_is_swapped_for_dev_null(tmp_path) -> None:
    """A command's standard output and error on a terminal that closed (the test closes the pty's
    master side, as a terminal window or an ssh connection does): from the SIGHUP on they write to
    ``/dev/null``, so a stop's last lines do not fail with ``EIO``; a SIGHUP while the terminal is
    still there leaves them on it."""
    master, slave = pty.openpty()
    terminal = os.ttyname(slave)
    result = tmp_path / "seen"
    proc = subprocess.Popen([sys.executable, "-c", HUNG_UP, str(result)], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave)
    os.close(slave)
    try:
        output = b""
        while b"ready" not in output:
            output += os.read(master, 1024)
    finally:
        os.close(master)
    assert proc.wait(timeout=60) == 0
    assert result.read_text() == repr([(int(signal.SIGHUP), terminal), (int(signal.SIGHUP), os.devnull)])


def test_a_plain_keyboard_interrupt_after_a_sigterm_is_still_the_sigterm() -> None:
    """Ray's ``ray.get`` turns what its wait's signal check raised into a plain ``KeyboardInterrupt``:
    once a SIGTERM was seen, that one counts as SIGTERM; a new ``terminating`` starts afresh."""
    with terminating():
        assert signal_of(KeyboardInterrupt()) == signal.SIGINT
        with pytest.raises(Terminated):
            raise_terminated(signal.SIGTERM, None)
        assert signal_of(KeyboardInterrupt()) == signal.SIGTERM
    with terminating():
        assert signal_of(KeyboardInterrupt()) == signal.SIGINT


def test_outside_the_main_thread_terminating_leaves_sigterm_alone() -> None:
    seen = []

    def run() -> None:
        before = signal.getsignal(signal.SIGTERM)
        with terminating():
            seen.append(signal.getsignal(signal.SIGTERM) is before)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [True]


def test_a_sigterm_rays_handler_takes_during_ray_init_reaches_the_programs_own() -> None:
    """``ray.init`` first installs ``sys.exit(signum)`` as the SIGTERM handler (``ray/_private/worker.py``,
    ``init``): the ``SystemExit(15)`` it raises inside is handed to the program's handler, which is
    back afterwards. The body below does what that handler does; the real ``ray.init`` is the next test's."""
    with terminating():
        mine = signal.getsignal(signal.SIGTERM)
        with pytest.raises(Terminated), cluster._sigterm_kept():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # Ray's
            os.kill(os.getpid(), signal.SIGTERM)
            _deliver()
        assert signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(SystemExit), cluster._sigterm_kept():  # any other exit is not a signal's
            sys.exit(3)


PROGRAM = textwrap.dedent("""
    import os, signal, sys
    import ray
    from actors.cluster import start_local
    from specter.signals import Terminated, terminating

    with terminating():
        mine = signal.getsignal(signal.SIGTERM)
        start_local(1)
        try:
            os.killpg(os.getpgrp(), signal.SIGTERM)  # the whole group, as timeout, systemd and Slurm send it
            for _ in range(10 ** 7):
                pass
            print("not delivered")
        except Terminated:
            print("terminated, handler back:", signal.getsignal(signal.SIGTERM) is mine)
        print("ray still answers:", ray.get(ray.remote(lambda: 7).remote(), timeout=60))  # a task: raylet, worker
        ray.shutdown()
    print("done")
""")


def test_after_start_local_a_sigterm_to_the_group_reaches_the_programs_handler_and_ray_lives_on() -> None:
    """In a process group of its own (as a terminal, ``timeout`` or a service manager starts a
    command): after ``start_local`` a SIGTERM to the group raises the program's ``Terminated`` — not
    Ray's C++ stack dump and abort — and the embedded Ray, out of the group, still answers and stops
    when asked."""
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=180,
                          start_new_session=True)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert out == ["terminated, handler back: True", "ray still answers: 7", "done"], proc.stdout
    assert "SIGTERM received" not in proc.stderr, proc.stderr[-3000:]
