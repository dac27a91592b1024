"""``specter serve`` on loopback, driven by the official ``openai`` client (sync and async) and raw HTTP.

One server (a local Ray, Ray Serve, the three actors on the embedded model) is started for the module
as a user would start it, with a key, a small queue and a chat template; every test leaves it serving.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import serving

from specter.assets import DEFAULT_MODEL
from specter.cli import main as specter_main
from specter.target import load_tokenizer

KEY = "test-key-" + "x" * 16
MAX_QUEUE = 8
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def", "for i in range(10):"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``specter serve`` as a subprocess: yields its base URL, port and process; stopped with SIGINT
    (Ctrl-C) at the end, which must end it with 0 and no traceback."""
    folder = tmp_path_factory.mktemp("serve")
    template = folder / "chat.jinja"
    template.write_text(TEMPLATE)
    with serving(["--api-key", KEY, "--max-queue", str(MAX_QUEUE), "--chat-template", str(template),
                  "--max-body", "64KiB"], folder / "serve.log") as running:
        yield running


def _client(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, **options)


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def _complete(url: str, prompt: str, max_tokens: int = 16) -> str:
    out = _client(url).completions.create(model="moe-fine", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def _generate_text(prompt: str, max_tokens: int, capsys) -> str:
    """What ``specter generate`` (the in-process engine) makes of the prompt, as text."""
    assert specter_main(["generate", "--prompt", prompt, "--max-new-tokens", str(max_tokens), "--json"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = json.loads(line)["tokens"]
    return str(load_tokenizer(Path(DEFAULT_MODEL)).decode(tokens, skip_special_tokens=True))


def test_streamed_greedy_text_equals_specter_generate(server, capsys):
    url, _, _ = server
    stream = _client(url).completions.create(model="moe-fine", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, figures = [], None, None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage, figures = chunk.usage, chunk.model_extra.get("specter")
    assert len(pieces) > 3  # streamed, not one piece
    assert "".join(pieces) == _generate_text(PROMPTS[0], 24, capsys)
    assert finish == "length" and usage.completion_tokens == 24 and usage.prompt_tokens > 0
    assert figures["tpot_s"] > 0 and 0 <= figures["hit_rate"] <= 1 and figures["policy"] == "demand-lru"
    whole = _client(url).completions.create(model="moe-fine", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert whole.choices[0].text == "".join(pieces) and whole.model_extra["specter"]["bytes_moved"] > 0


def test_models_chat_and_stop(server):
    url, _, _ = server
    client = _client(url)
    assert [m.id for m in client.models.list()] == ["moe-fine"]
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model="moe-fine", messages=messages, max_tokens=12, temperature=0)
    templated = "user: def add(a, b):\nassistant:"
    assert chat.choices[0].message.content == _complete(url, templated, 12)
    assert chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model="moe-fine", messages=messages, max_tokens=12, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    full = _complete(url, PROMPTS[0], 24)
    stop = full[5:9]  # a stop string that appears in the text: the answer ends just before it
    cut = client.completions.create(model="moe-fine", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert "cancelled" not in cut.model_extra["specter"]  # the stop string ended the engine's request: not a cancel


def test_sixteen_concurrent_streams_are_batched_and_each_equals_its_single_request_text(server):
    url, _, _ = server
    alone = {p: _complete(url, p, 16) for p in PROMPTS}

    batch_sizes = []

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="moe-fine", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        pieces = []
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            else:
                batch_sizes.append(chunk.model_extra["specter"]["mean_batch"])
        return "".join(pieces)

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=30) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % 4]) for i in range(16)))

    texts = asyncio.run(main())
    assert texts == [alone[PROMPTS[i % 4]] for i in range(16)]
    assert len(batch_sizes) == 16 and max(batch_sizes) > 2  # decoded together (demand-lru batches)


def test_a_burst_of_100_completes_each_exactly_once(server):
    """100 at once against a queue of 8: the rest are told 429 with Retry-After, and the client's retries
    bring every request through exactly once (the server's completed count moves by exactly 100)."""
    url, _, _ = server
    alone = {p: _complete(url, p, 4) for p in PROMPTS}
    before = _health(url)

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=60) as client:
            outs = await asyncio.gather(*(
                client.completions.create(model="moe-fine", prompt=PROMPTS[i % 4], max_tokens=4, temperature=0)
                for i in range(100)))
        return [o.choices[0].text for o in outs]

    texts = asyncio.run(main())
    after = _health(url)
    assert texts == [alone[PROMPTS[i % 4]] for i in range(100)]
    assert after["completed"] - before["completed"] == 100
    assert after["rejected"] > before["rejected"]  # the queue held: some waited outside it
    assert after["errors"] == before["errors"] and after["waiting"] == 0 and after["running"] == 0


def test_a_full_queue_answers_429_with_retry_after(server):
    url, _, _ = server
    body = {"model": "moe-fine", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body, headers=headers)
                                          for _ in range(3 * MAX_QUEUE)))

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.status_code == 200 for r in responses if r not in refused)
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["code"] == "queue_full"
    assert _complete(url, PROMPTS[1], 4)


def test_a_stream_closed_midway_is_cancelled_and_frees_the_engine(server):
    url, _, _ = server
    before = _health(url)
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "moe-fine", "prompt": PROMPTS[2], "max_tokens": 1000, "temperature": 0,
                            "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert got
    closed = time.monotonic()
    # the engine stops at its next round: idle again long before 1000 tokens (~10+ s here) could be made
    deadline = closed + 30
    while (health := _health(url))["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    idle_s = time.monotonic() - closed
    assert health["running"] == 0 and health["cancelled"] == before["cancelled"] + 1, (idle_s, before, health)
    t0 = time.monotonic()
    assert _complete(url, PROMPTS[0], 16) == _complete(url, PROMPTS[0], 16)
    after = _health(url)
    assert after["completed"] == before["completed"] + 2
    assert time.monotonic() - t0 < (closed - started) + 60  # the next requests ran, not queued behind 1000 tokens


def test_streams_cut_at_any_point_never_stall_the_next_request(server):
    """A stream dropped after 1…8 lines, then a short request at once, twelve times: each answers in
    seconds. (With Ray's in-order actor calls a dropped stream could leave the verifier waiting 30 s for
    a call that never came, then fail the queued ones; the verifier now runs its calls out of order.)"""
    url, _, _ = server
    for cut in [1, 3, 2, 8, 5, 1, 4, 7, 2, 6, 1, 3]:
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "moe-fine", "prompt": PROMPTS[cut % 4], "max_tokens": 1000,
                                "temperature": 0, "stream": True}, timeout=60) as response:
            assert response.status_code == 200
            assert [line for line, _ in zip(response.iter_lines(), range(cut), strict=False)]
        t0 = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": "moe-fine", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
                              timeout=60)
        assert response.status_code == 200, (cut, response.text)
        assert time.monotonic() - t0 < 20, (cut, time.monotonic() - t0)  # ~0.3 s here; the stall was 30 s


@pytest.mark.parametrize(("body", "status", "names"), [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "'other' not found"),
    (json.dumps({"model": "moe-fine", "prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "moe-fine", "prompt": "x " * 1100}).encode(), 400, "prompt"),
    (json.dumps({"model": "moe-fine", "prompt": "x", "n": 2}).encode(), 400, "n:"),
    (json.dumps({"model": "moe-fine", "prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"model": "moe-fine", "prompt": "x", "mystery": 1}).encode(), 400, "mystery"),
    (json.dumps({"model": "moe-fine", "prompt": "x" * 70_000}).encode(), 413, "limit"),
])
def test_bad_requests_get_a_status_that_names_the_field_and_the_server_goes_on(server, body, status, names):
    url, _, _ = server
    response = httpx.post(f"{url}/v1/completions", content=body,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert names in error["message"] and error["type"]
    assert _complete(url, PROMPTS[3], 2)  # still serving


def test_the_openai_client_raises_its_own_errors(server):
    url, _, _ = server
    client = _client(url, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="moe-fine", prompt="x", max_tokens=5000)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_every_v1_path_needs_the_key_and_health_does_not(server):
    url, _, _ = server
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models/moe-fine"), ("POST", "/v1/embeddings")]:
        response = httpx.request(method, f"{url}{path}", json={"model": "moe-fine", "prompt": "x"}, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    assert httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 404


def test_it_listens_on_loopback_only(server):
    _, port, _ = server
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # LISTEN
                listening.add(address)
    assert listening == {"0100007F"}, listening  # 127.0.0.1, nothing else
