"""A growing list of tokens as text that is final: held back where a byte sequence is unfinished or a stop
string may be starting, cut at the first stop string."""

from __future__ import annotations

from typing import Any

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
        return str(self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens))

    def _stop_at(self, text: str) -> int | None:
        found = [i for stop in self.stops if (i := text.find(stop, max(0, self.sent - len(stop) + 1))) >= 0]
        return min(found) if found else None

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece
