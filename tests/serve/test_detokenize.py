"""The serving detokeniser (serve.runtime.TextStream): the text it streams is the full decode of the reply (cut at a
client stop string), and each token costs a constant number of decode calls over a bounded window of ids, however
long the reply."""

from __future__ import annotations

import random

import pytest

from serve.runtime import TextStream


@pytest.fixture(scope="module")
def tok():
    from arpo_algo.models.tiny import byte_tokenizer

    return byte_tokenizer()


class CountingTokenizer:
    """A real tokenizer whose ``decode`` calls (and the ids each one gets) are recorded."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kw)


TEXTS = [
    "plain ascii text, with <python>print(1)</python> in it",
    "accents: é à ü, and ß",
    "emoji 🙂🚀 and 漢字 mixed",
    "STOP early? no, only later: the end STOP here",
]


def _stream(tok, ids, stop, segments=()):
    parts = []
    ts = TextStream(tok, stop, parts.append)
    for i, t in enumerate(ids):
        if i in segments:
            ts.end_segment()
        ts.token(t)
    ts.end_segment()
    return "".join(parts), parts


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert _stream(tok, ids, [])[0] == tok.decode(ids, skip_special_tokens=True)
    for stop in (["STOP"], ["</python>", "zz"], ["🚀"], ["é à"]):
        full = tok.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in stop) if i >= 0), default=len(full))
        assert _stream(tok, ids, stop)[0] == full[:cut], stop
    # a tool result between turns: each segment decodes afresh
    half = len(ids) // 2
    joined = tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[half:], skip_special_tokens=True)
    assert _stream(tok, ids, [], segments={half})[0] == joined


def test_decode_calls_per_token_do_not_grow_with_the_reply(tok):
    rng = random.Random(0)
    alphabet = "abc def éü🙂漢 <>()\n"
    per_token = {}
    for n_chars in (500, 8000):
        text = "".join(rng.choice(alphabet) for _ in range(n_chars))
        ids = tok.encode(text, add_special_tokens=False)
        counting = CountingTokenizer(tok)
        out, _ = _stream(counting, ids, ["STOP!"])
        assert out == text
        per_token[n_chars] = len(counting.calls) / len(ids)
        assert len(counting.calls) <= 2 * len(ids) + 2
        assert max(counting.calls) <= 8, max(counting.calls)  # a window of a few ids (a character's bytes), never
        assert sum(counting.calls) <= 8 * len(ids)  # the reply so far
    assert per_token[8000] <= per_token[500] * 1.1


def test_a_long_run_of_replacement_characters_costs_a_bounded_window(tok):
    # Bytes that are no UTF-8 decode to U+FFFD for ever: the stream must not hold them back as "a character not
    # finished yet", or each token re-decodes the whole run (quadratic work on the batcher thread).
    lone = tok.encode("\xff", add_special_tokens=False)[-1]  # a UTF-8 continuation byte, alone: U+FFFD
    assert tok.decode([lone] * 3) == "\ufffd" * 3
    ids = [lone] * 3000 + tok.encode("done", add_special_tokens=False)
    counting = CountingTokenizer(tok)
    out, _ = _stream(counting, ids, [])
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert len(counting.calls) <= 2 * len(ids) + 2
    assert max(counting.calls) <= 16, max(counting.calls)
    assert sum(counting.calls) <= 32 * len(ids)  # quadratic would be about 1500 * len(ids)
