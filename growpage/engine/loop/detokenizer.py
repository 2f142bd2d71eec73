"""Incremental detokenization: a request's text, decoding a few tokens per new token.

Decoding a request's whole output after every token (for stop strings and streaming) costs the
square of its length: 32k tokens of SmolLM2 text take about 10 ms to decode, so about 150 s
summed over the run (measured in 11e868d). ``IncrementalDetokenizer`` decodes only a
window at the end.

The window starts at the previous commit point (the ids before it are already text), so a
decoder that treats the first token of a call specially (SentencePiece's leading-space rule)
sees the same first token in both decodes it compares, and the new text is the window's text
past the text of its committed part. Text is committed only when it does not end in U+FFFD: a
byte-level BPE token may hold part of a UTF-8 character, decoded as U+FFFD until the rest
arrives.

For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) and SentencePiece tokenizers, ``text`` is
``decode(ids)`` without a trailing incomplete character; tests check this on SmolLM2's
tokenizer. A decoder whose text of a concatenation is not the concatenation of texts (one that
rewrites across token boundaries) can differ; the engine's final ``RequestOutput.text`` is
always one full decode, so only stop detection and streamed chunks would see the difference.
A run of tokens that never completes a character (invalid UTF-8 the model keeps emitting) is
decoded again at each token until one does: quadratic in that run only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"
_FOLD = 256  # settled pieces kept apart before they are joined to the text


class IncrementalDetokenizer:
    """``text``: the settled text of the ids seen so far; ``update(ids)`` extends it.
    ``pending``: the text of the ids not settled yet (ending in U+FFFD), "" when none are;
    ``text + pending`` is what decoding all the ids gives.

    ``ids`` must only grow between calls (the same list, appended to, or any list that starts
    with the ids given before). Fewer ids, or a change among the ids of the current window (the
    last settled ones and those after), raise ``ValueError``; earlier ids are not read again.

    The settled text is kept as a string plus a list of the recent pieces, joined to the string
    every ``_FOLD`` pieces: an update copies 1/256 of the text on average, and ``tail(n)`` reads
    only its last ``n`` characters.

    Each update decodes two windows: the new one, and in running text the token settled by it
    alone (the next window's context). ``single``, a dict shared by the detokenizers of one
    ``decode`` (the engine's requests), remembers the text of single tokens, so the second is a
    lookup; ``decode`` must then be a pure function of the ids (a tokenizer's decode is).
    """

    __slots__ = (
        "_decode",
        "pending",
        "num_chars",
        "_head",
        "_pieces",
        "_start",
        "_read",
        "_start_text",
        "_seen",
        "_single",
    )

    def __init__(
        self, decode: Callable[[list[int]], str], single: dict[int, str] | None = None
    ) -> None:
        self._decode = decode
        self._single = single  # text of single tokens, shared (see the class docstring)
        self.pending = ""
        self.num_chars = 0  # len(text)
        self._head = ""  # text = _head + "".join(_pieces)
        self._pieces: list[str] = []
        self._start = 0  # where the next window starts
        self._read = 0  # ids before it are in ``text``; ids[_start:_read] are context
        self._start_text = ""  # decode(ids[_start:_read]), the context's own text
        self._seen: list[int] = []  # the window's ids, to check that they did not change

    @property
    def text(self) -> str:
        """The settled text (joins the recent pieces: O(its length))."""
        self._fold()
        return self._head

    @property
    def num_settled_tokens(self) -> int:
        """How many leading ids ``text`` covers (the rest wait for a whole character)."""
        return self._read

    def tail(self, n: int) -> str:
        """The last ``n`` characters of ``text`` (all of it when shorter); O(n)."""
        if n <= 0:
            return ""
        pieces = self._pieces
        if pieces and len(pieces[-1]) >= n:  # the common case: within the last piece
            return pieces[-1][-n:]
        parts: list[str] = []
        need = n
        for piece in reversed(pieces):
            parts.append(piece[-need:])
            need -= len(parts[-1])
            if need <= 0:
                break
        if need > 0:
            parts.append(self._head[-need:])
        return "".join(reversed(parts))

    def update(self, ids: Sequence[int]) -> str:
        """Take the ids (all of them, not only the new ones); return the newly settled text."""
        start, seen = self._start, self._seen
        window = ids[start:] if type(ids) is list else list(ids[start:])
        num_seen = len(seen)
        if len(window) < num_seen or window[:num_seen] != seen:
            raise ValueError(
                "IncrementalDetokenizer.update: ids must extend the ids given "
                f"before ({start + num_seen} ids known, got {len(ids)} that differ or are fewer)"
            )
        if len(window) == num_seen:
            return ""
        self._seen = window
        text = self._decode(window)
        new = text[len(self._start_text) :]
        if text.endswith(_INCOMPLETE):
            self.pending = new
            return ""  # wait for the rest of the character
        self._pieces.append(new)
        self.num_chars += len(new)
        if len(self._pieces) >= _FOLD:
            self._fold()
        self.pending = ""
        # The next window starts with the ids settled now: the context its text is measured from.
        read = self._read
        self._start, self._read = read, start + len(window)
        self._seen = seen = window[read - start :]
        single = self._single
        if single is None or len(seen) != 1:
            self._start_text = self._decode(seen)
        else:  # running text: the context is the one token settled now
            known_text = single.get(seen[0])
            if known_text is None:
                known_text = single[seen[0]] = self._decode(seen)
            self._start_text = known_text
        return new

    def _fold(self) -> None:
        if self._pieces:
            self._head += "".join(self._pieces)
            self._pieces.clear()
