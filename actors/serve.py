"""``specter serve``: the OpenAI-compatible app (``specter/serving/app.py``) as a Ray Serve deployment in
front of one engine replica (the three actors of ``actors/launcher.py``).

The deployment's replica launches the actors in its constructor and builds the FastAPI app around a
``VerifierBackend``: each request is one call to ``VerifierActor.stream`` (Ray's streaming generator:
the tokens of each round as they commit), a client gone is a ``VerifierActor.cancel``. Serve's HTTP
proxy listens where ``--host``/``--port`` say (loopback by default). ``serve`` blocks until Ctrl-C,
SIGTERM or SIGHUP (the terminal closed), then deletes the application (its replica shuts the actors
down) and stops the Ray it started.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from actors.launcher import EngineHandle, cluster_link, launch
from actors.metrics import Recorder
from actors.verifier import MAX_BATCH
from specter.config import LinkConfig, SlotConfig
from specter.models.checkpoint import read_config_dict
from specter.serving.api import Model
from specter.serving.app import DEFAULT_MAX_QUEUE, MAX_BODY, Settings, build_app
from specter.signals import handling, raise_for
from specter.target import load_tokenizer

log = logging.getLogger(__name__)

APP_NAME = "specter"
API_KEY_ENV = "SPECTER_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    """What ``specter serve`` was asked for (sent to the deployment's replica)."""

    model: str
    draft: str | None = None
    policy: str = "demand-lru"
    budget: SlotConfig = SlotConfig(fraction=0.5)
    link: LinkConfig | None = LinkConfig()  # None: the cluster's (``cuda`` on a GPU cluster)
    served_name: str | None = None  # default: the model folder's name
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body: int = MAX_BODY
    chat_template: str | None = None  # a Jinja template replacing (or supplying) the tokenizer's
    timeout_s: float = 60.0
    host_profile: str | None = None
    max_batch: int = MAX_BATCH  # requests decoded together; 1: one at a time
    # K choosers to start from (an earlier server's, kept: ``specter/plan/window_store.py``), by the number
    # of requests drafting together; None or empty: fresh ones
    choosers: dict[int, dict[str, Any]] | None = None

    @property
    def name(self) -> str:
        return self.served_name or Path(self.model).name


class VerifierBackend:
    """The app's ``Backend`` over a launched replica's verifier actor."""

    def __init__(self, handle: EngineHandle):
        self.verifier = handle.verifier

    async def stream(self, request_id: str, prompt_ids: list[int], max_new_tokens: int,
                     **options: Any) -> AsyncIterator[dict[str, Any]]:
        chunks = self.verifier.stream.remote(request_id, prompt_ids, max_new_tokens, **options)
        async for ref in chunks:
            yield await ref

    def cancel(self, request_id: str) -> None:
        self.verifier.cancel.remote(request_id)

    async def alive(self) -> None:
        await self.verifier.progress.remote()


class DisconnectOnCancel:
    """ASGI: a ``receive`` that Serve's proxy cancelled (the client went away) reads as the
    ``http.disconnect`` it stands for. Starlette listens for the disconnect while it streams; unwrapped,
    Ray's ``TaskCancelledError`` escapes that listener and Serve logs it as a task exception nobody
    retrieved, though the request was cancelled cleanly."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def receive_or_disconnect() -> Any:
            try:
                return await receive()
            except ray.exceptions.TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


@serve.ingress()
class SpecterServer:
    """The deployment: one engine replica and the app in front of it."""

    def __init__(self, options: ServeOptions):
        logging.basicConfig(level=logging.INFO)
        self.options = options
        tokenizer = load_tokenizer(Path(options.model))
        if tokenizer is None:
            raise ValueError(f"--model {options.model}: no tokenizer in the folder (tokenizer.json); the server "
                             "takes text")
        if options.chat_template is not None:
            tokenizer.chat_template = options.chat_template
        config = read_config_dict(Path(options.model))
        model = Model(options.name, tokenizer, int(config.get("max_position_embeddings", 2048)),
                      int(config["vocab_size"]))
        self.handle = launch(options.model, options.draft, options.budget, cluster_link(options.link),
                             options.policy, replica=f"serve-{os.getpid()}", timeout_s=options.timeout_s,
                             host_profile=options.host_profile, max_batch=options.max_batch)
        if options.choosers:
            ray.get(self.handle.verifier.keep_choosers.remote(options.choosers))
        concurrency = ray.get(self.handle.verifier.concurrency.remote())
        settings = Settings(model, options.api_key, options.max_queue, options.max_body, _eos(options.model),
                            concurrency)
        self.fastapi = build_app(VerifierBackend(self.handle), settings, Recorder(self.handle.replica, "server"))
        self.asgi = DisconnectOnCancel(self.fastapi)
        log.info("serving %s (%s) with policy %s, %d request(s) decoded at once", options.name, options.model,
                 options.policy, concurrency)

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi

    async def kept(self) -> dict[str, Any]:
        """What ``specter serve`` keeps for the next server of this setup: the K choosers' states
        (``choosers``, by requests drafting together) and the ``requests`` this replica has started."""
        states = await self.handle.verifier.chooser_states.remote()
        progress = await self.handle.verifier.progress.remote()
        return {"choosers": states, "requests": int(progress["requests"])}

    async def tally(self) -> dict[str, int]:
        """What the app has answered since it started (``Counts``: completed, cancelled, rejected,
        errors)."""
        counts = self.fastapi.state.counts
        return {"completed": counts.completed, "cancelled": counts.cancelled, "rejected": counts.rejected,
                "errors": counts.errors}

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            handle.shutdown()


SHUTDOWN_POLL_S = 0.2  # how often a stopping replica looks whether its running requests are done
KEEP_EVERY_S = 60.0  # how often ``run`` hands the replica's K choosers to ``keep`` (and once on the way out)
KEEP_TIMEOUT_S = 30.0  # for the replica's answer (it waits for the running step)
KEEP_STARTING_S = 2.0  # the same, stopped before ``serve.run`` said the application is up: a replica still
# loading the model has nothing to keep (one up answers /health up to a second before ``serve.run`` returns)


def deployment(options: ServeOptions) -> Any:
    """The bound application. Serve's own limits sit above the app's queue: a request it holds is either
    running, waiting in the app's queue, or answered 429 by the app (a stream counts for its whole
    life, so the limit is the queue plus the running requests plus room for /health and /v1/models).
    On the way out (Ctrl-C) the replica still lets running requests finish, up to Serve's graceful
    timeout (20 s), but looks every ``SHUTDOWN_POLL_S`` whether they have (Serve's default: 2 s)."""
    limit = options.max_queue + options.max_batch + 16
    return serve.deployment(  # type: ignore[attr-defined]
        SpecterServer, name="SpecterServer", num_replicas=1, max_ongoing_requests=limit,
        max_queued_requests=limit, ray_actor_options={"num_cpus": 0}, health_check_period_s=10,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    ).bind(options)


def run(options: ServeOptions, host: str, port: int, on_ready: Callable[[str], None] | None = None,
        stop: threading.Event | None = None, keep: Callable[[dict[str, Any]], None] | None = None,
        ) -> dict[str, int] | None:
    """Start Serve's proxy on ``host:port`` and the application (Ray must be initialized), then block
    until ``stop`` is set or SIGINT, SIGTERM or SIGHUP arrives (``specter.signals.handling``: one the
    process ignores stays ignored); delete the application on the way out.

    A signal before ``serve.run`` says the application is up (its replica loads the model: minutes
    for a large one) raises ``KeyboardInterrupt`` (SIGINT) or ``Terminated`` there and then, and what
    was started is deleted; once it is up it sets ``stop``, and the running requests finish first
    (``deployment``).

    ``keep``: given, it is handed the replica's ``SpecterServer.kept`` every ``KEEP_EVERY_S`` and once
    more before the application is deleted (``specter serve`` writes the K choosers to its store); when
    stopped before it was up, only if the replica answers within ``KEEP_STARTING_S``.

    Returns what the replica answered (``SpecterServer.tally``), asked before the application is deleted;
    None where it was never up or did not answer within ``KEEP_TIMEOUT_S``."""
    stop = stop or threading.Event()
    up = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not up.is_set():
            raise_for(signum)
        stop.set()

    try:
        with handling(on_signal):  # back to the previous handlers before the application is deleted
            serve.start(http_options={"host": host, "port": port}, detached=False)
            serve.run(deployment(options), name=APP_NAME, route_prefix="/", blocking=False)
            up.set()
            url = f"http://{host}:{port}"
            if on_ready is not None:
                on_ready(url)
            kept_at = time.monotonic()
            while not stop.wait(0.5):
                if keep is not None and time.monotonic() - kept_at >= KEEP_EVERY_S:
                    _keep(keep)
                    kept_at = time.monotonic()
    finally:
        if keep is not None:
            _keep(keep, KEEP_TIMEOUT_S if up.is_set() else KEEP_STARTING_S, quiet=not up.is_set())
        tally = _tally() if up.is_set() else None
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        except Exception as exc:  # Ray already gone: nothing left to delete
            log.warning("serve shutdown: %s", exc)
    return tally


def _tally() -> dict[str, int] | None:
    try:
        return dict(serve.get_app_handle(APP_NAME).tally.remote().result(timeout_s=KEEP_TIMEOUT_S))
    except Exception as exc:  # the replica gone: nothing to say
        log.debug("no tally from the replica: %s", exc)
        return None


def _keep(keep: Callable[[dict[str, Any]], None], timeout_s: float = KEEP_TIMEOUT_S, quiet: bool = False) -> None:
    """Hand the replica's ``kept`` to ``keep``; a replica that cannot answer costs a warning (a debug
    line where ``quiet``: stopped while starting, it may have nothing to keep)."""
    try:
        kept = serve.get_app_handle(APP_NAME).kept.remote().result(timeout_s=timeout_s)
    except Exception as exc:  # the replica gone or not up: what the last call kept stands
        (log.debug if quiet else log.warning)("K choosers not kept: %s", exc)
        return
    keep(kept)


def _eos(model: str) -> int | None:
    """The end-of-text token from generation_config.json, else config.json."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        eos = read_config_dict(Path(model)).get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


