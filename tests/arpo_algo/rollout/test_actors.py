"""Two rollout actors on a 2-core CPU give the local engine's tokens for the same seeds, keep prefixes sticky and
take broadcast weights."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pool(ray_session, tiny_model_dir):
    from arpo_algo.rollout.engines.actors import RolloutActorPool

    p = RolloutActorPool(
        functools.partial(HFEngine, str(tiny_model_dir), max_batch_size=4), num_actors=2, num_cpus_per_actor=1
    )
    yield p
    p.shutdown()


def _requests(tok, n=6, prefix_key=None, ctx=None):
    return [
        GenRequest(
            f"r{i}",
            ctx or tok.encode("ask " * (i + 1)),
            SamplingParams(max_new_tokens=6 + i, seed=10 + i),
            prefix_key=prefix_key,
        )
        for i in range(n)
    ]


def test_pool_matches_local_engine(pool, tiny_model_dir):
    local = HFEngine(tiny_model_dir, max_batch_size=4)
    reqs = _requests(local.tokenizer)
    pool.stats()  # the counters run from the last read: start this test's from zero, whatever ran before
    remote, here = pool.generate(reqs), local.generate(reqs)
    assert [g.request_id for g in remote] == [r.request_id for r in reqs]
    for a, b in zip(remote, here):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    st = pool.stats()
    assert st["generated_tokens"] == sum(len(g.token_ids) for g in here) and st["requests"] == len(reqs)
    assert pool.tokenizer.encode("abc") == local.tokenizer.encode("abc")


def test_prefix_requests_are_sticky(pool):
    tok = pool.tokenizer
    first = pool.generate(_requests(tok, n=4))
    pool.stats()
    conts = [
        GenRequest(
            f"c{i}",
            tok.encode("ask " * (i + 1)) + g.token_ids + tok.encode(" <result>1</result>"),
            SamplingParams(max_new_tokens=4, seed=i),
            prefix_key=g.cache_key,
        )
        for i, g in enumerate(first)
    ]
    pool.generate(conts)
    st = pool.stats()
    assert st["prefix_hits"] == 4 and st.get("prefix_misses", 0) == 0 and st["reused_tokens"] > 0
    pool.release([g.cache_key for g in first])
    pool.generate(conts[:1])
    assert pool.stats()["prefix_misses"] == 1


def test_broadcast_weights(pool, tiny_model_dir):
    local = HFEngine(tiny_model_dir, max_batch_size=4)
    reqs = _requests(local.tokenizer, n=3)
    before = pool.generate(reqs)
    original = {k: v.clone() for k, v in local.model.state_dict().items()}
    sd = {k: v.clone() for k, v in original.items()}
    torch.manual_seed(0)
    sd["model.norm.weight"] = sd["model.norm.weight"] * 3.0 + torch.randn_like(sd["model.norm.weight"])
    pool.broadcast(sd)
    try:
        local.load_state_dict(sd)
        after, here = pool.generate(reqs), local.generate(reqs)
        assert [g.token_ids for g in after] == [g.token_ids for g in here]
        assert any(a.logprobs != b.logprobs for a, b in zip(after, before))
    finally:
        pool.broadcast(original)  # the module's pool serves the tiny model's own weights to every other test


def test_pool_has_max_context_so_prompt_overflow_applies(pool, tiny_model_dir):
    """The sampler reads engine.max_context (before: getattr(max_positions), absent on the pool: no check at all)."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_base.errors import ArpoError
    from arpo_env.core import ToolTextEnv

    assert pool.max_context == HFEngine(tiny_model_dir).max_context == 4096
    creator = lambda: ToolTextEnv(task="toolmath")  # noqa: E731
    s = TreeSampler(pool, creator, TreeConfig.grpo(2), SamplingParams(), max_response_tokens=4096 - 20)
    with pytest.raises(ArpoError, match="prompt of task 0"):
        s.sample([0], step=0)
    s.close()


def test_pool_has_max_logprobs_so_topk_logprobs_is_checked(pool, tiny_model_dir):
    """The sampler refuses tree.topk_logprobs above the engine's max_logprobs when it is built, through actors too."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_base.errors import ConfigError
    from arpo_env.core import ToolTextEnv

    limit = HFEngine(tiny_model_dir).max_logprobs
    assert pool.max_logprobs == limit
    creator = lambda: ToolTextEnv(task="toolmath")  # noqa: E731
    tree = TreeConfig(budget=2, initial=1, entropy_method="topk_sum_lnV", topk_logprobs=limit + 1)
    with pytest.raises(ConfigError, match=f"at most {limit} logprobs"):
        TreeSampler(pool, creator, tree, SamplingParams(), max_response_tokens=20)


def test_pool_close_is_idempotent(ray_session, tiny_model_dir):
    from arpo_algo.rollout.engines import build_engine

    # 0 CPUs: the module's pool already holds both CPUs of this Ray session; an actor asking for more would wait
    p = build_engine("hf", model_or_path=str(tiny_model_dir), num_actors=1, num_cpus_per_actor=0)
    assert p.num_actors == 1 and p.tokenizer is not None
    p.close()
    p.close()
    assert p.num_actors == 0
