"""Several LoRA adapters on one base in one HF engine: a mixed batch equals each adapter's own engine, and nothing
computed under one adapter (stored KV, a shared prefill, a shared leading run) is reused under another."""

from __future__ import annotations

import pytest

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_base.errors import ConfigError

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from arpo_algo.models import build_tiny_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": build_tiny_adapter(tiny_model_dir, root / "a", rank=4, seed=1),
        "b": build_tiny_adapter(tiny_model_dir, root / "b", rank=8, seed=2),
    }


@pytest.fixture(scope="module")
def multi(tiny_model_dir, adapters):
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    return HFEngine(tiny_model_dir, adapters={k: str(v) for k, v in adapters.items()}, max_batch_size=4)


def _alone(path, reqs):
    """Each request on an engine of that one policy (the adapter folder loaded as ``arpo eval`` loads it)."""
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    return [g.token_ids for g in HFEngine(path, max_batch_size=4).generate(reqs)]


def test_a_mixed_batch_equals_each_policy_served_alone(multi, adapters, tiny_model_dir):
    ctx = list(range(40, 72))
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    reqs = [
        GenRequest(i, ctx, p, adapter=a)
        for i, (a, p) in enumerate([("a", GREEDY), ("b", GREEDY), (None, GREEDY), ("a", seeded), ("b", seeded)])
    ]
    got = [g.token_ids for g in multi.generate(reqs)]
    want = {
        name: _alone(path, [GenRequest(0, ctx, GREEDY), GenRequest(1, ctx, seeded)])
        for name, path in {**adapters, None: tiny_model_dir}.items()
    }
    assert got == [want["a"][0], want["b"][0], want[None][0], want["a"][1], want["b"][1]]
    assert len({tuple(w[0]) for w in want.values()}) == 3  # the adapters really change the policy


def test_stored_kv_is_never_reused_under_another_adapter(multi, adapters):
    ctx = list(range(50, 90))
    first = multi.generate([GenRequest(0, ctx, GREEDY, adapter="a")])[0]
    longer = ctx + first.token_ids + [60, 61]
    multi.stats()
    # the hint names a's KV; the request runs under b: b's own tokens, computed afresh
    got = multi.generate([GenRequest(0, longer, GREEDY, prefix_key=first.cache_key, adapter="b")])[0]
    assert multi.stats().get("prefix_hits", 0) == 0
    assert got.token_ids == _alone(adapters["b"], [GenRequest(0, longer, GREEDY)])[0]
    same = multi.generate([GenRequest(0, longer, GREEDY, prefix_key=first.cache_key, adapter="a")])[0]
    assert multi.stats()["prefix_hits"] == 1  # under its own adapter the stored prefix is reused
    assert same.token_ids == _alone(adapters["a"], [GenRequest(0, longer, GREEDY)])[0]


def test_a_shared_leading_run_is_shared_within_an_adapter_only(multi, adapters):
    from arpo_algo.rollout.engines.hf.slot_prefill import SHARED_PREFIX_MIN

    head = list(range(33, 33 + SHARED_PREFIX_MIN + 8))
    reqs = [
        GenRequest(0, head + [70, 71], GREEDY, adapter="a"),
        GenRequest(1, head + [72], GREEDY, adapter="b"),
        GenRequest(2, head + [73, 74], GREEDY, adapter="b"),
    ]
    got = [g.token_ids for g in multi.generate(reqs)]
    assert got[0] == _alone(adapters["a"], [GenRequest(0, reqs[0].token_ids, GREEDY)])[0]
    assert got[1:] == _alone(adapters["b"], [GenRequest(i, r.token_ids, GREEDY) for i, r in enumerate(reqs[1:])])


def test_an_unknown_adapter_is_an_error_generation_not_the_base(multi):
    gen = multi.generate([GenRequest("r", [40, 41], GREEDY, adapter="nope")])[0]
    assert gen.finish_reason == "error" and "adapter 'nope' is not loaded" in gen.error


def test_adding_and_removing_an_adapter_between_calls(tiny_model_dir, adapters, tmp_path):
    from arpo_algo.models import build_tiny_adapter, build_tiny_model
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    eng = HFEngine(tiny_model_dir, adapters={"a": str(adapters["a"])})
    eng.add_adapter("b", str(adapters["b"]))
    ctx = list(range(40, 60))
    assert (
        eng.generate([GenRequest(0, ctx, GREEDY, adapter="b")])[0].token_ids
        == _alone(adapters["b"], [GenRequest(0, ctx, GREEDY)])[0]
    )
    with pytest.raises(ConfigError, match="loaded already"):
        eng.add_adapter("b", str(adapters["b"]))
    other = build_tiny_adapter(build_tiny_model(tmp_path / "other", seed=5), tmp_path / "c", seed=3)
    with pytest.raises(ConfigError, match="not on this engine's base") as e:
        eng.add_adapter("c", str(other))
    assert "fingerprint" in e.value.message and "c" not in eng.adapters
    eng.remove_adapter("a")
    assert eng.generate([GenRequest(0, ctx, GREEDY, adapter="a")])[0].finish_reason == "error"
    assert (
        eng.generate([GenRequest(0, ctx, GREEDY, adapter="b")])[0].token_ids
        == _alone(adapters["b"], [GenRequest(0, ctx, GREEDY)])[0]
    )
