"""Stop strings that complete across the paper rule's look-ahead boundary, with the real HFEngine.

The model is a real 1-layer Llama with SmolLM2's tokenizer whose weights make it a deterministic bigram chain
(attention and MLP outputs zeroed, so the logits depend on the current token only): it writes
``<python>print(1)</python>`` and, after every tool result, ``print(1)</python>`` again. ``</python>`` is three
SmolLM2 tokens; with a 5-token look-ahead the first request of the second turn ends on ``</`` and the stop string
completes in the continuation request, whose new tokens alone never contain it. (The second turn lacks ``<python>``,
so the environment answers it with a parse error: the test is about where the turn ends, not about the call.)
"""

from __future__ import annotations

import pytest

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv
from tests.arpo_algo.rollout.chain_models import save_chain_model


def _bigram_model(tok_dir, dest):
    """Save a Llama whose greedy and sampled continuations follow the chain of ``<python>print(1)</python>``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = tok("<python>print(1)</python>", add_special_tokens=False)["input_ids"]
    nxt: dict[int, int] = {}
    for a, b in zip(ids, ids[1:]):
        assert nxt.setdefault(a, b) == b, "the chain must be a function of the current token"
    last_obs = tok(" <result>\n1\n</result>", add_special_tokens=False)["input_ids"][-1]
    assert nxt[last_obs] == tok("print", add_special_tokens=False)["input_ids"][0]  # turn 2 starts at print(
    save_chain_model(tok, nxt, ids[0], dest, max_positions=4096)
    return dest


@pytest.fixture(scope="module")
def bigram_dir(smollm2_dir, tmp_path_factory):
    return _bigram_model(smollm2_dir, tmp_path_factory.mktemp("bigram") / "model")


@pytest.mark.parametrize("k", [5, 6])  # look-ahead ends after "</" (5) or after "</python" (6)
def test_stop_string_across_lookahead_boundary_ends_the_turn(bigram_dir, tmp_path, k):
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    eng = HFEngine(str(bigram_dir), seed=0)
    env = lambda: ToolTextEnv(task="toolmath", tools={"python": {}})  # noqa: E731
    cfg = TreeConfig(budget=1, initial=1, branch_factor=1, entropy_tokens=k)
    s = TreeSampler(eng, env, cfg, SamplingParams(), max_response_tokens=120, seed=0)
    groups, m = s.sample([0], step=0)
    s.close()
    t = groups[0].trajectories[0]
    tok = eng.tokenizer
    turns, cur = [], []  # the sampled segments (trained_mask 1) between tool results
    for tid, mask in zip(t.response_ids, t.trained_mask):
        if mask:
            cur.append(tid)
        elif cur:
            turns.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    # Every turn ends at its first stop string. Before the fix the second turn ran on past it
    # ("print(1)</python>print(1)</python>") and the env's error about two calls in one turn was trained on.
    assert turns[0] == "<python>print(1)</python>"
    assert len(turns) >= 2 and all(x == "print(1)</python>" for x in turns[1:]), turns
    assert len(turns) + (1 if cur else 0) >= 3 and m["rollout/stop_boundary_cuts"] == len(turns) - 1
