"""Which sampled tokens can complete a stop string, so that a decode loop runs the text check only for those rows.

The engine's stop check (``HFEngine._check_finish``) decodes a row's last ``w`` tokens (``w`` = the longest stop
string in bytes, plus one) and looks for every stop string in that text. Running it for every row at every step is
the costliest host work of a decode step; :class:`StopFilter` says, per token id, whether the check can succeed at a
step whose new token is that id, given that it failed at the step before. Skipping the check elsewhere changes no
result (same finish reasons, same stop strings, same tokens).

Why the rule is exact. With a byte-level decoder (transformers' ``ByteLevel``, no clean-up of spaces), decoding a
list of tokens is the lossy UTF-8 decoding of their concatenated bytes. Let ``t`` be the new token and ``P`` the
window's other tokens. If ``t``'s bytes are valid UTF-8 on their own (its text holds no U+FFFD), then
``text(P + t) = text(P) + text(t)``: a character left unfinished at the end of ``P`` becomes U+FFFD either way and
``t`` starts a new one. An occurrence of a stop string ``s`` that overlaps ``text(t)`` ends inside it, so ``text(t)``
holds the last character of ``s``. One that does not lies in ``text(P)``, and ``text(P)`` is the previous window's
text (``P`` after one more token, or ``P`` itself at the start) except for leading U+FFFD of continuation bytes that
the extra token may complete: a byte that is not a continuation byte always starts a character, so the rest decodes
alike. If ``s`` holds no U+FFFD it was then already in the previous window, where the check failed. So the check can
only succeed when ``text(t)`` holds the last character of a stop string, or ``t`` is not valid UTF-8 alone; those
tokens are flagged (the second kind only when a stop string holds a non-ASCII character, see
:meth:`StopFilter.mask`). With any other decoder, with clean-up, for stop strings holding U+FFFD and for ids beyond
the tokenizer's vocabulary every token is flagged, so the check runs as often as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BAD = "\ufffd"  # the replacement character of a lossy decode


def byte_level(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` is the lossy UTF-8 decoding of the tokens' concatenated bytes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (
        backend is not None
        and type(backend.decoder).__name__ == "ByteLevel"
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


class StopFilter:
    """Per token id: can a step that samples it complete a stop string (see the module docstring)?

    Args:
        tokenizer: The engine's tokenizer.
        rows: Token ids the model can sample (the vocabulary rows of its logits).
    """

    def __init__(self, tokenizer: Any, rows: int) -> None:
        self.tokenizer, self.rows = tokenizer, rows
        self.exact = byte_level(tokenizer)
        self._pieces: list[str] | None = None
        self._unsafe: np.ndarray | None = None
        self._by_char: dict[str, np.ndarray] = {}

    def mask(self, stops: set[str]) -> np.ndarray:
        """``bool[rows]``: True for the tokens after which the stop check must run for rows stopping at ``stops``."""
        if not stops:
            return np.zeros(self.rows, dtype=bool)
        if not self.exact or any(_BAD in s for s in stops):
            return np.ones(self.rows, dtype=bool)
        # ASCII-only stop strings need no unsafe tokens: an ASCII byte decodes to itself wherever it stands, so such
        # a stop string is a run of ASCII bytes, which ends in the new token's bytes (and then in its text) or lies
        # wholly in the previous window's bytes.
        ascii_only = all(s.isascii() for s in stops)
        out = np.zeros(self.rows, dtype=bool) if ascii_only else self._unsafe_tokens().copy()
        for c in {s[-1] for s in stops if s}:  # an empty stop string ends its row at the first token
            out |= self._char(c)
        return out

    def _texts(self) -> list[str]:
        if self._pieces is None:
            n = min(self.rows, len(self.tokenizer))
            self._pieces = self.tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
        return self._pieces

    def _unsafe_tokens(self) -> np.ndarray:
        """Tokens whose bytes are not valid UTF-8 alone, and ids the tokenizer does not know."""
        if self._unsafe is None:
            pieces = self._texts()
            unsafe = np.ones(self.rows, dtype=bool)
            unsafe[: len(pieces)] = [_BAD in p for p in pieces]
            self._unsafe = unsafe
        return self._unsafe

    def _char(self, c: str) -> np.ndarray:
        if c not in self._by_char:
            pieces = self._texts()
            hit = np.zeros(self.rows, dtype=bool)
            hit[: len(pieces)] = [c in p for p in pieces]
            self._by_char[c] = hit
        return self._by_char[c]
