"""The OpenAI wire format: request bodies checked into a ``Request``, responses and stream chunks built.

Only what Specter does is accepted: one choice (``n`` = 1), text out, greedy or sampled with
``temperature``/``top_p``/``seed``, ``stop`` strings, ``stream`` (with ``stream_options.include_usage``).
A parameter Specter cannot honour is refused by name (400) unless it carries its neutral value, so a
client never gets silently different behaviour. Every error is ``ApiError``: an HTTP status and the
OpenAI error body (``{"error": {"message", "type", "param", "code"}}``) that the ``openai`` client
raises as its own exceptions.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from specter.serving.text import check_stops

DEFAULT_MAX_TOKENS = 16  # /v1/completions' default in the OpenAI API; chat's is what the context leaves
# Parameters accepted only with the value that changes nothing (what the OpenAI API means by leaving them out).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}), "suffix": (None,),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, False, True),
}
IGNORED = {"user", "metadata", "store", "service_tier"}  # bookkeeping of the caller's: no effect on the output
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options"}
FIELDS = {
    "completion": COMMON | {"prompt"},
    "chat": COMMON | {"messages", "max_completion_tokens"},
}


class ApiError(Exception):
    """An HTTP error with OpenAI's error body. ``param`` names the request field at fault."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """One checked request: what the engine runs and how the answer is shaped."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id


@dataclass(frozen=True)
class Model:
    """What the server serves: its name, its tokenizer, its context and vocabulary sizes."""

    name: str
    tokenizer: Any
    context: int
    vocab: int


def parse(body: bytes, kind: str, model: Model) -> Request:
    """Check a ``/v1/completions`` (``kind="completion"``) or ``/v1/chat/completions`` (``"chat"``) body.

    Raises:
        ApiError: 400 naming the field (bad JSON, a missing or mistyped field, a refused parameter, a
            prompt that does not fit the context), 404 for a model this server does not serve.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body: expected a JSON object, got {type(data).__name__}")
    _check_fields(data, kind)
    name = data.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: required, a string (GET /v1/models lists it)", "model")
    if name != model.name:
        raise ApiError(404, f"model {name!r} not found: this server serves {model.name!r}", "model",
                       "model_not_found")
    if kind == "chat":
        prompt_ids, where = _chat_prompt(data, model), "messages"
    else:
        prompt_ids, where = _completion_prompt(data, model), "prompt"
    room = model.context - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"{where}: {len(prompt_ids)} tokens, but the model's context is {model.context} "
                            f"and at least one must be left to generate", where, "context_length_exceeded")
    limit_name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    limit = data.get(limit_name)
    if limit is None:
        max_tokens = min(room, DEFAULT_MAX_TOKENS) if kind == "completion" else room
    else:
        max_tokens = _integer(limit, limit_name, low=1)
        if max_tokens > room:
            raise ApiError(400, f"{limit_name}: {max_tokens} tokens after a prompt of {len(prompt_ids)} exceeds "
                                f"the model's context of {model.context} (at most {room})", limit_name,
                           "context_length_exceeded")
    stream = _boolean(data.get("stream", False), "stream")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options: only with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise ApiError(400, "stream_options: expected {\"include_usage\": true|false}", "stream_options")
        include_usage = _boolean(options.get("include_usage", False), "stream_options.include_usage")
    temperature = _number(data.get("temperature", 1.0), "temperature", 0.0, 2.0)  # the API's default: sampled
    top_p = _number(data.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "top_p: must be > 0 and <= 1, got 0", "top_p")
    seed = data.get("seed")
    seed = secrets.randbits(31) if seed is None else _integer(seed, "seed", low=0)
    return Request(kind, name, prompt_ids, max_tokens, temperature, top_p, seed, _stops(data.get("stop")), stream,
                   include_usage)


def _check_fields(data: dict[str, Any], kind: str) -> None:
    for key, value in data.items():
        if key in FIELDS[kind] or key in IGNORED:
            continue
        if key in NEUTRAL:  # by value and kind: true is not 1, 0.0 is 0
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL[key]):
                raise ApiError(400, f"{key}: not supported by Specter (got {value!r}; only "
                                    f"{NEUTRAL[key][0]!r})", key, "unsupported_parameter")
            continue
        other = "prompt" if kind == "chat" else "messages"
        hint = f" (that is /v1/{'completions' if kind == 'chat' else 'chat/completions'}'s)" if key == other else ""
        raise ApiError(400, f"{key}: unknown or unsupported parameter{hint}", key, "unsupported_parameter")


def _completion_prompt(data: dict[str, Any], model: Model) -> list[int]:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt: empty", "prompt")
        ids = list(model.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < model.vocab]
        if bad:
            raise ApiError(400, f"prompt: token ids must lie in [0, {model.vocab}), got {bad[:5]}", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, f"prompt: one prompt per request (got a batch of {len(prompt)}); send them as "
                            "separate requests, which the server runs concurrently", "prompt")
    else:
        raise ApiError(400, "prompt: required, a non-empty string or list of token ids", "prompt")
    if not ids:
        raise ApiError(400, "prompt: encodes to no tokens", "prompt")
    return ids


def _chat_prompt(data: dict[str, Any], model: Model) -> list[int]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: required, a non-empty list of {\"role\", \"content\"}", "messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a \"role\" string", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content: expected a string", "messages")
        plain.append({"role": message["role"], "content": content})
    if not getattr(model.tokenizer, "chat_template", None):
        raise ApiError(400, f"model {model.name!r} has no chat template: use /v1/completions, or start the "
                            "server with --chat-template FILE", "messages", "no_chat_template")
    try:
        ids = model.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    except Exception as exc:  # the template's own error (a role it refuses, say)
        raise ApiError(400, f"messages: the chat template refused them: {exc}", "messages") from None
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    return list(ids)


def _stops(stop: Any) -> tuple[str, ...]:
    try:
        return check_stops(stop)
    except ValueError as exc:
        raise ApiError(400, str(exc), "stop") from None


def _integer(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name}: expected an integer, got {value!r}", name)
    if value < low:
        raise ApiError(400, f"{name}: must be >= {low}, got {value}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"{name}: expected a number, got {value!r}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name}: must lie in [{low:g}, {high:g}], got {value}", name)
    return float(value)


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: expected true or false, got {value!r}", name)
    return value


# -- responses ---------------------------------------------------------------------------------------------


def figures(stats: dict[str, Any]) -> dict[str, Any]:
    """Specter's own figures of a finished request (the response's ``specter`` field). Not the engine's
    ``cancelled``: a response that reaches its client was not abandoned, and a stop string that ends it
    stops the engine the same way (it would read true for a plain ``finish_reason`` ``stop``)."""
    keys = ("tpot_s", "prefill_s", "decode_s", "hit_rate", "recall", "mean_accepted", "rounds", "hits",
            "inflight", "misses", "bytes_moved", "link_busy_fraction", "policy", "mean_batch")
    return {k: stats[k] for k in keys if k in stats}


def usage(request: Request, completion_tokens: int) -> dict[str, int]:
    prompt = len(request.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def response(request: Request, text: str, finish: str, tokens: int, stats: dict[str, Any]) -> dict[str, Any]:
    """The whole (unstreamed) answer."""
    if request.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                  "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": request.response_id, "object": kind, "created": request.created, "model": request.model,
            "choices": [choice], "usage": usage(request, tokens), "specter": figures(stats)}


def chunk(request: Request, text: str | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
    """One stream chunk: text (chat: the first carries the role), or the finish reason (text None)."""
    if request.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": request.response_id, "object": kind, "created": request.created, "model": request.model,
            "choices": [choice]}


def usage_chunk(request: Request, tokens: int, stats: dict[str, Any]) -> dict[str, Any]:
    """The stream's last chunk when ``stream_options.include_usage``: no choices, the usage (and figures)."""
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    return {"id": request.response_id, "object": kind, "created": request.created, "model": request.model,
            "choices": [], "usage": usage(request, tokens), "specter": figures(stats)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
