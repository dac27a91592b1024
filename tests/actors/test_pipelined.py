"""Pipelined drafting over a real ZeroMQ pair socket (draft server in a thread, no Ray): the same
tokens as transformers and as the in-process engine, greedy and sampled; rounds drafted ahead stand
when the draft is right and are thrown away (cache and generator rolled back) when it is not."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from tiny_models import noisy_copy
from transformers import AutoModelForCausalLM

from specter.config import LinkConfig, SamplingConfig, SlotConfig
from specter.draft.resident import ResidentDraft
from specter.engine import Engine
from specter.proposer import IdleProposer, LocalProposer
from specter.protocol import AheadKeep, AheadStart, DraftTokens, PlanDelta, ProposeRequest, StartRequest
from specter.remote.channel import Channel
from specter.remote.draft_server import DraftServer
from specter.remote.proposer import RemoteProposer
from specter.target import OffloadedTarget

PROMPT = [5, 99, 17, 42, 8, 63, 21]
NEW = 24
LINK = LinkConfig(kind="sim", bandwidth=2e9, latency=5e-6)


class Served:
    """A draft server in a thread at one end of a pair socket, a ``RemoteProposer`` at the other."""

    def __init__(self, draft: ResidentDraft):
        name = f"inproc://pipelined-{uuid.uuid4().hex}"
        self.server_end = Channel("pair", name, bind=True, peer="verifier", timeout_s=30)
        self.client_end = Channel("pair", name, bind=False, peer="draft", timeout_s=30)
        shake = threading.Thread(target=self.server_end.handshake, args=("draft", 30))
        shake.start()
        self.client_end.handshake("verifier", 30)
        shake.join()
        self.server = DraftServer(draft, self.server_end)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop, 0.01), daemon=True)
        self.thread.start()
        self.proposer = RemoteProposer(self.client_end, timeout_s=30)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.server_end.close()
        self.client_end.close()


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def setup(request, tiny_dir, tmp_path_factory):
    folder = tiny_dir(request.param)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    noisy = ResidentDraft(noisy_copy(folder, tmp_path_factory.mktemp("draft") / "d"))
    return folder, out[0, len(PROMPT):].tolist(), noisy


def _generate(folder, draft, window, sampling=None, pipelined=True, policy="specter+fixed", local=False):
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK, policy=policy)
    served = None if local else Served(draft)
    try:
        if local:
            engine = Engine(target, draft, window)
        else:
            engine = Engine(target, window=window, proposer=served.proposer, pipelined=pipelined)
        tokens, stats = engine.generate_fresh(PROMPT, NEW, sampling)
        return tokens, stats, served
    finally:
        target.close()
        if served is not None:
            served.close()


@pytest.mark.parametrize("policy", ["specter+fixed", "specter", "specter+last", "specmoeoff"])
def test_pipelined_greedy_is_transformers_and_rounds_drafted_ahead_stand(setup, policy):
    folder, expected, _ = setup
    same = ResidentDraft(folder)  # the target as its own draft: every guess is right
    tokens, stats, served = _generate(folder, same, 4, policy=policy)
    assert tokens == expected
    assert stats.extra["pipelined"] and stats.extra["ahead_asked"] > 0
    assert stats.extra["ahead_kept"] == stats.extra["ahead_asked"]  # nothing thrown away
    assert served.server.ahead_thrown == 0 and served.server.ahead_rounds >= stats.extra["ahead_kept"]


@pytest.mark.parametrize("window", [1, 3, 8])
def test_pipelined_with_a_wrong_draft_throws_rounds_away_and_stays_exact(setup, window):
    folder, expected, noisy = setup
    tokens, stats, served = _generate(folder, noisy, window)
    assert tokens == expected
    assert stats.extra["ahead_kept"] < stats.extra["ahead_asked"]  # some guesses were wrong
    assert served.server.ahead_thrown >= stats.extra["ahead_asked"] - stats.extra["ahead_kept"] - 1
    plain, plain_stats, _ = _generate(folder, noisy, window, pipelined=False)
    assert plain == expected and "pipelined" not in plain_stats.extra


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_pipelined_sampling_draws_what_the_in_process_engine_draws(setup, seed):
    folder, _, noisy = setup
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)
    local, _, _ = _generate(folder, noisy, 4, sampling, local=True)
    remote, _, _ = _generate(folder, noisy, 4, sampling, pipelined=False)
    piped, stats, _ = _generate(folder, noisy, 4, sampling)
    assert local == remote == piped
    assert stats.extra["ahead_asked"] > 0


def test_a_local_draft_pipelines_in_the_waits_and_a_proposer_that_cannot_is_refused(setup):
    """In process a local draft drafts ahead in the verify pass's waits (``IdleProposer``,
    ``tests/test_pipelined_in_process.py``); a proposer with no way to draft ahead is refused."""
    folder, _, noisy = setup
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK, policy="specter")
    try:
        assert isinstance(Engine(target, noisy, 4, pipelined=True).proposer, IdleProposer)
        with pytest.raises(ValueError, match="pipelined: .*LocalProposer cannot"):
            Engine(target, noisy, 4, proposer=LocalProposer(noisy), pipelined=True)
    finally:
        target.close()


def test_a_thrown_away_round_rolls_the_draft_back(setup):
    """Wire level: an optimistic round that the next request does not keep leaves the draft's cache
    and generator as they were, so the next round draws what it would have without pipelining;
    one that is kept lets the draft go on."""
    folder, _, noisy = setup
    piped, plain = Served(noisy), Served(noisy)
    try:
        for served in (piped, plain):  # drive the servers by hand: ``handle`` on this thread
            served.stop.set()
            served.thread.join(timeout=10)
            served.server.handle(StartRequest("r", PROMPT, 1, 0.9, 1.0, 0, 3))
        piped.server.handle(ProposeRequest(0, len(PROMPT), [11], 3, False, 5))
        plain.server.handle(ProposeRequest(0, len(PROMPT), [11], 3))
        got, want = _drain(piped.client_end), _drain(plain.client_end)
        assert [type(m) for m in got] == [PlanDelta] * 3 + [DraftTokens, AheadStart] + [PlanDelta] * 5 + [DraftTokens]
        assert got[3] == want[3] and got[4].round == got[-1].round == 1
        assert piped.server.ahead_rounds == 1 and piped.server._open is not None  # drafted, not judged yet
        again = ProposeRequest(2, len(PROMPT) + 1, [got[3].tokens[0], 12], 2)  # not kept: d0 then 12
        piped.server.handle(again)
        plain.server.handle(again)
        assert piped.server.ahead_thrown == 1 and piped.server.ahead_steps_thrown == 5
        assert _drain(piped.client_end) == _drain(plain.client_end)  # same cache, same generator draws
        piped.server.handle(ProposeRequest(3, len(PROMPT) + 1, [got[3].tokens[0], 12], 2, False, 2))
        assert piped.server._open is not None and piped.server._open.round == 4
        piped.server.handle(AheadKeep(4, 0))  # kept, nothing further ahead
        assert piped.server._open is None and piped.server.ahead_thrown == 1
    finally:
        piped.close()
        plain.close()


def _drain(channel: Channel) -> list[object]:
    out = []
    while (msg := channel.recv(0.2)) is not None:
        out.append(msg)
    return out


def test_a_request_that_ends_with_a_round_drafted_ahead_leaves_the_next_one_exact(setup):
    """An EOS ends a request while the draft may still be drafting ahead: the next request on the
    same socket must not take any of that round's messages for its own (wire round ids)."""
    folder, expected, _ = setup
    same = ResidentDraft(folder)  # every round drafted ahead stands, so one is in flight at the EOS
    eos = expected[9]
    stop_at = expected.index(eos) + 1
    target = OffloadedTarget.load(folder, SlotConfig(fraction=0.5), LINK, policy="specter+fixed")
    served = Served(same)
    try:
        engine = Engine(target, window=3, proposer=served.proposer, pipelined=True)
        first, stats = engine.generate_fresh(PROMPT, NEW, eos_token_id=eos)
        assert first == expected[:stop_at] and stats.extra["ahead_asked"] > 0
        again, _ = engine.generate_fresh(PROMPT, NEW)
        assert again == expected
        assert served.proposer.stale["stale"] == 0  # the leftovers were recognised, not just tolerated
    finally:
        target.close()
        served.close()
