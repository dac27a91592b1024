"""The wire format and the streamed text, without a server: checked against the tokenizer itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_process import READY, START_S, STOP_S, free_port, start_serve, stop

from specter.assets import DEFAULT_MODEL
from specter.serving.api import ApiError, Model, parse
from specter.serving.text import TextStream
from specter.target import load_tokenizer


@pytest.fixture(scope="module")
def model() -> Model:
    return Model("moe-fine", load_tokenizer(Path(DEFAULT_MODEL)), 1024, 2048)


def _parse(model: Model, kind: str = "completion", **fields) -> object:
    return parse(json.dumps({"model": "moe-fine", **fields}).encode(), kind, model)


def test_a_completion_is_the_tokenizers_ids_with_the_apis_defaults(model):
    req = _parse(model, prompt="def f(x):")
    assert req.prompt_ids == model.tokenizer("def f(x):")["input_ids"]
    assert req.max_tokens == 16 and req.temperature == 1.0 and req.top_p == 1.0 and not req.stream
    ids = _parse(model, prompt=[5, 6, 7], max_tokens=3, temperature=0, seed=4, stop="\n")
    assert ids.prompt_ids == [5, 6, 7] and ids.max_tokens == 3 and ids.seed == 4 and ids.stop == ("\n",)
    assert _parse(model, prompt=["one"]).prompt_ids == model.tokenizer("one")["input_ids"]
    assert _parse(model, prompt="x", n=1, logprobs=None, user="u", presence_penalty=0).max_tokens == 16
    assert _parse(model, prompt="x", logprobs=False, parallel_tool_calls=True, frequency_penalty=0.0).max_tokens == 16


@pytest.mark.parametrize(("fields", "status", "param"), [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1024}, 400, "max_tokens"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "n": 3}, 400, "n"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "messages": []}, 400, "messages"),
    ({"prompt": "x", "model": "gpt"}, 404, "model"),
])
def test_bad_fields_are_named(model, fields, status, param):
    with pytest.raises(ApiError) as caught:
        parse(json.dumps({"model": "moe-fine", **fields}).encode(), "completion", model)
    assert caught.value.status == status and caught.value.param == param
    assert caught.value.body()["error"]["param"] == param and caught.value.message


def test_chat_needs_a_template_and_uses_it(model):
    with pytest.raises(ApiError, match="no chat template") as caught:
        _parse(model, "chat", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status == 400
    tokenizer = load_tokenizer(Path(DEFAULT_MODEL))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    templated = Model("moe-fine", tokenizer, 1024, 2048)
    req = _parse(templated, "chat", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert req.prompt_ids == tokenizer("hi|", add_special_tokens=False)["input_ids"]
    assert req.max_tokens == 1024 - len(req.prompt_ids)  # chat's default: what the context leaves


def test_streamed_text_is_the_decoded_text_up_to_the_first_stop(model):
    tokenizer = model.tokenizer
    ids = tokenizer("héllo wörld, and then some more text\nnext line")["input_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for split in (1, 2, 3):
        stream = TextStream(tokenizer)
        pieces = [stream.add(ids[i:i + split]) for i in range(0, len(ids), split)] + [stream.finish()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
        stopped = TextStream(tokenizer, ("then", "\n"))
        pieces = [stopped.add(ids[i:i + split]) for i in range(0, len(ids), split)] + [stopped.finish()]
        assert "".join(pieces) == text[:text.index("then")] and stopped.stopped


def test_serve_refuses_a_public_host_without_a_key():
    proc = subprocess.run([sys.executable, "-m", "specter.cli", "serve", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "SPECTER_API_KEY"})
    assert proc.returncode == 2 and "--api-key" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("how", "status", "word"), [("ctrl-c", 130, "interrupted"),
                                                     ("sigterm-group", 143, "terminated")])
def test_ctrl_c_or_sigterm_while_the_server_starts_stops_it_there(tmp_path, how, status, word):
    """Ctrl-C, or SIGTERM to its process group (a service manager's stop), before the application is
    up (its replica loading the model: minutes for a large one) stops ``specter serve`` there and then:
    status 130 / 143, "specter: interrupted" / "terminated", never the ready line, no traceback; before,
    Ctrl-C was held until the server had started, then it printed it was serving."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = start_serve(free_port(), [], log)
        try:
            deadline = time.monotonic() + START_S
            while 'Started Serve in namespace "serve"' not in log_path.read_text():  # the application starts next
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            stop(proc, how)
            code = proc.wait(timeout=STOP_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert code == status, text[-3000:]
    assert text.strip().splitlines()[-1] == f"specter: {word}"
    assert READY not in text and "Traceback" not in text, text[-3000:]


def test_serve_on_a_port_in_use_or_a_foreign_address_says_so_in_one_line_before_ray_starts(capsys, monkeypatch):
    """A port another program listens on, or a ``--host`` that is not this machine's, is told in one
    line (status 1) before Ray starts; before, Ray's traceback from inside Serve's proxy, 14 s later."""
    import socket

    import actors.cluster
    from specter.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the port was checked")

    monkeypatch.setattr(actors.cluster, "init_ray", no_ray)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"specter: error: --port: 127.0.0.1:{port} is in use by another program; stop it or pick another --port"
    assert main(["serve", "--port", str(port), "--host", "192.0.2.77", "--api-key", "k"]) == 1  # TEST-NET-1
    assert capsys.readouterr().err.strip() == "specter: error: --host: 192.0.2.77 is not an address of this machine"
