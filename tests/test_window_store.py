"""The K chooser kept between runs (``specter/plan/window_store.py``, ``WindowChooser.state``):
a chooser read back from its state chooses what the one kept in memory chooses, a file for another
setup or a damaged one is refused by name, and ``specter generate`` starts its next run from it."""

from __future__ import annotations

import json
import random

import pytest

from specter.assets import DEFAULT_DRAFT
from specter.cli import main
from specter.plan import make_policy, window_store
from specter.plan.window import WindowChooser


def _request(chooser: WindowChooser, rng: random.Random, rounds: int = 40) -> list[int]:
    """One request's rounds at known costs (plain 1.0; drafting 0.2/forward + 1.5 + 0.1·K; α 0.8)."""
    chooser.begin_request()
    played = []
    for _ in range(rounds):
        k = chooser.choose(16)
        accepted = 0
        while accepted < k and rng.random() < 0.8:
            accepted += 1
        chooser.record(k, 0.2 * k, 1.5 + 0.1 * k if k else 1.0 + rng.random() * 0.1, accepted)
        played.append(k)
    return played


def test_a_chooser_read_back_from_its_state_chooses_as_the_kept_one():
    """Three requests: after the first, one chooser is kept in memory and one is written to JSON and
    read back before each request; both play the same K every round (the state is all it learnt)."""
    kept = WindowChooser(route_last=True)
    _request(kept, random.Random(1))
    saved = json.loads(json.dumps(kept.state()))
    for seed in (2, 3):
        restored = WindowChooser.from_state(saved)
        assert _request(restored, random.Random(seed)) == _request(kept, random.Random(seed))
        saved = json.loads(json.dumps(restored.state()))
    assert restored.requests == kept.requests == 3 and restored.samples == kept.samples
    fresh = WindowChooser(route_last=True)
    assert _request(fresh, random.Random(2))[:3] == [0, 0, 4]  # a fresh one opens with plain steps, then K 4
    assert _request(WindowChooser.from_state(kept.state()), random.Random(2))[0] != 0  # a kept one drafts at once


@pytest.mark.parametrize(("change", "named"), [
    ({"version": 99}, "version"),
    ({"samples": {"4": 1.5}}, "samples"),
    ({"verify_s": {"x": 1.0}}, "verify_s"),
    ({"route_last": 1}, "route_last"),
    ({"tried": "many"}, "tried"),
    ({"moments": [1.0, 2.0]}, "moments"),
    ({"level": True}, "level"),
    ({"magic": 1}, "magic"),
])
def test_a_damaged_state_is_refused_naming_the_field(change, named):
    state = WindowChooser().state() | change
    with pytest.raises(ValueError, match=named):
        WindowChooser.from_state(state)
    with pytest.raises(ValueError, match="mapping"):
        WindowChooser.from_state([])  # type: ignore[arg-type]


def test_a_policy_takes_only_a_state_of_its_own_kind():
    specter, paper = make_policy("specter"), make_policy("specter+last")
    assert specter.new_window_chooser().route_last != paper.new_window_chooser().route_last
    assert not specter.window_chooser_from(specter.new_window_chooser().state()).route_last
    with pytest.raises(ValueError, match="route_last"):
        specter.window_chooser_from(paper.new_window_chooser().state())


def test_the_store_keeps_one_file_per_setup_and_refuses_another_setups(tmp_path):
    setup, other = {"policy": "specter", "budget": 0.25}, {"policy": "specter", "budget": 0.5}
    path = window_store.path_for(tmp_path, setup)
    assert path == window_store.path_for(tmp_path, dict(reversed(setup.items())))  # order does not matter
    assert path != window_store.path_for(tmp_path, other)
    assert window_store.load(path, setup) is None  # nothing kept yet
    chooser = WindowChooser()
    _request(chooser, random.Random(0))
    window_store.save(path, setup, chooser.state())
    assert WindowChooser.from_state(window_store.load(path, setup)).state() == WindowChooser.from_state(chooser.state()).state()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    with pytest.raises(ValueError, match="no chooser for this setup"):
        window_store.load(path, other)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path.name} is not JSON"):
        window_store.load(path, setup)


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(window_store.ENV, str(tmp_path / "mine"))
    assert window_store.default_dir() == str(tmp_path / "mine")
    monkeypatch.delenv(window_store.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert window_store.default_dir() == str(tmp_path / "xdg" / "specter" / "choosers")


def _generate(capsys, argv: list[str]) -> tuple[dict, str]:
    assert main(["generate", "--prompt-ids", "5,99,17,42,8", "--max-new-tokens", "24", "--clock", "as-built",
                 "--json"] + argv) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_generate_starts_from_the_chooser_its_last_run_kept(capsys, tmp_path):
    """The embedded model on the as-built clock (its times do not move with the machine's load): the
    second run starts from the first one's chooser (it says so, and drafts in its first round: a fresh
    one opens with two plain steps), the tokens stay those of a fresh run, and a run with
    ``--chooser-cache none`` neither reads nor writes one."""
    cache = tmp_path / "choosers"
    argv = ["--policy", "specter", "--chooser-cache", str(cache)]
    first, _ = _generate(capsys, argv)
    assert first["chooser_kept_from"] == 0 and len(list(cache.iterdir())) == 1
    second, _ = _generate(capsys, argv)
    assert second["chooser_kept_from"] == 1
    fresh, _ = _generate(capsys, ["--policy", "specter", "--chooser-cache", "none"])
    assert fresh["chooser_kept_from"] == 0
    assert first["tokens"] == second["tokens"] == fresh["tokens"]  # lossless, whatever K
    assert fresh["stats"]["tpot_s"] == first["stats"]["tpot_s"] != second["stats"]["tpot_s"]  # the clock is exact
    kept = json.loads(next(cache.iterdir()).read_text())
    assert kept["chooser"]["requests"] == 2 and kept["setup"]["policy"] == "specter"
    _generate(capsys, ["--policy", "specter", "--chooser-cache", str(cache), "--budget", "0.3"])
    assert len(list(cache.iterdir())) == 2  # another setup, another file
    plain, _ = _generate(capsys, ["--policy", "demand-lru", "--chooser-cache", str(cache)])
    assert len(list(cache.iterdir())) == 2 and "chooser_kept_from" not in plain  # no chooser: nothing kept
    assert main(["generate", "--policy", "specter", "--prompt-ids", "5,99", "--max-new-tokens", "4",
                 "--clock", "as-built", "--chooser-cache", str(cache)]) == 0
    assert "K chooser kept from 2 earlier run(s)" in capsys.readouterr().err  # said on the summary line


def test_a_damaged_or_unwritable_cache_costs_a_warning_not_the_run(capsys, tmp_path):
    cache = tmp_path / "choosers"
    argv = ["--policy", "specter", "--chooser-cache", str(cache)]
    first, _ = _generate(capsys, argv)
    kept = next(cache.iterdir())
    kept.write_text('{"setup": 1')
    again, err = _generate(capsys, argv)
    assert f"starting a fresh K chooser: {kept} is not JSON" in err
    assert again["tokens"] == first["tokens"] and again["stats"]["tpot_s"] == first["stats"]["tpot_s"]
    assert json.loads(kept.read_text())["chooser"]["requests"] == 1  # written afresh
    data = json.loads(kept.read_text())
    data["chooser"]["route_last"] = True  # valid, but not what `specter` keeps: hand-edited
    kept.write_text(json.dumps(data))
    again, err = _generate(capsys, argv)
    assert "starting a fresh K chooser: K chooser state: kept for a policy with route_last=True" in err
    assert again["chooser_kept_from"] == 0 and again["tokens"] == first["tokens"]
    blocked = tmp_path / "a-file"  # a folder that cannot be made, even by root
    blocked.write_text("")
    again, err = _generate(capsys, ["--policy", "specter", "--chooser-cache", str(blocked / "choosers")])
    assert "could not keep the K chooser in" in err and again["tokens"] == first["tokens"]


def test_a_servers_choosers_are_kept_by_drafting_count_and_a_bad_record_is_named(tmp_path):
    """``specter serve``'s record: a chooser state per number of requests drafting together, and the
    requests served with them; read back field by field, and refused by name where it is not one."""
    setup = {"policy": "specter", "server": True}
    path = window_store.path_for(tmp_path, setup)
    assert window_store.load_server(path, setup) is None
    states = {}
    for n, seed in ((1, 0), (3, 1)):
        chooser = WindowChooser()
        _request(chooser, random.Random(seed))
        states[n] = chooser.state()
    window_store.save_server(path, setup, states, 12)
    kept, requests = window_store.load_server(path, setup)
    assert requests == 12 and sorted(kept) == [1, 3]
    assert all(WindowChooser.from_state(kept[n]).state() == WindowChooser.from_state(states[n]).state() for n in kept)
    window_store.save(path, setup, states[1])  # a generate run's record where a server's is looked for
    with pytest.raises(ValueError, match="no server's choosers"):
        window_store.load_server(path, setup)
    record = json.loads(json.dumps({"setup": setup, "choosers": {"0": states[1]}, "requests": 1}))
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="expected keys 1, 2"):
        window_store.load_server(path, setup)
    record["choosers"] = {"2": states[1] | {"tried": "many"}}
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="tried"):
        window_store.load_server(path, setup)


def test_serve_names_a_damaged_record_and_starts_fresh(tmp_path, capsys):
    """The command line's side of a server's kept choosers (no server started): the setup leaves out
    what moves no round's cost (port, key, queue), a damaged file costs one warning naming it."""
    from specter.cli.args import build_parser
    from specter.cli.commands import _KeptChoosers

    def kept(*flags: str) -> _KeptChoosers:
        args = build_parser().parse_args(["serve", "--policy", "specter", "--chooser-cache", str(tmp_path), *flags])
        args.draft = str(DEFAULT_DRAFT)
        return _KeptChoosers(args, 32)

    first = kept()
    assert first.states == {} and first.requests == 0 and first.path is not None
    assert kept("--port", "9001", "--api-key", "k" * 20, "--max-queue", "3").path == first.path
    assert kept("--max-batch", "4").path != first.path and kept("--budget", "0.3").path != first.path
    first.save({"choosers": {1: WindowChooser(cache_arm=False).state()}, "requests": 5})
    again = kept()
    assert again.requests == 5 and list(again.states) == [1]
    again.save({"choosers": again.states, "requests": 2})  # the requests add up over servers
    assert kept().requests == 7
    first.path.write_text("{broken")
    assert kept().states == {}
    assert f"starting fresh K choosers: {first.path} is not JSON" in capsys.readouterr().err
