"""The streamed text against the tokenizer's own decoding of all the tokens at once, for any tokens in any
chunks: the shipped byte-level tokenizer (tokens that split a character's bytes, the end-of-text token),
and a SentencePiece-style one (a word's space dropped at the start of a text). Stop strings against
transformers' own ``stop_strings``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tokenizers import SentencePieceBPETokenizer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specter.assets import DEFAULT_MODEL
from specter.serving.text import Stops, TextStream, check_stops, until_stop
from specter.target import load_tokenizer

TEXT = ["héllo wörld, and then some more text", "next line € 😀 of words. Isn't it , so ?", "def f(x):\n    return x"]


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer(Path(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def metaspace():
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(TEXT * 20, vocab_size=200, min_frequency=1, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    ids = tokenizer(" world")["input_ids"]
    assert tokenizer.decode(ids).strip() == "world" and not tokenizer.decode(ids).startswith(" ")
    return tokenizer


class Counting:
    """The tokenizer, recording how many tokens each decode was handed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, tokens, **kwargs):
        self.lengths.append(len(tokens))
        return self.tokenizer.decode(tokens, **kwargs)


def _streamed(tokenizer, ids, chunks, skip=True, stops=()):
    stream = TextStream(tokenizer, stops, skip_special_tokens=skip)
    pieces, at = [], 0
    for size in chunks:
        pieces.append(stream.add(ids[at:at + size]))
        at += size
    return pieces + [stream.finish()], stream


def _chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 7]))
    return sizes


@pytest.mark.parametrize("skip", [True, False])
def test_random_tokens_in_random_chunks_are_the_whole_decoded_text(shipped, skip):
    """Any tokens at all (bytes that do not make a character, the end-of-text token inside the text): the
    pieces together are exactly what decoding all the tokens at once writes, and no piece ends inside a
    character that later tokens finish."""
    rng = random.Random(7)
    vocab = len(shipped)
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        pieces, _ = _streamed(shipped, ids, _chunks(rng, len(ids)), skip)
        assert "".join(pieces) == shipped.decode(ids, skip_special_tokens=skip)


def test_text_split_inside_characters_streams_whole_characters(shipped):
    ids = shipped("héllo wörld € 😀 and more 😀😀")["input_ids"]
    assert any("\ufffd" in shipped.decode([i]) for i in ids)  # some token holds part of a character
    pieces, _ = _streamed(shipped, ids, [1] * len(ids))
    assert "".join(pieces) == shipped.decode(ids) and all("\ufffd" not in p for p in pieces)


def test_a_word_at_the_start_of_a_chunk_keeps_its_space(metaspace):
    """SentencePiece writes no space before a text's first word: decoding each chunk alone would lose the
    space before every chunk's first word."""
    rng = random.Random(3)
    for text in TEXT:
        ids = metaspace(text)["input_ids"]
        for _ in range(5):
            pieces, stream = _streamed(metaspace, ids, _chunks(rng, len(ids)))
            assert "".join(pieces) == metaspace.decode(ids)


def test_each_add_decodes_a_few_tokens_however_long_the_text(shipped):
    """A token costs the same at the 2000th as at the 10th: each add decodes only the tokens since the
    text was last whole and the chunk before them (before, all the tokens each time)."""
    ids = shipped(Path(__file__).read_text() * 2)["input_ids"][:2000]
    counting = Counting(shipped)
    pieces, _ = _streamed(counting, ids, [1] * len(ids), stops=("\x00 no such text",))
    assert "".join(pieces) == shipped.decode(ids)
    assert max(counting.lengths[:-2]) <= 8, max(counting.lengths)


def test_a_stop_string_that_spans_chunks_cuts_the_text_there(shipped):
    ids = shipped("first line\nsecond line\nthird")["input_ids"]
    text = shipped.decode(ids)
    for size in (1, 2, 5):
        pieces, stream = _streamed(shipped, ids, [size] * len(ids), stops=("nd li",))
        assert "".join(pieces) == text[:text.index("nd li")] and stream.stopped


def test_a_request_cut_at_its_stop_strings_is_what_transformers_stop_strings_generates(shipped):
    """``until_stop`` over the whole greedy text: the tokens transformers' ``generate(stop_strings=…)``
    returns (up to and with the token that completes the stop, also one that spans tokens), and their
    text before the stop; no stop written: everything."""
    ref = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), experts_implementation="eager", dtype=torch.float32)
    cases = [("def fibonacci(n):", ("path",)), ("def fibonacci(n):", ("return", "get")),
             ("import os", ("h.p", "never")), ("def fibonacci(n):", ("th, se",)), ("class A:", ("never written",))]
    for prompt, stops in cases:
        ids = torch.tensor([shipped.encode(prompt)])
        whole = ref.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        want = ref.generate(ids, max_new_tokens=32, do_sample=False, stop_strings=list(stops),
                            tokenizer=shipped)[0, ids.shape[1]:].tolist()
        tokens, text = until_stop(shipped.decode, whole, stops)
        assert tokens == want, (prompt, stops)
        full = shipped.decode(want)
        assert text == full[:min([full.index(stop) for stop in stops if stop in full] or [len(full)])]
        assert (len(want) < len(whole)) == any(stop in shipped.decode(whole) for stop in stops)


def test_stops_end_the_request_after_the_commit_that_wrote_one(shipped):
    """``Stops`` hands each commit on and says "cancelled" from the commit whose tokens complete a stop
    string (here one spanning two tokens), not before; its figures say ``stop``."""
    ids = shipped.encode("x.path.path.path")
    handed: list[list[int]] = []
    watch = Stops(shipped, ("h.p",), handed.append, lambda: False)
    ended_at = None
    for i, token in enumerate(ids):
        assert not watch.cancelled()
        watch.on_tokens([token])
        if watch.cancelled():
            ended_at = i
            break
    assert ended_at is not None and "h.p" in shipped.decode(ids[:ended_at + 1])
    assert "h.p" not in shipped.decode(ids[:ended_at]) and handed == [[t] for t in ids[:ended_at + 1]]
    assert watch.mark({"cancelled": True}) == {"cancelled": False, "stop": True}
    asked = Stops(shipped, ("never",), None, lambda: True)
    assert asked.cancelled() and asked.mark({"cancelled": True}) == {"cancelled": True, "stop": False}
    with pytest.raises(ValueError, match="no tokenizer"):
        Stops(None, ("x",))


@pytest.mark.parametrize(("given", "want"), [(None, ()), ("\n", ("\n",)), (["a", "b c"], ("a", "b c"))])
def test_stop_strings_are_one_string_or_a_list_of_up_to_four(given, want):
    assert check_stops(given) == want


@pytest.mark.parametrize("given", ["", ["a", ""], ["a"] * 5, 7, [7], {"a": 1}])
def test_bad_stop_strings_are_named_with_what_was_expected(given):
    with pytest.raises(ValueError, match="^stop: expected a non-empty string or a list of up to 4"):
        check_stops(given)
