"""The fixed-shape decode loop runs the stop-string check only after tokens that can complete a stop string
(:mod:`arpo_algo.rollout.engines.stop_filter`); these tests fail if it ever skips a check that would have ended a row.

Two real tokenizers: the tiny model's byte-level one (one token per byte, so a multi-byte character arrives in pieces
and its last token alone decodes to U+FFFD) and SmolLM2's (multi-character tokens, so a stop string's last character
can sit inside a token). A real 1-layer Llama over each, whose weights make it a deterministic bigram chain, writes a
known text; the static engine must end each row exactly where the decoded text first holds its stop string, like the
dynamic engine. A randomised check holds the filter itself to the engine's own rule on many token sequences.
"""

from __future__ import annotations

import random

import pytest

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.engines.stop_filter import StopFilter, byte_level
from tests.arpo_algo.rollout.chain_models import save_chain_model

PROMPT = "Q:"
CHAINS = {  # text the chain model writes after PROMPT, stop strings that end inside it
    "tiny": ("say wörld", ["ay w", "y wö", "wör", "d"]),
    "smol": ("<python>print(1) café</python>", ["</py", "1) caf", "é</", "on>"]),
}


def _chain_model(tok_dir, dest, text: str):
    """Save a Llama over ``tok_dir``'s tokenizer that greedily writes ``text``'s tokens after any other token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    nxt: dict[int, int] = {}
    for a, b in zip(ids, ids[1:]):
        assert nxt.setdefault(a, b) == b, "the chain must be a function of the current token"
    assert not set(tok(PROMPT, add_special_tokens=False)["input_ids"]) & set(ids)
    save_chain_model(tok, nxt, ids[0], dest, max_positions=1024)
    return dest, ids


@pytest.fixture(scope="module")
def chains(tiny_model_dir, smollm2_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("chains")
    return {
        name: _chain_model(src, base / name, CHAINS[name][0])
        for name, src in (("tiny", tiny_model_dir), ("smol", smollm2_dir))
    }


def _expected(tok, chain: list[int], stop: str) -> list[int]:
    """The chain's tokens up to the first one after which the decoded text holds ``stop``."""
    seq = []
    while True:
        seq.append(chain[len(seq) % len(chain)])
        if stop in tok.decode(seq, skip_special_tokens=False):
            return seq


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_static_engine_ends_rows_at_stop_strings_inside_and_across_tokens(chains, name):
    folder, chain = chains[name]
    dyn = HFEngine(str(folder), max_batch_size=2, decode="dynamic")
    sta = HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=2, decode="static", static_cache_tokens=128)
    tok = sta.tokenizer
    assert byte_level(tok)  # the filter's exact rule applies, so rows really are skipped between checks
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    stops = CHAINS[name][1]
    # each stop alone, then all of them on one row (the first to complete wins), then a row without stops that
    # decodes beside them (its budget ends it); more rows than slots, so rows also enter mid-call
    sets = [(s,) for s in stops] + [tuple(stops), ()]
    reqs = [
        GenRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_new_tokens=40, stop=st))
        for i, st in enumerate(sets)
    ]
    streamed: list[tuple[str, int]] = []
    got = sta.generate(reqs, on_token=lambda rid, t: streamed.append((rid, t)))
    ref = dyn.generate(reqs)
    for g, r, st in zip(got, ref, sets):
        assert (g.token_ids, g.finish_reason, g.stop_string) == (r.token_ids, r.finish_reason, r.stop_string)
        if not st:
            assert g.finish_reason == "length" and len(g.token_ids) == 40
            continue
        ends = {s: _expected(tok, chain, s) for s in st}
        first = min(ends.values(), key=len)
        assert g.finish_reason == "stop" and g.token_ids == first, (st, tok.decode(g.token_ids))
        assert g.stop_string in st and g.stop_string in tok.decode(g.token_ids)
        assert len(first) > 1  # the check that ends the row runs in the decode loop, not after the prefill
        assert len(g.logprobs) == len(g.entropies) == len(g.token_ids)
    for g in got:  # every token streamed once, in order
        assert [t for rid, t in streamed if rid == g.request_id] == g.token_ids


@pytest.mark.parametrize("ascii_only", [False, True])  # with ASCII-only stops, invalid UTF-8 tokens are not flagged
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_filter_flags_every_token_that_completes_a_stop_string(chains, name, ascii_only):
    """On random token sequences rich in the stop strings' pieces and in multi-byte characters: whenever the
    engine's rule (a stop string in the decoded last ``w`` tokens) first holds after token ``t``, ``t`` is flagged."""
    from transformers import AutoTokenizer

    folder, chain = chains[name]
    tok = AutoTokenizer.from_pretrained(folder)
    stops = CHAINS[name][1] + ["\n\n", "ö!", "ü"]  # "ü": two byte tokens in the tiny tokenizer
    if ascii_only:
        stops = [s for s in stops if s.isascii()] + ["r", "ok"]
    mask = StopFilter(tok, len(tok)).mask(set(stops))
    pool = sorted(
        {
            i
            for s in stops + ["é ü ö! ok\n", "wörld café", "日本語"]
            for i in tok(s, add_special_tokens=False)["input_ids"]
        }
        | set(chain)
    )
    width = max(len(s.encode()) for s in stops) + 1
    rng, hits = random.Random(0), 0
    for _ in range(300):
        seq: list[int] = []
        for _ in range(24):
            seq.append(rng.choice(pool) if rng.random() < 0.8 else rng.randrange(len(tok)))
            if any(s in tok.decode(seq[-width:], skip_special_tokens=False) for s in stops):
                if len(seq) > 1:
                    hits += 1
                    assert mask[seq[-1]], (tok.convert_ids_to_tokens(seq[-width:]), stops)
                break
    assert hits > 50  # the sequences did complete stop strings
