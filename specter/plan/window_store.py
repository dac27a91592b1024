"""The K chooser kept between runs: what ``specter generate`` (or a server) learnt about K, in a file per setup.

A fresh chooser spends a request's first rounds finding its costs: two plain steps, K = 4 probes,
and a ``v(0)`` anchored by a step whose slots are still the prefill's. A server, a batch job or the
bench keeps one chooser for all its requests, so only their first request pays that; but every
``specter generate`` is a first request. On the as-built clock, 8 prompts of 48 tokens
(``docs/benchmark.md``, "Kept between runs"), a kept chooser's later prompts ran at 0.24–0.27×
``demand-lru``'s TPOT where a fresh one's ran at 0.51–0.55× (a draft that leads), and 1.00–1.07× where
a fresh one's ran at 1.12–1.32× (drafting loses); on a workload whose draft accepts in bursts it ran
~10 % slower than fresh ones (it keeps to plain steps), geomean 0.79× fresh over the eight.

So ``generate`` starts from the chooser its last run with the same setup left, and saves it after;
``specter batch`` does the same for each replica's first request and keeps the chooser of the replica
that served most (``actors/batch.py``: ``BatchOptions.chooser``). ``specter serve`` keeps its batcher's
choosers, one per number of requests drafting together, and the requests served with them
(``load_server``/``save_server``; read from the replica every minute and on the way out,
``actors/serve.py``): past its first requests a server plays what they learnt, so a restart goes on
from there (``docs/serving.md``, "A server's steady state").
The setup is everything that moves what a round costs or how often the draft is right: the model
and draft (their folders and ``config.json``), policy, window cap, budget, link, device, dtype,
clock and profile, threads, in process or through which processes, pipelining, greedy or sampled,
and this package's version (``specter/cli/commands.py``: ``_KeptChooser``). Greedy output does not
depend on it (every K is lossless); speed does. A sampled run's text is an exact sample whatever the K,
but which sample depends on the Ks played, as it already did on the wall clock through its timings:
``--chooser-cache none`` on a virtual clock repeats a seed's text run after run.
A file that cannot be read is named in one warning and the run starts fresh; one that cannot be
written is named and the run's output stands.

Where: ``--chooser-cache DIR`` (``none``: never read nor written), else ``$SPECTER_CHOOSER_CACHE``,
else ``$XDG_CACHE_HOME/specter/choosers``, else ``~/.cache/specter/choosers``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from specter.plan.window import WindowChooser

ENV = "SPECTER_CHOOSER_CACHE"
OFF = "none"


def default_dir() -> str:
    """Where choosers are kept unless ``--chooser-cache`` says (``OFF``: nowhere)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specter", "choosers")


def path_for(directory: str | Path, setup: dict[str, Any]) -> Path:
    """The file of the chooser kept for ``setup`` (JSON-able values) in ``directory``."""
    digest = hashlib.sha256(json.dumps(setup, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return Path(directory) / f"{digest}.json"


def load(path: Path, setup: dict[str, Any]) -> dict[str, Any] | None:
    """The state of the chooser kept in ``path`` for ``setup`` (``WindowChooser.state``'s, read back
    field by field); None when there is none yet.

    Raises:
        ValueError: the file is there but is not a chooser kept for this setup (says why)."""
    data = _read(path, setup)
    return None if data is None else _checked(path, data.get("chooser"))


def load_server(path: Path, setup: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], int] | None:
    """A server's choosers kept in ``path`` for ``setup`` — their states by the number of requests that
    drafted together (``Batcher.choosers``; an engine that decodes one request at a time keeps its one
    as 1) — and the requests the servers before served; None when there are none yet.

    Raises:
        ValueError: the file is there but holds no server's choosers for this setup (says why)."""
    data = _read(path, setup)
    if data is None:
        return None
    states, requests = data.get("choosers"), data.get("requests")
    if not isinstance(states, dict) or not isinstance(requests, int) or isinstance(requests, bool):
        raise ValueError(f"{path} holds no server's choosers (expected 'choosers' and 'requests')")
    kept = {}
    for key, state in states.items():
        if not key.isdigit() or int(key) < 1:
            raise ValueError(f"{path}: choosers: expected keys 1, 2, … (requests drafting together), got {key!r}")
        kept[int(key)] = _checked(path, state)
    return kept, requests


def save(path: Path, setup: dict[str, Any], state: dict[str, Any]) -> None:
    """Keep a chooser's ``state`` (``WindowChooser.state``'s) for ``setup`` in ``path``, whole or not at
    all (a temporary file renamed over it).

    Raises:
        OSError: the folder or the file cannot be written."""
    _write(path, {"setup": setup, "chooser": state})


def save_server(path: Path, setup: dict[str, Any], states: dict[int, dict[str, Any]], requests: int) -> None:
    """Keep a server's chooser ``states`` (by requests drafting together) and the ``requests`` served with
    them so far for ``setup`` in ``path``, as ``save`` does.

    Raises:
        OSError: the folder or the file cannot be written."""
    _write(path, {"setup": setup, "choosers": {str(n): states[n] for n in sorted(states)}, "requests": requests})


def _read(path: Path, setup: dict[str, Any]) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or json.loads(json.dumps(setup, default=str)) != data.get("setup"):
        raise ValueError(f"{path} holds no chooser for this setup")
    return data


def _checked(path: Path, state: Any) -> dict[str, Any]:
    try:
        WindowChooser.from_state(state)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return state  # type: ignore[no-any-return]


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1, default=str)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
