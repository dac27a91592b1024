"""The three roles as plain processes, without Ray (``specter/remote/processes.py``): the same
lossless tests as through the actors, and a killed transfer process reported as such, leaving no
shared memory or ipc directory behind."""

from __future__ import annotations

import _thread
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from process_faults import after_transfers, kill_transfer_after
from transformers import AutoModelForCausalLM

from specter.assets import DEFAULT_MODEL
from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.remote.processes import ROLES, ProcessEngine, RoleError, RoleGone, RoleProcess, launch_processes
from specter.target import OffloadedTarget

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 12
LINK = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)
BUDGET = SlotConfig(fraction=0.25)
ROOT = Path(__file__).resolve().parents[2]
ROLES_MODULES = ["specter.remote.roles.draft", "specter.remote.roles.transfer", "specter.remote.roles.verifier"]


@pytest.fixture(scope="module")
def engine(models) -> ProcessEngine:
    folder, draft = models
    handle = launch_processes(folder, draft, BUDGET, LINK, policy="demand-lru", timeout_s=60)
    yield handle
    handle.shutdown()


def _entries(prefix: str) -> set[str]:
    shm = {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    return shm | {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefix)}


def _in_process(folder: Path, draft: Path, policy: str, window: int, sampling: SamplingConfig | None = None):
    target = OffloadedTarget.load(folder, BUDGET, LINK, policy=policy)
    try:
        return Engine(target, ResidentDraft(draft) if window else None, window).generate_fresh(PROMPT, NEW, sampling)[0]
    finally:
        target.close()


@pytest.mark.parametrize(("policy", "window"), [("demand-lru", 0), ("demand-host", 0), ("specter-paper", 4),
                                                ("specter", 4), ("specter+fixed", 4)])
def test_greedy_through_processes_is_token_identical(engine, models, policy, window) -> None:
    folder, draft = models
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    got = engine.generate(PROMPT, NEW, policy=policy, window=window)
    assert got["tokens"] == _in_process(folder, draft, policy, window) == want[0, len(PROMPT):].tolist()
    assert got["stats"]["misses"] > 0 and got["stats"]["transfers"] > 0
    assert engine.link_counters()["transfers"] >= got["stats"]["transfers"]


def test_sampled_through_processes_equals_in_process(engine, models) -> None:
    folder, draft = models
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=7)
    got = engine.generate(PROMPT, NEW, policy="specter+fixed", window=3, temperature=0.8, top_p=0.95, seed=7)
    assert got["tokens"] == _in_process(folder, draft, "specter+fixed", 3, sampling)


def test_tokens_come_back_over_the_pipe_as_the_rounds_commit(engine, models) -> None:
    """``ProcessEngine.generate(on_tokens=...)`` (``specter generate --processes`` prints through it):
    the verifier process sends each round's tokens as it commits them, then its answer; together the
    same tokens, and the pipe is in step for the next call."""
    folder, draft = models
    pieces: list[list[int]] = []
    got = engine.generate(PROMPT, NEW, on_tokens=pieces.append, policy="specter+fixed", window=3)
    assert len(pieces) > 1 and sum(pieces, []) == got["tokens"] == _in_process(folder, draft, "specter+fixed", 3)
    assert engine.generate(PROMPT, NEW, policy="specter+fixed", window=3)["tokens"] == got["tokens"]


def test_a_bad_request_is_raised_as_itself_and_the_processes_go_on(engine) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPT, 0)
    assert len(engine.generate(PROMPT, 2, policy="demand-lru")["tokens"]) == 2


def test_a_killed_transfer_process_is_reported_as_such_and_leaves_nothing(models) -> None:
    folder, draft = models
    slow = LinkConfig(kind="sim", bandwidth=2e6, latency=5e-5)  # a long request: killed inside it
    handle = launch_processes(folder, draft, BUDGET, slow, policy="specter+fixed", timeout_s=600)
    assert not _entries(handle.prefix)  # sealed: nothing named once wired
    pid = handle.transfer.pid
    killed = kill_transfer_after(handle)  # tied to the request's state (experts moving for it), not to a clock
    try:
        with pytest.raises(RoleGone, match=rf"the transfer process \(pid {pid}\) was killed by signal 9"):
            handle.generate(PROMPT, 240, policy="specter+fixed", window=3)
        assert killed.is_set()
        # told at once (the driver watches the processes), not after the verifier's 600 s timeout
    finally:
        handle.shutdown(timeout_s=2.0)
    assert not any(role.alive() for role in handle.roles)
    assert not _entries(handle.prefix)


def _ignores_sigint(pid: int | None) -> bool:
    """Whether process ``pid`` ignores SIGINT (its ``SigIgn`` mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)


def test_ctrl_c_reaches_no_role_and_a_request_it_cuts_short_ends_every_role_at_once(models) -> None:
    """A terminal's Ctrl-C reaches every process of its group: the roles ignore it (sent SIGINT, they go
    on serving), and the driver, interrupted inside a request, terminates them rather than ask them to
    close (which they would answer once the request is done), leaving nothing behind."""
    folder, draft = models
    slow = LinkConfig(kind="sim", bandwidth=2e6, latency=5e-5)  # a long request: interrupted inside it
    handle = launch_processes(folder, draft, BUDGET, slow, policy="specter+fixed", timeout_s=600)
    try:
        assert all(_ignores_sigint(role.pid) for role in handle.roles)
        for role in handle.roles:
            os.kill(role.pid, signal.SIGINT)
        assert len(handle.generate(PROMPT, 2, policy="demand-lru")["tokens"]) == 2
        interrupted = after_transfers(handle, _thread.interrupt_main)  # tied to the request's state
        with pytest.raises(KeyboardInterrupt):
            handle.generate(PROMPT, 240, policy="specter+fixed", window=3)
        assert interrupted.is_set() and handle.verifier.awaiting == "generate"
    finally:
        handle.shutdown(timeout_s=30)
    # terminated, all three: a role asked to close exits 0 (the draft and the transfer did, before)
    assert [role.process.exitcode for role in handle.roles] == [-signal.SIGTERM] * 3
    assert not _entries(handle.prefix)


def test_a_role_whose_driver_went_away_while_it_was_built_frees_what_it_made(models) -> None:
    """Ctrl-C while a role is being built can leave it without a driver (one interrupted waiting for the
    fork server never learns the role's pid): built, it finds the driver's end of its pipe closed,
    closes itself and exits 0 (not with a BrokenPipeError), and its shared memory is gone."""
    folder, _ = models
    prefix = f"specter-p{os.getpid()}-{secrets.token_hex(4)}"
    role = RoleProcess("transfer", str(folder), BUDGET, LINK, prefix, 60.0)
    role.conn.close()  # the driver's end gone, as when it is interrupted
    role.process.join(300)
    assert role.process.exitcode == 0
    assert not _entries(prefix)


def test_a_role_that_cannot_start_is_named_and_nothing_is_left(models, tmp_path) -> None:
    folder, _ = models
    with pytest.raises(RoleError, match="draft process could not start"):
        launch_processes(folder, tmp_path / "no-such-draft", BUDGET, LINK, policy="specter", timeout_s=30)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"specter-p{os.getpid()}-")]


def test_a_role_that_fails_while_another_still_loads_is_named_by_its_own_error(tmp_path, monkeypatch) -> None:
    """The draft fails at once while another role is still building (a stand-in that takes 30 s): the
    driver, waiting on that role and watching the draft, reports the draft's own error, not just that
    its process exited (which launch order made intermittent: seen once in a run of the actor tests)."""
    monkeypatch.setitem(ROLES, "slow", "probe_role.SlowRole")
    draft = RoleProcess("draft", str(tmp_path / "no-such-draft"), 30.0, "auto")
    draft.process.join(120)  # it has sent its error and exited
    assert not draft.alive()
    slow = RoleProcess("slow", 30.0)
    try:
        with pytest.raises(RoleError, match="draft process could not start: .*no-such-draft"):
            slow.ready(120, [draft])
    finally:
        slow.stop(1)
        draft.stop(1)


def test_each_role_process_takes_the_drivers_environment_as_it_is_at_its_start(monkeypatch) -> None:
    """Roles fork from a server started at the driver's first launch; each still sees the driver's
    environment of its own start, not the server's (as a spawned process would)."""
    monkeypatch.setitem(ROLES, "probe", "probe_role.EnvRole")
    monkeypatch.delenv("SPECTER_PROBE", raising=False)
    first = RoleProcess("probe")
    roles = [first]
    try:
        first.ready(60)  # the fork server runs from here on, with the environment it started with
        monkeypatch.setenv("SPECTER_PROBE", "after")
        second = RoleProcess("probe")
        roles.append(second)
        second.ready(60)
        assert first.call("env", "SPECTER_PROBE", timeout=30) is None
        assert second.call("env", "SPECTER_PROBE", timeout=30) == "after"
    finally:
        for role in roles:
            role.stop(5)


def test_after_a_call_times_out_the_role_takes_no_call_whose_answer_would_be_the_old_one(monkeypatch) -> None:
    """A call that timed out leaves its answer due on the pipe: the next call would have read it as its
    own. It is refused by name instead, and ``stop`` ends the role without asking it to close."""
    monkeypatch.setitem(ROLES, "probe", "probe_role.EnvRole")
    role = RoleProcess("probe")
    try:
        role.ready(60)
        with pytest.raises(TimeoutError, match="no answer to wait"):
            role.call("wait", 30.0, timeout=0.5)
        with pytest.raises(RoleError, match="the answer to wait is still due"):
            role.call("env", "HOME", timeout=30)
    finally:
        role.stop(5)
    assert role.process.exitcode == -signal.SIGTERM


def test_specter_generate_processes_on_the_command_line() -> None:
    """``specter generate --processes`` on the shipped model with its draft, a drafting policy and a stop
    string: the verifier process ends the request at the round that wrote the stop, and the tokens are
    transformers' ``generate(stop_strings=…)``'s; stderr says what starts and nothing more."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    ids = tokenizer.encode("def fibonacci(n):")
    ref = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), experts_implementation="eager", dtype=torch.float32)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, stop_strings=["th, se"],
                        tokenizer=tokenizer)[0, len(ids):].tolist()
    proc = subprocess.run(
        [sys.executable, "-m", "specter.cli", "generate", "--prompt", "def fibonacci(n):", "--policy", "specter",
         "--window", "3", "--max-new-tokens", "48", "--stop", "th, se", "--processes", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == want and result["text"] == tokenizer.decode(want).split("th, se")[0]
    assert result["stats"]["stop"] and result["stats"]["new_tokens"] < 48
    # the seconds before the roles start are not silent; their own setup lines show only with -v
    # ($SPECTER_LOG_LEVEL), as this process's do: through Ray they landed inside the streamed text
    assert proc.stderr.startswith("specter: starting the transfer, verifier and draft processes (no Ray")
    assert "specter.remote.roles" not in proc.stderr and " INFO " not in proc.stderr, proc.stderr[-2000:]


_NO_CUDA_AT_IMPORT = """
import importlib, torch
touched = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_capability",
             "get_device_properties", "is_bf16_supported", "mem_get_info", "set_device"):
    def spy(*args, _name=name, **kwargs):
        touched.append(_name)
        raise RuntimeError("CUDA touched while the fork server's modules import")
    setattr(torch.cuda, name, spy)
from specter.remote.processes import PRELOAD
for module in PRELOAD:
    importlib.import_module(module)
print(sorted(PRELOAD), touched)
"""


def test_the_fork_servers_modules_touch_no_cuda_when_imported() -> None:
    """The roles fork from a server that imported ``PRELOAD``: CUDA initialized there (a device query
    is enough: it runs ``cuInit``) would be unusable in every forked role on a GPU. Each CUDA query a
    module could make at import raises here, and none is made."""
    proc = subprocess.run([sys.executable, "-c", _NO_CUDA_AT_IMPORT], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == f"{sorted(ROLES_MODULES)} []"


def test_prepared_steps_through_processes_run_no_step_cold_and_stay_lossless() -> None:
    """``step="static"`` (the pieces a GPU replays as CUDA graphs, run eagerly on a CPU): before
    ``prepare_steps`` a request runs steps cold (a GPU captures inside it); after it, neither the
    verifier's nor the draft process's steps run cold — across a policy change that rebuilds the
    target, too — and the tokens are the in-process engine's with eager steps."""
    model, awq = DEFAULT_MODEL, f"{DEFAULT_MODEL}-awq"
    with launch_processes(model, awq, BUDGET, LINK, policy="demand-lru", timeout_s=60, draft_mode="dequant-cache",
                          step="static") as engine:
        first = engine.generate(PROMPT, NEW, policy="demand-lru")
        assert first["stats"]["cold_steps"] > 0  # without it: the one-token step's first runs in the request
        ready = engine.prepare_steps(4)
        assert ready["verifier"] == 4 and ready["draft"] == 6  # 2..5 tokens (1 ran above); 1..6
        assert engine.prepare_steps(4) == {"verifier": 0, "draft": 0}
        draft_cold = engine.call(engine.draft, "cold_steps")
        spec = engine.generate(PROMPT, NEW, policy="specter+fixed", window=4)
        plain = engine.generate(PROMPT, NEW, policy="demand-lru")
        assert spec["stats"]["cold_steps"] == plain["stats"]["cold_steps"] == 0
        assert engine.call(engine.draft, "cold_steps") == draft_cold
        assert engine.prepare_steps(6) == {"verifier": 2, "draft": 2}  # a wider window: only its new counts
    want = {}
    for policy, window in (("demand-lru", 0), ("specter+fixed", 4)):
        target = OffloadedTarget.load(model, BUDGET, LINK, policy=policy, step="eager")
        try:
            draft = load_draft(awq, device="cpu", mode="dequant-cache", step="eager") if window else None
            want[policy] = Engine(target, draft, window).generate_fresh(PROMPT, NEW)[0]
        finally:
            target.close()
    assert first["tokens"] == plain["tokens"] == want["demand-lru"]
    assert spec["tokens"] == want["specter+fixed"]


def test_a_kept_chooser_goes_to_the_verifier_process_and_comes_back(engine, models) -> None:
    """``specter generate --processes`` keeps its K chooser between runs: the verifier process starts
    from the state it is handed (when its own chooser for that policy has served no request), hands back
    the state after the request, keeps its own after that, and refuses a damaged one by name."""
    from specter.plan import make_policy

    given = make_policy("specter+last").new_window_chooser()
    given.begin_request()
    for k, verify in ((0, 5e-3), (0, 4e-3), (4, 6e-3), (4, 5e-3)):
        given.choose(8)
        given.record(k, 1e-3 * k, verify, min(k, 3))
    state = given.state() | {"requests": 5}
    with pytest.raises(ValueError, match="K chooser state"):
        engine.generate(PROMPT, NEW, policy="specter+last", window=8, chooser=state | {"tried": "lots"})
    want = engine.generate(PROMPT, NEW, policy="demand-lru")["tokens"]
    out = engine.generate(PROMPT, NEW, policy="specter+last", window=8, chooser=state)
    assert out["tokens"] == want and out["chooser"]["requests"] == 6 and out["chooser"]["route_last"]
    assert out["chooser"]["samples"]["4"] >= 1  # what it was handed, gone on from
    again = engine.generate(PROMPT, NEW, policy="specter+last", window=8, chooser={})
    assert again["tokens"] == want and again["chooser"]["requests"] == 7  # its own, not the one handed
    assert "chooser" not in engine.generate(PROMPT, NEW, policy="specter+last", window=8)
