"""The three actors on a local Ray: token-identical to the in-process engine, clean teardown."""

from __future__ import annotations

import _thread
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from actors.client import Client
from actors.launcher import EngineHandle, launch
from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.plan import adapts
from specter.target import OffloadedTarget

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 12
LINK = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)
BUDGET = SlotConfig(fraction=0.25)  # 6 of 24 routed experts




@pytest.fixture(scope="module")
def engine(local_ray, models) -> EngineHandle:
    folder, draft = models
    handle = launch(folder, draft, BUDGET, LINK, policy="demand-lru", timeout_s=60)
    yield handle
    handle.shutdown()


def _in_process(
    folder: Path, draft: Path | None, policy: str, window: int, sampling: SamplingConfig | None = None
) -> list[int]:
    target = OffloadedTarget.load(folder, BUDGET, LINK, policy=policy)
    try:
        engine = Engine(target, ResidentDraft(draft) if window else None, window)
        return engine.generate_fresh(PROMPT, NEW, sampling)[0]
    finally:
        target.close()


def _reference(folder: Path) -> list[int]:
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize(
    ("policy", "window"),
    [("demand-lru", 0), ("gate-prefetch", 0), ("demand-host", 0), ("specmoeoff", 3), ("specter-paper", 4),
     ("specter", 4), ("specter+fixed", 4), ("oracle", 4)],
)
def test_greedy_through_actors_is_token_identical(engine, models, policy, window) -> None:
    folder, draft = models
    got = engine.generate(PROMPT, NEW, policy=policy, window=window)
    expected = _in_process(folder, draft, policy, window)
    assert got["tokens"] == expected == _reference(folder)
    stats = got["stats"]
    assert stats["new_tokens"] == NEW and stats["policy"] == policy
    assert stats["misses"] > 0 and stats["transfers"] > 0
    assert stats["bytes_moved"] == stats["transfers"] * 3 * 32 * 48 * 4  # fp32 experts, H=32, I=48
    if window and not adapts(policy):  # specter chooses K per round on the wall clock: maybe 0
        assert stats["rounds"] > 0 and stats["drafted"] > 0 and 0 < stats["recall"] <= 1
    counters = engine.link_counters()
    assert counters["transfers"] >= stats["transfers"] and counters["rejected"] == 0


def test_host_compute_through_actors_reads_the_transfer_store_read_only(local_ray, models) -> None:
    """A slow link: the host finishes a late expert first, so the verifier computes it from the
    transfer actor's store, which it maps read-only; the tokens stay transformers'."""
    folder, draft = models
    slow = LinkConfig(kind="sim", bandwidth=2e6, latency=0.0)  # ~9 ms per tiny expert
    handle = launch(folder, draft, BUDGET, slow, policy="demand-host", timeout_s=60)
    try:
        for policy, window in (("demand-host", 0), ("specter", 3)):
            got = handle.generate(PROMPT, NEW, policy=policy, window=window)
            assert got["tokens"] == _reference(folder), policy
            assert got["stats"]["host_experts"] > 0, policy
        pid = ray.get(handle.verifier.pid.remote())
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        store = [line for line in maps if f"{handle.prefix}-store" in line]
        assert store and all(line.split()[1].startswith("r-") for line in store), store  # no write bit
        assert all("(deleted)" in line for line in store)  # sealed: the name is gone, the memory is not
    finally:
        handle.shutdown()


def test_the_schedule_moves_between_the_transfer_actor_and_the_verifier(engine, models) -> None:
    """Per request the schedule runs next to the copies or in the verifier; the tokens do not care,
    and a bad place is refused by name."""
    folder, draft = models
    reference = _reference(folder)
    for schedule in ("verifier", "transfer", "verifier"):
        got = engine.generate(PROMPT, NEW, policy="specter+fixed", window=3, schedule=schedule)
        assert got["tokens"] == reference, schedule
        assert got["stats"]["transfers"] > 0
    with pytest.raises(ValueError, match="^schedule: expected one of transfer, verifier"):
        engine.generate(PROMPT, NEW, schedule="driver")
    engine.generate(PROMPT, NEW, policy="demand-lru", schedule="transfer")  # back to the module's default
    assert engine.link_counters()["rejected"] == 0


def test_the_window_chooser_survives_a_schedule_move_and_is_kept_per_mode(engine) -> None:
    """Moving the schedule rebuilds the verifier's target; what `specter`'s K chooser learnt stays,
    and pipelined requests learn in a chooser of their own (a round drafted ahead costs no drafting).
    Counts are compared as increments: earlier tests may have taught either chooser already."""
    def request(schedule: str, pipelined: bool) -> tuple[int, int]:
        stats = engine.generate(PROMPT, NEW, policy="specter", window=4, schedule=schedule,
                                pipelined=pipelined)["stats"]
        return stats["chooser_rounds"], stats["rounds"] + stats["plain_rounds"]

    before, _ = request("transfer", False)
    moved, played = request("verifier", False)
    assert 0 < moved - before <= played  # learnt on through the rebuild, from this request's rounds
    ahead, _ = request("verifier", True)
    ahead_again, played_ahead = request("verifier", True)
    assert 0 < ahead_again - ahead <= played_ahead
    back, played = request("transfer", False)
    assert 0 < back - moved <= played  # the pipelined requests in between taught it nothing
    engine.generate(PROMPT, NEW, policy="demand-lru", schedule="transfer")  # back to the module's default


def test_sampling_through_actors_matches_in_process(engine, models) -> None:
    """Same seed, same draft generator, same K every round on both sides: the same sampled tokens
    (a K chosen from wall-clock timings, as plain `specter` does, would change which are drawn)."""
    folder, draft = models
    sampling = SamplingConfig(temperature=1.0, top_k=8, seed=3)
    got = engine.generate(PROMPT, NEW, policy="specter+fixed", window=3, temperature=1.0, top_k=8, seed=3)
    assert got["tokens"] == _in_process(folder, draft, "specter+fixed", 3, sampling)


def _streamed(engine: EngineHandle, request_id: str, prompt: list[int], new: int):  # type: ignore[no-untyped-def]
    return engine.verifier.stream.remote(request_id, prompt, new)


def _drain(chunks) -> tuple[list[int], dict]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    stats: dict = {}
    for ref in chunks:
        chunk = ray.get(ref)
        tokens += chunk["tokens"]
        stats = chunk.get("stats", stats)
    return tokens, stats


@pytest.mark.parametrize("schedule", ["transfer", "verifier"])
def test_streams_of_a_drafting_policy_are_batched_with_their_drafts_and_each_is_itself_alone(engine, schedule) -> None:
    """Once the verifier runs a drafting policy its streams batch (``concurrency`` > 1): each batched
    round is drafted in the draft actor for every request together (``ProposeBatch``), and each
    request's greedy tokens are those it gets alone."""
    prompts = [PROMPT, [7, 7, 3], [120, 4, 56, 9, 11], [33, 2]]
    alone = [engine.generate(p, NEW, policy="specter+fixed", window=3, schedule=schedule)["tokens"] for p in prompts]
    assert ray.get(engine.verifier.concurrency.remote()) > 1
    streams = [_streamed(engine, f"draft-batch-{schedule}-{i}", p, NEW) for i, p in enumerate(prompts)]
    results = [_drain(chunks) for chunks in streams]
    assert [tokens for tokens, _ in results] == alone
    assert max(stats["mean_batch"] for _, stats in results) > 1  # they shared steps
    assert all(stats["rounds"] > 0 and stats["mean_accepted"] > 0 for _, stats in results)
    engine.generate(PROMPT, NEW, policy="demand-lru", schedule="transfer")  # back to the module's default
    assert engine.link_counters()["rejected"] == 0


def test_a_request_the_verifier_refuses_is_its_own_one_line_value_error(engine) -> None:
    """The verifier's refusal (a request past the model's context) reaches the caller as a
    ``ValueError`` with its message alone; before, Ray's wrapping came with it (the actor's name and
    pid, its traceback), and ``specter generate --address`` printed all of that after "specter:
    error:". The replica serves on."""
    with pytest.raises(ValueError) as caught:
        engine.generate(PROMPT, 10**6, policy="demand-lru", window=0)
    assert type(caught.value) is ValueError
    text = str(caught.value)
    assert text.startswith("max_new_tokens: prompt") and "exceeds the model's context" in text
    assert "\n" not in text and "ray::" not in text
    with pytest.raises(ValueError, match="^stop: this model has no tokenizer"):  # the tiny one has none
        engine.generate(PROMPT, 4, policy="demand-lru", window=0, stop=["x"])
    assert len(engine.generate(PROMPT, 4, policy="demand-lru", window=0)["tokens"]) == 4


def test_stop_strings_end_a_request_through_the_actors_batched_or_not(local_ray) -> None:
    """``stop`` through the actors on the shipped model: a stream that joins the verifier's batched steps
    (the replica's own drafting policy) and a request with its own window both end at the round that
    wrote the stop, well before ``max_new_tokens``; cut (``until_stop``, as ``Client.generate`` does),
    their tokens are transformers' ``generate(stop_strings=…)``'s."""
    from transformers import AutoTokenizer

    from specter.assets import DEFAULT_DRAFT, DEFAULT_MODEL
    from specter.serving.text import until_stop

    stops, new = ("th, se",), 48
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    ids = tokenizer.encode("def fibonacci(n):")
    ref = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), experts_implementation="eager", dtype=torch.float32)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, stop_strings=list(stops),
                        tokenizer=tokenizer)[0, len(ids):].tolist()
    assert len(want) < new // 2
    handle = launch(DEFAULT_MODEL, DEFAULT_DRAFT, SlotConfig(fraction=0.5), LINK, policy="specter", timeout_s=60)
    try:
        assert ray.get(handle.verifier.concurrency.remote()) > 1  # its streams run batched
        pieces: list[list[int]] = []
        streamed = handle.stream(ids, new, pieces.append, stop=list(stops))
        alone = handle.generate(ids, new, window=3, policy="specter", stop=list(stops))
    finally:
        handle.shutdown()
    for out in (streamed, alone):
        assert until_stop(tokenizer.decode, out["tokens"], stops)[0] == want
        assert out["stats"]["stop"] and not out["stats"]["cancelled"] and out["stats"]["new_tokens"] < new
    assert sum(pieces, []) == streamed["tokens"]


def test_a_stream_hands_out_each_rounds_tokens_and_ends_as_generate_does(engine, models) -> None:
    """``EngineHandle.stream`` (``specter generate --address`` prints through it): the verifier's
    tokens in several pieces as the rounds commit, together transformers' greedy; the same result and
    figures as ``generate``, the K chooser's state too; a refusal is the same one-line ``ValueError``."""
    folder, _ = models
    pieces: list[list[int]] = []
    out = engine.stream(PROMPT, NEW, pieces.append, policy="specter", window=4, chooser={})
    assert len(pieces) > 1 and all(pieces) and sum(pieces, []) == out["tokens"] == _reference(folder)
    assert out["stats"]["new_tokens"] == NEW and out["chooser"]["requests"] >= 1  # its K: plain steps or rounds
    with pytest.raises(ValueError) as caught:
        engine.stream(PROMPT, 10**6, pieces.append, policy="demand-lru", window=0)
    assert type(caught.value) is ValueError and "\n" not in str(caught.value) and "ray::" not in str(caught.value)


def test_a_sealed_replica_has_no_names_to_leak_and_shutdown_leaves_no_actor(engine) -> None:
    names, ipc_dir, prefix = list(engine.names), engine.ipc_dir, engine.prefix
    assert len(names) == 3 and ipc_dir
    # sealed once wired: the memory is mapped and the sockets connected, but nothing has a name
    # left that a crash could leak, and the replica still serves
    assert not os.path.exists(ipc_dir)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert len(engine.generate(PROMPT, 4, policy="demand-lru", window=0)["tokens"]) == 4
    engine.shutdown()
    for name in names:
        with pytest.raises(ValueError):
            ray.get_actor(name)
    assert not os.path.exists(ipc_dir)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_ctrl_c_inside_a_request_kills_the_replica_rather_than_wait_for_it(local_ray, models, caplog) -> None:
    """Ctrl-C while a request runs (``specter generate --address``: the client's ``with`` shuts the
    replica down on the way out): each actor is killed at once, not asked to close, which it would
    answer only once the request is done (a slow link: a long one), so no close waits out its timeout."""
    folder, draft = models
    slow = LinkConfig(kind="sim", bandwidth=2e6, latency=5e-5)
    handle = launch(folder, draft, BUDGET, slow, policy="demand-lru", timeout_s=600)

    def ctrl_c_inside() -> None:  # tied to the request's state, not to a clock
        while not ray.get(handle.verifier.progress.remote())["committed"]:
            time.sleep(0.01)
        _thread.interrupt_main()

    threading.Thread(target=ctrl_c_inside, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            handle.generate(PROMPT, 240, policy="demand-lru")
        assert handle.cut_short
    finally:
        with caplog.at_level(logging.WARNING, logger="actors.launcher"):
            handle.shutdown(timeout_s=5.0)
    assert not [r for r in caplog.records if "shutdown of" in r.getMessage()]  # no close asked, none timed out
    for name in handle.names:
        with pytest.raises(ValueError):
            ray.get_actor(name)


def test_client_generates_token_ids_prompts(local_ray, models) -> None:
    folder, draft = models
    with Client(folder, draft, BUDGET, LINK, policy="specter+fixed", address=None) as client:
        out = client.generate([PROMPT, PROMPT[:3]], max_new_tokens=NEW, window=4)
        kept = client.generate([PROMPT, PROMPT], max_new_tokens=NEW, policy="specter", window=4, chooser={})
        names = list(client.handle.names)
    assert out[0]["tokens"] == _reference(folder) and len(out[1]["tokens"]) == NEW
    assert "chooser" not in out[0]  # not asked for
    # the K chooser's state after each request, as `specter generate` keeps it between runs
    assert kept[0]["tokens"] == kept[1]["tokens"] == out[0]["tokens"]
    assert [r["chooser"]["requests"] for r in kept] == [1, 2]
    assert out[0]["text"] == "" and out[0]["stats"]["rounds"] > 0
    for name in names:
        with pytest.raises(ValueError):
            ray.get_actor(name)


def test_cli_generate_through_actors_equals_in_process(local_ray, models, capsys) -> None:
    """`specter generate --address …` goes through the actors and prints the in-process tokens."""
    from specter.cli import main

    folder, draft = models
    argv = ["generate", "--model", str(folder), "--draft", str(draft), "--policy", "specter+fixed", "--window", "4",
            "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--budget", "0.25",
            "--link", "sim:2,5", "--json"]
    assert main(argv) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(argv + ["--address", "local"]) == 0  # Ray is up already: the client uses it
    remote = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert remote["tokens"] == local["tokens"] == _reference(folder)
    assert remote["stats"]["rounds"] == local["stats"]["rounds"] > 0


def test_prepared_steps_through_the_actors_run_no_step_cold(local_ray) -> None:
    """``EngineHandle.prepare_steps``: as through the plain processes (``test_processes.py``), the
    verifier's and the draft actor's static steps of a window made ready before the request, which
    then runs none of them cold and commits the eager in-process engine's tokens."""
    from specter.assets import DEFAULT_MODEL
    from specter.draft.loading import load_draft

    awq = f"{DEFAULT_MODEL}-awq"
    handle = launch(DEFAULT_MODEL, awq, BUDGET, LINK, policy="specter+fixed", timeout_s=60,
                    draft_mode="dequant-cache", step="static")
    try:
        assert handle.prepare_steps(4) == {"verifier": 5, "draft": 6}
        draft_cold = ray.get(handle.draft.cold_steps.remote())
        got = handle.generate(PROMPT, NEW, policy="specter+fixed", window=4)
        assert got["stats"]["cold_steps"] == 0
        assert ray.get(handle.draft.cold_steps.remote()) == draft_cold
    finally:
        handle.shutdown()
    target = OffloadedTarget.load(DEFAULT_MODEL, BUDGET, LINK, policy="specter+fixed", step="eager")
    try:
        draft = load_draft(awq, device="cpu", mode="dequant-cache", step="eager")
        assert got["tokens"] == Engine(target, draft, 4).generate_fresh(PROMPT, NEW)[0]
    finally:
        target.close()
