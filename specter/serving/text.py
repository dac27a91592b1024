"""A growing list of tokens as text that is final: held back where a byte sequence is unfinished or a stop
string may be starting, cut at the first stop string.

Each ``add`` decodes only the tokens since the text was last whole, from one chunk back (a tokenizer
may write a token differently at the start of a text: SentencePiece drops a leading word's space), so a
token costs the same at the 4000th as at the 10th; decoding the whole list each time cost a time that
grew with the text's length. This holds for a tokenizer whose text of some tokens begins with the text of
the first of them, but for a character they leave unfinished: byte-level BPE (GPT-2, Qwen, Llama 3) and
SentencePiece (Llama 2, Mixtral) are such. One that rewrites text across tokens (WordPiece's clean-up of
" ." into ".") cannot be streamed exactly at all: it changes text already handed out."""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types alone: this module imports no torch (the API's parsing, batch files)
    from specter.request import Cancelled, OnTokens

UNFINISHED = "\ufffd"  # what decoding shows for a byte sequence that the next token may complete


class TextStream:
    """Text handed out as tokens arrive; together the pieces are the text of all tokens, up to a stop.

    Args:
        tokenizer: decodes the tokens.
        stops: strings that end the text where they first appear (not included), as OpenAI's ``stop``.
        skip_special_tokens: leave special tokens, such as the end of text, out of the text (the API's
            text); ``specter generate`` prints them, as its whole-text output always did.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.stops, self.skip_special_tokens = tokenizer, stops, skip_special_tokens
        self.tokens: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string was found: nothing more comes
        self._whole = ""  # the text of tokens[:_read]: whole characters only
        self._back, self._read = 0, 0  # decoding starts at tokens[_back]: the chunk before _read

    def add(self, tokens: list[int]) -> str:
        """The text these tokens make final (may be empty)."""
        if self.stopped:
            return ""
        self.tokens += tokens
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._take(text, cut)
        safe = len(text.rstrip(UNFINISHED))
        for stop in self.stops:  # the longest tail that may be the start of a stop string waits
            for k in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - k:safe] == stop[:k]:
                    safe -= k
                    break
        return self._take(text, safe)

    def finish(self) -> str:
        """What was held back, once no more tokens come."""
        if self.stopped:
            return ""
        return self._take(self._decode(), None)

    def _decode(self) -> str:
        """The text of all the tokens, as decoding them at once writes it."""
        seen = self._text(self.tokens[self._back:self._read])
        new = self._text(self.tokens[self._back:])[len(seen):]
        text = self._whole + new
        if new and not new.endswith(UNFINISHED):
            self._whole, self._back, self._read = text, self._read, len(self.tokens)
        return text

    def _text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens))

    def _stop_at(self, text: str) -> int | None:
        found = [i for stop in self.stops if (i := text.find(stop, max(0, self.sent - len(stop) + 1))) >= 0]
        return min(found) if found else None

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece


MAX_STOPS = 4  # as OpenAI's ``stop``
NO_TOKENIZER = "stop: this model has no tokenizer, so its text cannot be matched; drop the stop strings"


def check_stops(stops: Any, name: str = "stop") -> tuple[str, ...]:
    """``stops`` (a string, or a list of up to ``MAX_STOPS`` non-empty ones) as a tuple.

    Raises:
        ValueError: naming ``name`` and what was expected.
    """
    if stops is None:
        return ()
    listed = [stops] if isinstance(stops, str) else stops
    if (not isinstance(listed, list | tuple) or len(listed) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in listed)):
        raise ValueError(f"{name}: expected a non-empty string or a list of up to {MAX_STOPS} of them, "
                         f"got {reprlib.repr(stops)}")  # shortened: a client's body may be large
    return tuple(listed)


def until_stop(decode: Callable[[list[int]], str], tokens: list[int],
               stops: tuple[str, ...]) -> tuple[list[int], str]:
    """The tokens up to and with the one whose text completes the first stop string (all of them where
    none appears: as transformers' ``stop_strings`` ends a generation), and their text up to that stop,
    the stop not included (OpenAI's ``stop``). ``decode``: the tokens' text, special tokens kept."""
    text = decode(tokens)
    if not any(stop in text for stop in stops):
        return list(tokens), text
    low, high = 1, len(tokens)  # the fewest tokens whose text holds a stop: it only grows with more
    while low < high:
        middle = (low + high) // 2
        if any(stop in decode(tokens[:middle]) for stop in stops):
            high = middle
        else:
            low = middle + 1
    text = decode(tokens[:low])
    return list(tokens[:low]), text[:min(text.index(stop) for stop in stops if stop in text)]


class Stops:
    """A request's stop strings watched as its tokens commit: ``on_tokens`` and ``cancelled`` for
    ``Engine.generate`` (or a batched request), wrapping the caller's own, so that the request ends at the
    step or round whose tokens wrote one (``until_stop`` then cuts the tokens and text exactly)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], on_tokens: OnTokens | None = None,
                 cancelled: Cancelled | None = None):
        if tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        self.text = TextStream(tokenizer, stops, skip_special_tokens=False)
        self._on_tokens, self._cancelled = on_tokens, cancelled

    def on_tokens(self, tokens: list[int]) -> None:
        self.text.add(list(tokens))
        if self._on_tokens is not None:
            self._on_tokens(tokens)

    def cancelled(self) -> bool:
        return self.text.stopped or (self._cancelled is not None and self._cancelled())

    def mark(self, stats: dict[str, Any]) -> dict[str, Any]:
        """A request's figures with ``stop``: whether a stop string ended it (``cancelled`` then says
        only whether the caller did)."""
        stats["stop"] = self.text.stopped
        if self.text.stopped:
            stats["cancelled"] = self._cancelled is not None and self._cancelled()
        return stats
