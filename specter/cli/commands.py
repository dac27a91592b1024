"""What each command does once its flags are parsed: ``generate`` (in process, through the
processes or through the actors), ``batch`` and ``serve`` (``bench``: ``specter/cli/bench.py``).

transformers, ray, the engine, the target, the benchmark and the actors are imported inside the
commands that use them (each 0.5-7 s to import here): `specter --help` costs torch's import only.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specter.assets import DEFAULT_DRAFT, DEFAULT_MODEL
from specter.cli.args import DTYPES
from specter.config import LinkConfig, SamplingConfig, SlotConfig, compute_threads, env_defaults
from specter.draft.loading import check_draft_matches, load_draft
from specter.eval.jobs import Progress, ResultsFile, append_error, errors_path, read_batch
from specter.models.checkpoint import CheckpointError, read_config_dict, resolve_model_dir
from specter.plan import drafts, make_policy, policy_class
from specter.remote.roles.base import LOG_LEVEL_ENV
from specter.serving.text import Stops, TextStream, check_stops, until_stop
from specter.signals import exit_status, stopped_word
from specter.timing.costs import Timing, resolve_timing


def _timing(args: argparse.Namespace, parser: argparse.ArgumentParser, cuda: bool = False):  # type: ignore[no-untyped-def]
    """The run's clock, link and host from --clock/--profile/--link/--rho (``specter.timing.costs.Timing``)."""
    profile, clock, rho = getattr(args, "profile", None), getattr(args, "clock", "wall"), getattr(args, "rho", None)
    link = args.link
    if isinstance(link, str):  # --link PROFILE: that profile's link (and host), as before --profile
        if profile is not None and profile != link:
            parser.error(f"argument --link: names profile {link!r} but --profile is {profile!r}")
        profile, link = link, None
    through_actors = getattr(args, "address", None) is not None or getattr(args, "processes", False)
    if through_actors and clock != "wall":
        parser.error(f"argument --clock: the actors run on the wall clock; {clock!r} is in process only")
    if through_actors and rho is not None:
        parser.error("argument --rho: not available through the actors yet; use --link sim:GBPS")
    if link is not None and rho is not None:
        parser.error("argument --rho: sets the link's bandwidth; give --rho or a sim: --link, not both")
    if rho is not None and profile is None and clock not in ("virtual", "as-built"):
        parser.error("argument --rho: needs --profile NAME (what a decode step costs)")
    through_ray = getattr(args, "address", None) is not None  # the cluster's GPUs count, checked as it launches
    if isinstance(link, LinkConfig) and link.kind == "cuda" and not cuda and not through_ray:
        parser.error("argument --link: cuda needs a CUDA device (torch sees none, or --device cpu)")
    if cuda and clock == "wall" and profile is None and link is None and not through_ray:
        return Timing("wall", LinkConfig(kind="cuda"))
    timing = resolve_timing(args.model, clock, profile, link, rho)
    if timing.profile is not None or clock != "wall":  # a plain wall-clock run says nothing extra
        print(timing.describe(), file=sys.stderr)
    return timing


def _dtype(args: argparse.Namespace) -> torch.dtype | None:
    """``--dtype``'s torch dtype (None: the default for where the run computes)."""
    return getattr(torch, DTYPES[args.dtype]) if args.dtype else None


def _on_cuda(args: argparse.Namespace) -> bool:
    """Whether the run computes on this machine's GPU: ``--device`` names one, or is not given and torch
    sees one (``batch``, which has no ``--device``: whether this machine has one)."""
    device = getattr(args, "device", None)
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def default_draft(args: argparse.Namespace) -> None:
    """The embedded model's shipped AWQ draft where a run that drafts (a drafting policy, or ``--window`` > 0)
    names no ``--draft``; another model still needs one named."""
    if args.draft is not None or Path(args.model).resolve() != DEFAULT_MODEL:
        return
    if drafts(args.policy) or (getattr(args, "window", None) or 0) > 0:
        args.draft = str(DEFAULT_DRAFT)


def _window(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    needs_draft = drafts(args.policy)
    default = policy_class(args.policy).default_window
    window = args.window if args.window is not None else (default if args.draft else 0)
    if needs_draft and args.draft is None:
        parser.error(f"argument --draft: policy {args.policy!r} needs a draft model (--draft DIR)")
    if not 0 <= window <= 64:
        parser.error(f"argument --window: K must be in 0..64, got {window}")
    if window > 0 and args.draft is None:
        parser.error("argument --window: K > 0 needs a draft model (--draft DIR)")
    if needs_draft and window == 0:
        parser.error(f"argument --window: policy {args.policy!r} drafts, so K must be >= 1")
    return window


def sampling_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingConfig:
    try:
        return SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=getattr(args, "top_k", 0),
                              seed=getattr(args, "seed", 0))
    except ValueError as exc:
        field, reason = str(exc).split(": ", 1)
        parser.error(f"argument --{field.replace('_', '-')}: {reason}")


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specter.target import load_tokenizer

    sampling = sampling_config(args, parser)
    default_draft(args)
    window = _window(args, parser)
    if args.prompt_file is not None:
        args.prompt = _read_prompt(args.prompt_file, parser)
    if args.prompt is not None and not args.prompt.strip():
        parser.error(f"argument --prompt{'-file' if args.prompt_file is not None else ''}: must not be empty")
    if args.processes and args.address is not None:
        parser.error("argument --processes: runs without Ray; give it or --address, not both")
    if (args.address is not None or args.processes) and args.device_memory is not None:
        parser.error("argument --device-memory: not available with --address or --processes yet; use --budget")
    if args.address is None and not args.processes:
        torch.set_num_threads(compute_threads(args.threads))
    cuda = _on_cuda(args)
    timing = _timing(args, parser, cuda)
    if args.draft is not None:
        check_draft_matches(read_config_dict(resolve_model_dir(args.draft)),
                            read_config_dict(resolve_model_dir(args.model)))
    try:
        stops = check_stops(args.stop)
    except ValueError as exc:
        parser.error(f"argument --{exc}")
    # the tokenizer once, for the early check of a text prompt and for printing the text as it comes
    needed = args.prompt is not None or not args.json or stops
    tokenizer = load_tokenizer(resolve_model_dir(args.model)) if needed else None
    if stops and tokenizer is None:
        parser.error("argument --stop: this model has no tokenizer, so its text cannot be matched")
    _check_prompt(args, parser, window, tokenizer)
    budget = None
    if args.budget is not None or (args.device_memory is None and not cuda):
        budget = SlotConfig(fraction=args.budget.fraction if args.budget else 0.5, per_layer=args.per_layer)
    run = _through_processes if args.processes else _through_actors if args.address is not None else _in_process
    kept = _KeptChooser(args, window, sampling) if window else None
    printed = None if args.json or tokenizer is None else _Printed(args.prompt or "", tokenizer, stops)
    # the roles log their setup at INFO only with -v, as this process does: Ray relays an actor's lines
    # late, and they landed inside the text as it streamed
    quiet = env_defaults({} if args.verbose else {LOG_LEVEL_ENV: "WARNING"})
    try:
        with quiet:
            tokens, text, stats, state = run(args, parser, timing, budget, window, sampling,
                                             kept.state if kept else None, printed, stops)
    finally:
        if printed is not None:
            printed.end()
    if kept is not None:
        kept.save(state)
    if args.json:
        kept_from = {} if kept is None else {"chooser_kept_from": int(kept.state.get("requests", 0))}
        print(json.dumps({"tokens": tokens, "text": text, "stats": stats} | kept_from))
        return 0
    if printed is None or not printed.started:  # no tokenizer: the token ids
        print((args.prompt or "") + text if text or args.prompt else " ".join(map(str, tokens)))
    spec = f", accepted {stats['mean_accepted']:.2f}/{window}, recall {stats['recall']:.2f}" if window else ""
    if stats.get("pipelined"):
        spec += f", pipelined: {stats['ahead_kept']}/{stats['ahead_asked']} rounds drafted ahead stood"
    if kept is not None and kept.state:
        spec += f", K chooser kept from {kept.state['requests']} earlier run(s)"
    if stats.get("stop"):
        spec += f", ended at a stop string ({len(tokens)} tokens up to it)"
    where = f" via actors at {args.address}" if args.address else " via processes" if args.processes else ""
    print(
        f"[{args.policy}{where}: {stats['new_tokens']} tokens, TPOT {stats['tpot_s'] * 1e3:.2f} ms "
        f"({stats.get('clock', 'wall')} clock), hit rate "
        f"{stats['hit_rate']:.2f} ({stats['hits']} hits, {stats['inflight']} in flight, {stats['misses']} misses), "
        f"{stats['bytes_moved'] / 1e6:.1f} MB moved, link busy {stats['link_busy_fraction']:.0%}{spec}]",
        file=sys.stderr,
    )
    return 0


_SETUP_IGNORED = (  # flags that move no round's cost nor how often the draft is right
    "command", "verbose", "prompt", "prompt_ids", "prompt_file", "max_new_tokens", "temperature", "top_p", "top_k",
    "seed", "json", "connect_timeout", "chooser_cache", "stop",
    "input", "out", "on_bad_line", "request_timeout", "retries", "timeout", "num_cpus",  # batch's
    "host", "port", "served_model_name", "api_key", "max_queue", "max_body", "chat_template",  # serve's
)


def _chooser_file(args: argparse.Namespace, window: int, **setup: Any) -> tuple[Path | None, dict[str, Any]]:
    """Where the K chooser of this run's setup is kept, and the setup (``specter/plan/window_store.py``):
    the flags but ``_SETUP_IGNORED``, the model's and draft's folders and configs, the window cap, the
    device, threads and versions, and ``setup``; ``(None, {})`` with ``--chooser-cache none``."""
    from specter import __version__
    from specter.plan import window_store

    directory = args.chooser_cache or window_store.default_dir()
    if directory == window_store.OFF:
        return None, {}
    model, draft = resolve_model_dir(args.model), resolve_model_dir(args.draft)
    cuda = _on_cuda(args)
    setup = {k: v for k, v in sorted(vars(args).items()) if k not in _SETUP_IGNORED} | setup
    setup.update(
        model=str(model.resolve()), model_config=read_config_dict(model), draft=str(draft.resolve()),
        draft_config=read_config_dict(draft), window=window,
        device_name=torch.cuda.get_device_name(getattr(args, "device", None)) if cuda else "cpu",
        threads=compute_threads(getattr(args, "threads", None)), version=__version__, torch=torch.__version__,
    )
    setup = json.loads(json.dumps(setup, default=str))
    return window_store.path_for(directory, setup), setup


class _KeptChooser:
    """The K chooser ``generate`` and ``batch`` keep between runs of one setup
    (``specter/plan/window_store.py``): ``state`` to start from (``{}``: none kept, or ``--chooser-cache
    none``), ``save`` after the run."""

    def __init__(self, args: argparse.Namespace, window: int, sampling: SamplingConfig):
        from specter.plan import window_store

        self.state: dict[str, Any] = {}
        self.path, self.setup = _chooser_file(args, window, sampled=not sampling.greedy)
        if self.path is None:
            return
        try:
            state = window_store.load(self.path, self.setup)
            if state is not None:  # one of this policy's kind, or a warning now rather than an error later
                make_policy(args.policy).window_chooser_from(state)
        except ValueError as exc:
            print(f"specter: starting a fresh K chooser: {exc}", file=sys.stderr)
            return
        self.state = state or {}

    def save(self, state: dict[str, Any] | None) -> None:
        from specter.plan import window_store

        if self.path is None or not state:
            return
        try:
            window_store.save(self.path, self.setup, state)
        except OSError as exc:
            print(f"specter: could not keep the K chooser in {self.path}: {exc.strerror}", file=sys.stderr)


class _KeptChoosers:
    """The K choosers ``serve`` keeps between servers of one setup (its requests sampled or not, each as
    it asks): ``states`` to start from, by requests drafting together (``{}``: none kept), ``requests``
    the servers before served with them; ``save`` takes the replica's ``SpecterServer.kept``
    (``actors/serve.py``), every minute and on the way out."""

    def __init__(self, args: argparse.Namespace, window: int):
        from specter.plan import window_store

        self.states: dict[int, dict[str, Any]] = {}
        self.requests = 0
        self.path, self.setup = _chooser_file(args, window, sampled="per request", server=True)
        if self.path is None:
            return
        try:
            kept = window_store.load_server(self.path, self.setup)
            policy = make_policy(args.policy)
            for state in (kept or ({}, 0))[0].values():  # of this policy's kind, or a warning now
                policy.window_chooser_from(state)
        except ValueError as exc:
            print(f"specter: starting fresh K choosers: {exc}", file=sys.stderr)
            return
        self.states, self.requests = kept or ({}, 0)

    def save(self, kept: dict[str, Any]) -> None:
        from specter.plan import window_store

        if self.path is None or not kept["choosers"]:
            return
        try:
            window_store.save_server(self.path, self.setup, kept["choosers"], self.requests + kept["requests"])
        except OSError as exc:
            print(f"specter: could not keep the K choosers in {self.path}: {exc.strerror}", file=sys.stderr)


def _prompt_ids(args: argparse.Namespace, parser: argparse.ArgumentParser, tokenizer, vocab: int) -> list[int]:  # type: ignore[no-untyped-def]
    if args.prompt is not None:
        if tokenizer is None:
            raise CheckpointError(f"{args.model} has no tokenizer; pass --prompt-ids instead of a text prompt")
        return list(tokenizer.encode(args.prompt))
    if max(args.prompt_ids) >= vocab:
        parser.error(f"argument --prompt-ids: token id {max(args.prompt_ids)} is outside the vocabulary (size {vocab})")
    return list(args.prompt_ids)


def _check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once and let go, as Serve's proxy will, before Ray starts: a port in use or
    an address not of this machine is said in one line here, not in Ray's traceback from inside its
    proxy 14 s later (port 0: the system picks one, nothing to check).

    Raises:
        ValueError: naming ``--port`` or ``--host`` and what to do.
    """
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host: {host!r} does not resolve ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"--port: {host}:{port} is in use by another program; stop it or pick another "
                                 "--port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host: {host} is not an address of this machine") from None
            raise ValueError(f"--port: cannot listen on {host}:{port} ({exc.strerror})") from None


class _Printed:
    """``specter generate``'s text on stdout as the tokens commit (``on_tokens``): the prompt, then
    each piece of text as it becomes final (``TextStream``), up to a stop string, then a newline; in
    all, what printing the whole text at the end printed. Only where the model has a tokenizer."""

    def __init__(self, prompt: str, tokenizer: Any, stops: tuple[str, ...] = ()):
        self.prompt = prompt
        self.text = TextStream(tokenizer, stops, skip_special_tokens=False)
        self.started = False  # something was written
        self.ended = False

    def __call__(self, tokens: list[int]) -> None:
        self._write(self.text.add(list(tokens)))

    def end(self) -> None:
        """What was held back, then the newline — also when the request stopped early (Ctrl-C, an
        error), so that what stderr says next starts a line of its own."""
        if self.ended:
            return
        self.ended = True
        self._write(self.text.finish())
        if self.started:
            self._write("\n")

    def _write(self, piece: str) -> None:
        if not piece:
            return
        if not self.started:
            self.started = True
            piece = self.prompt + piece
        try:
            sys.stdout.write(piece)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left (``| head -1``): the rest goes nowhere, as it did when it came at the end
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)


def _read_prompt(path: str, parser: argparse.ArgumentParser) -> str:
    """``--prompt-file``'s text, exactly as the file (or standard input, ``-``) holds it."""
    where = "standard input" if path == "-" else path
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        parser.error(f"argument --prompt-file: {where} is not UTF-8 text ({exc.reason} at byte {exc.start})")
    except OSError as exc:
        parser.error(f"argument --prompt-file: cannot read {where}: {exc.strerror}")


def _check_prompt(args: argparse.Namespace, parser: argparse.ArgumentParser, window: int, tokenizer: Any) -> None:
    """The request against the model's config before anything loads (a large model loads for minutes,
    and a replica launches as long): the engine's own check (``check_request``), made early
    (``tokenizer``: the model's, for a text prompt)."""
    from specter.request import check_prompt

    config = read_config_dict(resolve_model_dir(args.model))
    vocab = int(config["vocab_size"])
    check_prompt(_prompt_ids(args, parser, tokenizer, vocab), args.max_new_tokens, window, vocab,
                 config.get("max_position_embeddings"))


def _eos(model: str) -> int | None:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        return None
    return eos[0] if isinstance(eos, list) else eos


def _in_process(args, parser, timing, budget, window, sampling, kept, printed, stops):  # type: ignore[no-untyped-def]
    """The engine in this process (tests, profiling)."""
    from specter.engine import Engine
    from specter.eval.bench import FIXED_DRAFT_MODE
    from specter.target import MemoryRequest, OffloadedTarget

    mode = "auto" if timing.clock == "wall" else FIXED_DRAFT_MODE  # timed choices would vary the tokens
    draft = load_draft(args.draft, device=args.device, mode=mode) if args.draft is not None else None
    memory = MemoryRequest(args.device_memory, getattr(draft, "device_bytes", 0), window=window)
    target = OffloadedTarget.load(args.model, budget, timing.link, args.policy, device=args.device,
                                  dtype=_dtype(args), memory=memory, clock=timing.make_clock())
    if target.memory_plan is not None:
        print(target.memory_plan.describe(), file=sys.stderr)
    if timing.host is not None:  # the profile's host (docs/profiles.md)
        target.offload.set_host(timing.host)
    try:
        tokenizer = target.tokenizer
        prompt_ids = _prompt_ids(args, parser, tokenizer, target.model.config.vocab_size)
        engine = Engine(target, draft, window, pipelined=args.pipeline)  # None: the policy's default
        chooser = engine.policy.window_chooser() if engine.proposer is not None else None
        if chooser is not None and kept:
            chooser = engine.policy.window_chooser_from(kept)
            engine.policy.use_window_chooser(chooser)
        watch = Stops(tokenizer, stops, printed) if stops else None
        tokens, stats = engine.generate_fresh(prompt_ids, args.max_new_tokens, sampling, eos_token_id=_eos(args.model),
                                              on_tokens=printed if watch is None else watch.on_tokens,
                                              cancelled=None if watch is None else watch.cancelled)
        if printed is not None:  # the text's end now, not once the target is closed
            printed.end()
    finally:
        target.close()
    figures = stats.to_dict() if watch is None else watch.mark(stats.to_dict())
    tokens, text = _cut(tokenizer, tokens, stops)
    return tokens, text, figures, chooser.state() if chooser is not None else None


def _cut(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> tuple[list[int], str]:
    """The tokens up to a stop string and their text (before it); no tokenizer: no text."""
    if tokenizer is None:
        return tokens, ""
    return until_stop(lambda ids: str(tokenizer.decode(ids)), tokens, stops)


def _through_actors(args, parser, timing, budget, window, sampling, kept, printed, stops):  # type: ignore[no-untyped-def]
    """The three Ray actors (a local Ray, or a running cluster; with neither --link nor a profile, the
    cluster's link: ``cuda`` where it has a GPU)."""
    from actors.client import Client

    link = None if args.link is None and timing.profile is None else timing.link
    vocab = int(read_config_dict(resolve_model_dir(args.model))["vocab_size"])
    address = None if args.address == "none" else args.address
    dtype = _dtype(args)
    with Client(args.model, args.draft, budget, link, args.policy, address=address,
                connect_timeout_s=args.connect_timeout, host_profile=timing.profile, dtype=dtype) as client:
        prompt_ids = _prompt_ids(args, parser, client.tokenizer, vocab)
        out = client.generate([prompt_ids], args.max_new_tokens, temperature=sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed, policy=args.policy,
                              window=window, eos_token_id=_eos(args.model), pipelined=args.pipeline,
                              chooser=kept, on_tokens=None if printed is None else lambda _, tokens: printed(tokens),
                              stop=list(stops) or None)[0]
        if printed is not None:  # the text's end now, not once the replica and Ray are stopped
            printed.end()
    return out["tokens"], out["text"], out["stats"], out.get("chooser")


def _through_processes(args, parser, timing, budget, window, sampling, kept, printed, stops):  # type: ignore[no-untyped-def]
    """The three roles as plain processes (``specter/remote/processes.py``), no Ray."""
    from specter.remote.processes import launch_processes
    from specter.target import load_tokenizer

    config = read_config_dict(resolve_model_dir(args.model))
    dtype = _dtype(args)
    roles = "transfer, verifier and draft processes" if args.draft is not None else "transfer and verifier processes"
    print(f"specter: starting the {roles} (no Ray; the first start imports torch and transformers once)",
          file=sys.stderr, flush=True)
    with launch_processes(args.model, args.draft, budget or SlotConfig(fraction=0.5), timing.link, args.policy,
                          host_profile=timing.profile, dtype=dtype) as engine:
        tokenizer = load_tokenizer(resolve_model_dir(args.model))
        prompt_ids = _prompt_ids(args, parser, tokenizer, int(config["vocab_size"]))
        options = {} if args.pipeline is None else {"pipelined": args.pipeline}
        if kept is not None:
            options["chooser"] = kept
        if stops:
            options["stop"] = list(stops)
        out = engine.generate(prompt_ids, args.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k, seed=sampling.seed, policy=args.policy, window=window,
                              eos_token_id=_eos(args.model), on_tokens=printed, **options)
        if printed is not None:  # the text's end now, not once the processes are stopped
            printed.end()
    tokens, text = _cut(tokenizer, out["tokens"], stops)
    return tokens, text, out["stats"], out.get("chooser")


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``specter serve``: check the flags and the folders, attach to or start Ray, serve until Ctrl-C."""
    import ray

    from actors.cluster import check_local_gpu, init_ray
    from actors.launcher import require_gpu
    from actors.serve import API_KEY_ENV, ServeOptions, is_loopback, run

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and api_key is None:
        parser.error(f"argument --host: {args.host} is reachable from other machines; give --api-key KEY "
                     f"(or set {API_KEY_ENV}) so that only clients with the key are answered")
    _check_port(args.host, args.port)
    model = resolve_model_dir(args.model)
    config = read_config_dict(model)
    default_draft(args)
    if args.draft is not None:
        check_draft_matches(read_config_dict(resolve_model_dir(args.draft)), config)
    if drafts(args.policy) and args.draft is None:
        parser.error(f"argument --draft: policy {args.policy!r} needs a draft model (--draft DIR)")
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as exc:
            parser.error(f"argument --chat-template: cannot read {args.chat_template}: {exc.strerror}")
    link = args.link if isinstance(args.link, LinkConfig) else None  # None: the cluster's (cuda on a GPU)
    profile = args.link if isinstance(args.link, str) else None
    if profile is not None:
        link = resolve_timing(str(model), "wall", profile, None, None).link
    options = ServeOptions(
        str(model), None if args.draft is None else str(resolve_model_dir(args.draft)), args.policy,
        args.budget or SlotConfig(fraction=0.5), link, args.served_model_name, api_key,
        args.max_queue, args.max_body, template, args.timeout, profile, args.max_batch,
    )
    policy = make_policy(args.policy)
    kept = _KeptChoosers(args, policy.default_window) if policy.adaptive_window else None
    if kept is not None and kept.states:
        options = replace(options, choosers=kept.states)
    check_local_gpu(args.address, link)
    init_ray(args.address, args.num_cpus, args.connect_timeout)
    if link is not None and link.kind == "cuda":  # told here: past this, it would fail inside Serve's replica
        try:
            require_gpu()
        except ValueError:
            ray.shutdown()
            raise

    def ready(url: str) -> None:
        chooser = f", K choosers kept from {kept.requests} earlier request(s)" if kept and kept.states else ""
        print(f"specter: serving {options.name!r} at {url}/v1 (policy {args.policy}{chooser}; Ctrl-C stops)",
              file=sys.stderr, flush=True)

    try:
        tally = run(options, args.host, args.port, ready, keep=kept.save if kept is not None and kept.path else None)
    finally:
        ray.shutdown()
    if tally is not None:  # after Ray's own lines about its stop
        print(f"specter: stopped serving {options.name!r}: {tally['completed']} request(s) completed, "
              f"{tally['cancelled']} cancelled by their client, {tally['rejected']} refused with 429 (queue "
              f"full), {tally['errors']} failed", file=sys.stderr, flush=True)
    return 0


def _batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``specter batch``: validate everything, resume, then hand prompts out to the replicas."""
    import ray

    from actors.cluster import check_local_gpu
    from specter.target import load_tokenizer

    sampling = sampling_config(args, parser)
    default_draft(args)
    window = _window(args, parser)
    if args.request_timeout <= 0 or args.timeout <= 0:
        parser.error("argument --request-timeout/--timeout: must be > 0 seconds")
    if args.retries < 0:
        parser.error(f"argument --retries: must be >= 0, got {args.retries}")
    model_config = read_config_dict(resolve_model_dir(args.model))
    if args.draft is not None:
        check_draft_matches(read_config_dict(resolve_model_dir(args.draft)), model_config)
    try:
        stops = check_stops(args.stop)
    except ValueError as exc:
        parser.error(f"argument --{exc}")
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    items, bad = read_batch(args.input, args.max_new_tokens, sampling.temperature, sampling.seed, stops)
    if tokenizer is not None:  # (without one, nothing runs: said below)
        items, bad = _fit_context(args, items, bad, tokenizer, window, model_config)
    if not _report_bad_lines(args, bad):
        return 1
    results = ResultsFile(args.out)
    if results.repaired:
        print(f"specter batch: cut a torn last line ({results.repaired} bytes) off {args.out}", file=sys.stderr)
    todo = [item for item in items if item.id not in results.done]
    print(f"specter batch: {len(items)} prompts in {args.input}, {len(items) - len(todo)} already in {args.out}, "
          f"{len(todo)} to run on {args.replicas} replica(s)", file=sys.stderr)
    if not todo:
        results.close()
        return 1 if bad and args.on_bad_line == "stop" else 0
    timing = _timing(args, parser)  # the actors' wall clock; a profile's link comes with its host
    host_profile = timing.profile
    link = None if args.link is None and host_profile is None else timing.link  # None: the cluster's (cuda on a GPU)
    if not ray.is_initialized():
        try:
            check_local_gpu(args.address, link)
        except ValueError:
            results.close()
            raise
    budget = SlotConfig(fraction=args.budget.fraction if args.budget else 0.5, per_layer=args.per_layer)
    if tokenizer is None:
        raise CheckpointError(f"{args.model} has no tokenizer; batch prompts are text")
    from actors.batch import BatchOptions, run_batch
    from actors.cluster import init_ray

    options = BatchOptions(
        str(args.model), args.draft, budget, link, args.policy, window, sampling.top_p, sampling.top_k,
        _eos(args.model), args.replicas, args.request_timeout, args.retries, args.timeout, host_profile,
        args.pipeline is not False,
    )
    kept = _KeptChooser(args, window, sampling) if window else None
    if kept is not None:
        options = replace(options, chooser=kept.state)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        init_ray(args.address, args.num_cpus, args.connect_timeout)
    t0 = time.monotonic()
    progress = Progress(len(todo))
    try:
        report = run_batch(items, results, args.out, options, lambda text: list(tokenizer.encode(text)),
                           lambda ids: str(tokenizer.decode(ids)), progress)
    finally:
        progress.close()
        results.close()
        if owns_ray:
            ray.shutdown()
    wall = time.monotonic() - t0
    if kept is not None:
        kept.save(report.chooser)
    chooser = f", K chooser kept from {kept.state['requests']} earlier request(s)" if kept is not None and kept.state \
        else ""
    stopped = ""
    if report.interrupted:
        running = f" ({report.running} given up while running)" if report.running else ""
        stopped = f"{stopped_word(report.interrupted)}, {report.left} left{running}; "
    print(f"specter batch: {stopped}{report.finished} finished, {report.failed} failed, {report.skipped} skipped "
          f"(done before), {report.restarts} replica restart(s), {report.tokens} tokens in {wall:.1f}s "
          f"({report.tokens / max(wall, 1e-9):.1f} tok/s){chooser} -> {args.out}", file=sys.stderr)
    if report.failed:
        print(f"specter batch: failures are in {errors_path(args.out)}; re-run the same command to retry them",
              file=sys.stderr)
    if report.interrupted:
        print(f"specter batch: re-run the same command to go on with the {report.left} left", file=sys.stderr)
        return exit_status(report.interrupted)
    return 1 if report.failed else 0


def _fit_context(args: argparse.Namespace, items: list, bad: list, tokenizer: Any, window: int,
                 config: dict[str, Any]) -> tuple[list, list]:
    """The lines whose prompt, ``max_new_tokens`` and window fit the model (the verifier's own check,
    ``check_prompt``), and the bad lines with the others added, in line order: a line that cannot run
    is told before any replica starts (and stops the job there under ``--on-bad-line stop``)."""
    from specter.eval.jobs import BatchLineError
    from specter.request import check_prompt

    fit = []
    for item in items:
        try:
            check_prompt(list(tokenizer.encode(item.prompt)), item.max_new_tokens, window, int(config["vocab_size"]),
                         config.get("max_position_embeddings"))
        except ValueError as exc:
            bad.append(BatchLineError(f"{args.input}:{item.line}: {exc}", item.line))
            continue
        fit.append(item)
    return fit, sorted(bad, key=lambda error: error.line or 0)


def _report_bad_lines(args: argparse.Namespace, bad: list) -> bool:
    """Print the input's bad lines; False (run nothing) under ``--on-bad-line stop``, else record
    them in the errors file and go on."""
    for error in bad:
        print(f"specter batch: bad line: {error}", file=sys.stderr)
    if bad and args.on_bad_line == "stop":
        print(f"specter batch: {len(bad)} bad line(s) in {args.input}; nothing run (--on-bad-line stop)",
              file=sys.stderr)
        return False
    for error in bad:
        append_error(args.out, {"line": error.line, "error": str(error)})
    return True
