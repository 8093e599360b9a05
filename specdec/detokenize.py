"""Incremental detokenizing: the text of committed tokens as each round commits them.

``TokenStream`` turns the ``RoundEvent``s of ``on_round`` into text with a window of earlier tokens as context
(as vLLM's incremental detokenizer: a token's text can depend on the one before it), and holds back text that ends
in an incomplete character until the next token completes it. It prints nothing: each piece goes to ``on_piece``
with the kind of the token that completed it (``specdec.terminal`` prints them in colour, the server's
``TextStream`` hands them out). No terminal imports here: the server and the bench use it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from specdec.stats import RoundEvent

DETOKENIZE_CONTEXT = 5  # prompt tokens decoded before the first new one (as vLLM's incremental detokenizer)


class TokenStream:
    """Text of the committed tokens, piece by piece as rounds commit (``add`` is an ``on_round``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], *,
                 on_piece: Callable[[str, str], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.on_piece = on_piece  # (piece of text, kind of the token that completed it), for each new piece
        self.ids: list[int] = []  # new tokens so far
        self.kinds: list[str] = []  # their kinds
        self.text = ""  # text decoded so far
        self._window = list(prompt_ids[-DETOKENIZE_CONTEXT:])  # context, then tokens not yet decoded to text
        self._read = len(self._window)  # window[:_read] is context (already text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, piece: str, kind: str) -> None:
        self.text += piece
        if self.on_piece is not None and piece:
            self.on_piece(piece, kind)

    def add(self, event: RoundEvent) -> None:
        """Decode one round's tokens, each completed piece labelled with the kind of its last token."""
        for token, kind in zip(event.tokens, event.kinds):
            self.ids.append(token)
            self.kinds.append(kind)
            self._window.append(token)
            piece = self._pending()
            if piece and not piece.endswith("\ufffd"):  # an incomplete character waits for more bytes
                self._emit(piece, kind)
                self._window = self._window[self._read:]  # the decoded piece is the next context
                self._read = len(self._window)

    def _pending(self) -> str:
        """Text of the tokens after the context, decoded with the context in front."""
        before = self._decode(self._window[: self._read])
        after = self._decode(self._window)
        return after[len(before):]

    def finish(self) -> None:
        """Emit what a trailing incomplete character held back (the stream has ended)."""
        piece = self._pending()
        if piece:
            self._emit(piece, self.kinds[-1])
