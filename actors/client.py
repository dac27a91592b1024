"""The driver-side client: attach to (or start) Ray, launch a replica, generate.

``Client(model, draft, ..., address="local")`` starts an embedded Ray (one machine: loopback only,
token authentication); ``address="auto"`` or ``"HOST:PORT"`` attaches to a running cluster
(``ray start --head``, its token in ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``) within
``connect_timeout_s`` or raises ``ConnectError``; ``address=None`` uses a Ray that this process
already initialized. See ``actors/cluster.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from actors.cluster import DEFAULT_CONNECT_TIMEOUT_S, check_local_gpu, init_ray
from actors.launcher import EngineHandle, cluster_link, launch
from specter.config import LinkConfig, SlotConfig
from specter.serving.text import NO_TOKENIZER, check_stops, until_stop
from specter.target import load_tokenizer

log = logging.getLogger(__name__)


class Client:
    """Generates through one launched replica (three actors).

    Args:
        model: the target checkpoint folder.
        draft: the draft folder (None: only draft-free policies such as ``demand-lru``).
        budget: the device's expert budget.
        link: how experts move (None: the cluster's, `cuda` where it has a GPU, else sim:1,10).
        policy: the policy the replica starts with (a request may switch it).
        address: ``"local"`` (start Ray here), ``"auto"``/``"ray://…"``/``"HOST:PORT"`` (attach),
            or None (Ray is already initialized by the caller).
        num_cpus: CPUs of a local Ray.
        timeout_s: the actors' peer and handshake timeouts.
        connect_timeout_s: how long attaching to a cluster may take before ``ConnectError``.
        host_profile: the profile whose host computes late experts (``launch``'s).
        dtype: the target's compute dtype (None: fp32 on a CPU, the checkpoint's on a GPU).
    """

    def __init__(
        self, model: str | Path, draft: str | Path | None = None, budget: SlotConfig | None = None,
        link: LinkConfig | None = None, policy: str = "specter", address: str | None = "local", num_cpus: int = 2,
        timeout_s: float = 60.0, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, host_profile: str | None = None,
        dtype: torch.dtype | None = None,
    ):
        self._owns_ray = False
        if not ray.is_initialized():
            check_local_gpu(address, link)
            init_ray(address, num_cpus, connect_timeout_s)
            self._owns_ray = True
        self.tokenizer = load_tokenizer(Path(model))
        self.handle: EngineHandle = launch(
            model, draft, budget or SlotConfig(fraction=0.5), cluster_link(link), policy, timeout_s=timeout_s,
            host_profile=host_profile, dtype=dtype,
        )

    def generate(
        self, prompts: list[str] | list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0,
        top_p: float = 1.0, top_k: int = 0, seed: int = 0, policy: str | None = None, window: int | None = None,
        eos_token_id: int | None = None, pipelined: bool | None = None, chooser: dict[str, Any] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None, stop: str | list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """One ``{"text", "tokens", "stats"}`` per prompt (text is empty without a tokenizer).

        ``pipelined``: the draft drafts each next round while this one is verified (None: the
        verifier's default, on). ``chooser``: a K chooser's state for the replica's first request to
        start from (``WindowChooser.state``'s; ``{}``: none); given, each result also carries the
        chooser's state after its request as ``chooser`` (``VerifierRole.generate``). ``on_tokens``:
        given, called with the prompt's index and each step's or round's tokens as they commit (the
        prompts run one after another). ``stop``: a string, or up to four, that ends each request where its
        text first holds one: the request stops at that round, its ``tokens`` end with the one that
        completed the stop (as transformers' ``stop_strings``), its ``text`` before the stop (OpenAI's
        ``stop``); ``on_tokens`` is handed the round's tokens whole."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, list | tuple):
            raise TypeError(f"prompts: expected a list of strings or of token-id lists, got {type(prompts).__name__}")
        stops = check_stops(stop)
        if stops and self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        encoded = [self._encode(prompt, i) for i, prompt in enumerate(prompts)]  # all checked before any work
        results = []
        extra: dict[str, Any] = {} if pipelined is None else {"pipelined": pipelined}
        if chooser is not None:
            extra["chooser"] = chooser
        if stops:
            extra["stop"] = list(stops)
        for index, ids in enumerate(encoded):
            options = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, window=window, policy=policy,
                           eos_token_id=eos_token_id, **extra)
            if on_tokens is None:
                out = self.handle.generate(ids, max_new_tokens, **options)
            else:
                out = self.handle.stream(ids, max_new_tokens, functools.partial(on_tokens, index), **options)
            tokens, text = out["tokens"], ""
            if self.tokenizer is not None:
                tokens, text = until_stop(self._decode, out["tokens"], stops)
            results.append({"text": text, "tokens": tokens, "stats": out["stats"]}
                           | ({"chooser": out["chooser"]} if "chooser" in out else {}))
        return results

    def close(self) -> None:
        """Shut the replica down (and Ray, if this client started it)."""
        self.handle.shutdown()
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decode(self, tokens: list[int]) -> str:
        assert self.tokenizer is not None
        return str(self.tokenizer.decode(tokens))

    def _encode(self, prompt: object, index: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompts[{index}]: must not be empty")
            if self.tokenizer is None:
                raise ValueError(f"prompts[{index}]: text needs a tokenizer; this checkpoint has none, give token ids")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list | tuple) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise TypeError(f"prompts[{index}]: expected a non-empty string or a non-empty list of int token ids, "
                        f"got {type(prompt).__name__} {str(prompt)[:40]!r}")
