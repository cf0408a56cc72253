"""The held-out evaluation's greedy answers do not depend on how many rows the engine decodes together, which is
what lets the quickstart evaluate at the widest batch (its evaluation stage) without changing its numbers."""

from __future__ import annotations

from arpo_algo.algorithms import ARPOConfig
from arpo_algo.algorithms.components import env_creator
from arpo_algo.eval.evaluation import eval_settings, sample_held_out
from arpo_algo.rollout.engines.hf.engine import HFEngine
from benchmarks.eval_batch import responses


def test_greedy_held_out_answers_are_the_same_at_batch_16_and_32(tiny_model_dir):
    cfg = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [3], "max_tool_calls": 3})
        .llm_rollouts(max_response_tokens=48)
        .evaluation(num_prompts=32, temperature=0.0)
    )
    settings = eval_settings(cfg).as_kwargs()
    creator = env_creator(cfg, split="test")
    got = {}
    for batch in (16, 32):
        engine = HFEngine(str(tiny_model_dir), max_batch_size=batch, seed=0)
        got[batch] = responses(sample_held_out(engine, creator, **settings))
    # two waves of 16 rows against one of 32: other matrix shapes, the same greedy tokens
    assert len(got[32]) == 32
    assert got[16] == got[32]
