"""A request's text as its rounds commit: incremental detokenizing and OpenAI's stop-string rule.

``TextStream`` is ``specdec.detokenize``'s ``TokenStream`` (a window of earlier tokens gives context;
text that ends in an incomplete character waits for the next token) collecting its pieces, each
labelled with the kind of the token that completed it (accepted, recovered, bonus).

OpenAI returns text *without* the stop sequence (the core keeps it in the tokens, as ``generate``
does). So, while a request has stop strings, the last ``len(longest stop) - 1`` characters are held
back (they may be the start of a stop string, as vLLM's detokenizer does), and at a stop string the
text ends before it. Without stop strings nothing is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specdec.detokenize import TokenStream
from specdec.stats import STOP_STRING


class TextStream(TokenStream):
    """The released text of one request's tokens, as (piece, kind) segments."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                 stop_strings: Sequence[str] = ()) -> None:
        super().__init__(tokenizer, prompt_ids)
        self.stop_strings = tuple(stop_strings)
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.released = ""  # text handed out so far
        self._pieces: list[tuple[str, str]] = []  # every decoded piece and its kind, in order
        self._next = 0  # the first piece not wholly released
        self._within = 0  # characters of that piece already released

    def _emit(self, piece: str, kind: str) -> None:
        super()._emit(piece, kind)
        if piece:
            self._pieces.append((piece, kind))

    def _stop_at(self) -> int | None:
        """Where the first stop string in the text begins (None: no stop string yet)."""
        found = [i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def release(self) -> list[tuple[str, str]]:
        """The text that can be handed out now: all but what may start a stop string, and never one."""
        end = len(self.text) - self.holdback
        stop = self._stop_at()
        return self._take(end if stop is None else min(end, stop))

    def release_final(self, stop_reason: str) -> list[tuple[str, str]]:
        """The rest of the text once the request is done: cut before the stop string it stopped at."""
        self.finish()
        stop = self._stop_at() if stop_reason == STOP_STRING else None
        return self._take(len(self.text) if stop is None else stop)

    def _take(self, end: int) -> list[tuple[str, str]]:
        """Segments of the pieces from the released length up to character ``end``."""
        segments = []
        while len(self.released) < end and self._next < len(self._pieces):
            piece, kind = self._pieces[self._next]
            n = min(len(piece) - self._within, end - len(self.released))
            segment = piece[self._within: self._within + n]
            segments.append((segment, kind))
            self.released += segment
            self._within += n
            if self._within == len(piece):
                self._next, self._within = self._next + 1, 0
        return segments
