"""On a GPU (skipped without CUDA, collected everywhere so it cannot rot): the three roles as plain
processes on the device (``launch_processes`` with a ``cuda`` link): the transfer process's copy
stream writes the slots the verifier reads by CUDA IPC, ordered by the slots' interprocess events.
Every policy is token-identical to transformers' greedy ``generate`` in fp32 on the same device and to
the in-process engine in bf16; a killed transfer process is reported as such and leaves no shared
memory and no device memory behind."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
from process_faults import kill_transfer_after
from transformers import AutoModelForCausalLM

from specter.assets import DEFAULT_MODEL
from specter.config import LinkConfig, SlotConfig
from specter.draft.loading import load_draft
from specter.engine import Engine
from specter.eval.prompts import load_prompts
from specter.models.greedy import greedy_continuation
from specter.plan import POLICIES, drafts
from specter.remote.processes import ProcessEngine, RoleGone, launch_processes
from specter.target import OffloadedTarget

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = 24
BUDGET = SlotConfig(fraction=0.25)
CUDA = LinkConfig(kind="cuda")
DRAFT = f"{DEFAULT_MODEL}-awq"
MODE = "dequant-cache"  # as the in-process GPU tests draft


def _window(policy: str) -> int:
    return 8 if drafts(policy) else 0


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return load_prompts(DEFAULT_MODEL, None, 1)[0]


@pytest.fixture(scope="module")
def fp32_processes() -> Iterator[ProcessEngine]:
    with launch_processes(DEFAULT_MODEL, DRAFT, BUDGET, CUDA, policy="demand-lru", draft_mode=MODE,
                          dtype=torch.float32) as engine:
        yield engine


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_through_the_processes_on_the_gpu_equals_transformers(fp32_processes, prompt, policy) -> None:
    reference = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():
        expected = greedy_continuation(reference, prompt, NEW)
    got = fp32_processes.generate(prompt, NEW, policy=policy, window=_window(policy))
    assert got["tokens"][:NEW] == expected, policy
    assert got["stats"]["bytes_moved"] > 0 and got["stats"]["transfers"] > 0  # the copy stream ran


@pytest.mark.parametrize("policy", ["demand-lru", "specter-paper", "specter"])
def test_bf16_through_the_processes_equals_the_engine_in_process(prompt, policy) -> None:
    target = OffloadedTarget.load(DEFAULT_MODEL, BUDGET, CUDA, policy, device="cuda", dtype=torch.bfloat16)
    try:
        window = _window(policy)
        draft = load_draft(DRAFT, device="cuda", mode=MODE) if window else None
        expected, _ = Engine(target, draft, window).generate_fresh(prompt, NEW)
    finally:
        target.close()
    with launch_processes(DEFAULT_MODEL, DRAFT, BUDGET, CUDA, policy=policy, draft_mode=MODE,
                          dtype=torch.bfloat16) as engine:
        got = engine.generate(prompt, NEW, policy=policy, window=window)
    assert got["tokens"] == list(expected)


def test_a_killed_transfer_process_on_the_gpu_leaves_nothing(prompt) -> None:
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    handle = launch_processes(DEFAULT_MODEL, DRAFT, BUDGET, CUDA, policy="specter+fixed", draft_mode=MODE,
                              timeout_s=600)
    pid = handle.transfer.pid
    killed = kill_transfer_after(handle, poll_s=0.005)  # tied to the request's state, not to a clock
    try:
        with pytest.raises(RoleGone, match=rf"the transfer process \(pid {pid}\) was killed by signal 9"):
            handle.generate(prompt, 600, policy="specter+fixed", window=3)
        assert killed.is_set()
    finally:
        handle.shutdown(timeout_s=5.0)
    assert not any(role.alive() for role in handle.roles)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(handle.prefix)]
    deadline = time.monotonic() + 30
    while torch.cuda.mem_get_info()[0] < free_before - (64 << 20):  # the driver frees a dead process's memory
        assert time.monotonic() < deadline, "the killed replica's device memory was not freed"
        time.sleep(0.5)


def test_steps_captured_up_front_in_the_processes_stay_token_identical(fp32_processes, prompt) -> None:
    """``prepare_steps``: the verifier's and the draft process's CUDA graphs of every count a window of
    8 uses captured before the requests; none of their steps then runs cold, and the tokens are still
    transformers' (the graphs captured beside the transfer process's copies into the shared slots)."""
    reference = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():
        expected = greedy_continuation(reference, prompt, NEW)
    fp32_processes.prepare_steps(8)
    assert fp32_processes.prepare_steps(8) == {"verifier": 0, "draft": 0}  # all ready: nothing left to capture
    draft_cold = fp32_processes.call(fp32_processes.draft, "cold_steps")
    for policy in ("specter+fixed", "demand-lru", "specter"):
        got = fp32_processes.generate(prompt, NEW, policy=policy, window=_window(policy))
        assert got["tokens"][:NEW] == expected, policy
        assert got["stats"]["cold_steps"] == 0, policy
    assert fp32_processes.call(fp32_processes.draft, "cold_steps") == draft_cold
