"""HFEngine against teacher-forced forwards of the same model: logprobs, entropies, KV reuse, refill, stops, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from arpo_algo.core.entropy import topk_token_term
from arpo_algo.rollout.engines.base import GenRequest, RolloutEngine, SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.engines.hf.slot_prefill import SHARED_PREFIX_MIN
from arpo_base.errors import ConfigError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, max_batch_size=4)


def _prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _teacher_forced(model, context: list[int], new: list[int], temperature: float = 1.0):
    """Logprobs and entropies of ``new`` under one full forward over context + new (no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([context + new])).logits[0].float()
    t = temperature or 1.0
    logp = torch.log_softmax(logits[len(context) - 1 : -1] / t, -1)
    ent = -(logp.exp() * logp).sum(-1)
    lps = logp[torch.arange(len(new)), torch.tensor(new)]
    return lps.tolist(), ent.tolist(), logits[len(context) - 1 : -1]


def _maxdiff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_protocol_and_teacher_forced_match(engine):
    assert isinstance(engine, RolloutEngine)
    reqs = [
        GenRequest(
            f"r{i}",
            _prompt(engine, "question " * (i + 1)),
            SamplingParams(max_new_tokens=12, temperature=t, top_p=tp, top_k=tk, seed=i),
        )
        for i, (t, tp, tk) in enumerate([(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 20)])
    ]
    for req, gen in zip(reqs, engine.generate(reqs)):
        assert gen.request_id == req.request_id and gen.finish_reason in ("length", "eos")
        lps, ents, _ = _teacher_forced(engine.model, req.token_ids, gen.token_ids, req.params.temperature)
        assert _maxdiff(lps, gen.logprobs) < 1e-4
        assert _maxdiff(ents, gen.entropies) < 1e-4


def test_greedy_matches_argmax(engine):
    req = GenRequest("g", _prompt(engine, "greedy please"), SamplingParams(max_new_tokens=15, temperature=0.0))
    gen = engine.generate([req])[0]
    _, _, logits = _teacher_forced(engine.model, req.token_ids, gen.token_ids)
    assert gen.token_ids == logits.argmax(-1).tolist()
    # top_k=1 and a tiny top_p leave only the argmax too, whatever the seed
    for params in (
        SamplingParams(max_new_tokens=15, top_k=1, seed=5),
        SamplingParams(max_new_tokens=15, top_p=1e-6, seed=6),
    ):
        assert engine.generate([GenRequest("k", req.token_ids, params)])[0].token_ids == gen.token_ids


def test_kv_prefix_reuse_is_exact(engine):
    base = GenRequest(
        "p", _prompt(engine, "<|im_start|>user\nsolve it<|im_end|>\n"), SamplingParams(max_new_tokens=10, seed=1)
    )
    first = engine.generate([base])[0]
    assert first.cache_key is not None
    engine.stats()
    tool = _prompt(engine, " <result>\n42\n</result>")
    ctx = base.token_ids + first.token_ids + tool
    branches = [
        GenRequest(f"b{s}", ctx, SamplingParams(max_new_tokens=8, seed=s), prefix_key=first.cache_key) for s in range(3)
    ]
    gens = engine.generate(branches)
    st = engine.stats()
    # the first branch prefills only the tool tokens on top of the stored prefix; its identical twins share that
    assert st["prefix_hits"] == 1 and st["shared_prefills"] == 2
    assert st["reused_tokens"] == len(base.token_ids) + len(first.token_ids) - 1 + 2 * len(ctx)
    assert st["prefill_tokens"] == len(tool) + 1
    scratch = engine.generate([GenRequest(f"s{s}", ctx, SamplingParams(max_new_tokens=8, seed=s)) for s in range(3)])
    for gen, ref in zip(gens, scratch):
        assert gen.token_ids == ref.token_ids
        lps, ents, _ = _teacher_forced(engine.model, ctx, gen.token_ids)
        assert _maxdiff(lps, gen.logprobs) < 1e-4 and _maxdiff(ents, gen.entropies) < 1e-4
    # a branch whose context is a prefix of the stored sequence (branching mid-segment) also reuses it
    mid = base.token_ids + first.token_ids[:4]
    engine.stats()
    g = engine.generate([GenRequest("m", mid, SamplingParams(max_new_tokens=5, seed=9), prefix_key=first.cache_key)])
    assert engine.stats()["reused_tokens"] == len(mid) - 1
    lps, _, _ = _teacher_forced(engine.model, mid, g[0].token_ids)
    assert _maxdiff(lps, g[0].logprobs) < 1e-4


def test_prefix_mismatch_and_miss_fall_back(engine):
    base = GenRequest("p", _prompt(engine, "abcdef"), SamplingParams(max_new_tokens=4, seed=2))
    key = engine.generate([base])[0].cache_key
    engine.stats()
    other = _prompt(engine, "xyzdef ghi")
    gens = [
        engine.generate([GenRequest(rid, other, SamplingParams(max_new_tokens=4, seed=2), prefix_key=hint)])[0]
        for rid, hint in (("x", key), ("y", "nope"))
    ]
    st = engine.stats()
    assert st["prefix_mismatches"] == 1 and st["prefix_misses"] == 1 and st["reused_tokens"] == 0
    assert gens[0].token_ids == gens[1].token_ids


def test_refill_many_lengths_batch2(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, max_batch_size=2)
    reqs = [
        GenRequest(i, eng.tokenizer.encode("x" * (3 + 5 * i)), SamplingParams(max_new_tokens=n, seed=i))
        for i, n in enumerate([30, 2, 7, 1, 15, 4, 9])
    ]
    gens = eng.generate(reqs)
    assert [g.request_id for g in gens] == list(range(7))
    assert [len(g.token_ids) for g in gens] == [30, 2, 7, 1, 15, 4, 9]
    st = eng.stats()
    # refill keeps both rows busy: 7 prefills + about (68 - 7) / 2 decode steps; batching in fixed pairs without
    # refill would need 7 + 29 + 6 + 14 + 8 = 64 forwards
    assert st["forward_calls"] <= 7 + 33
    for req, gen in zip(reqs, gens):
        lps, ents, _ = _teacher_forced(eng.model, req.token_ids, gen.token_ids)
        assert _maxdiff(lps, gen.logprobs) < 1e-4 and _maxdiff(ents, gen.entropies) < 1e-4


def test_seed_independent_of_batch_composition(engine):
    target = GenRequest("t", _prompt(engine, "the same seed"), SamplingParams(max_new_tokens=20, seed=123))
    alone = engine.generate([target])[0]
    others = [
        GenRequest(i, _prompt(engine, "filler " * (i + 2)), SamplingParams(max_new_tokens=5 + 4 * i, seed=i))
        for i in range(5)
    ]
    mixed = engine.generate(others[:2] + [target] + others[2:])[2]
    assert mixed.token_ids == alone.token_ids
    assert _maxdiff(mixed.logprobs, alone.logprobs) < 1e-4
    different = engine.generate([GenRequest("t", target.token_ids, SamplingParams(max_new_tokens=20, seed=124))])[0]
    assert different.token_ids != alone.token_ids


def test_stop_strings_honoured_and_kept(engine):
    ctx = _prompt(engine, "hello")
    free = engine.generate([GenRequest("f", ctx, SamplingParams(max_new_tokens=24, seed=7))])[0].token_ids
    tok = engine.tokenizer
    stop = tok.decode(free[5:7])
    expected = next(k for k in range(1, len(free) + 1) if stop in tok.decode(free[:k]))
    params = SamplingParams(max_new_tokens=24, seed=7, stop=("\x00never", stop))
    gen = engine.generate([GenRequest("s", ctx, params)])[0]
    assert gen.finish_reason == "stop" and gen.stop_string == stop
    assert gen.token_ids == free[:expected] and stop in tok.decode(gen.token_ids)


def test_eos_from_generation_config_list(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    probe = HFEngine(model=model, tokenizer=tok)
    ctx = tok.encode("eos test")
    free = probe.generate([GenRequest(0, ctx, SamplingParams(max_new_tokens=10, temperature=0))])[0].token_ids
    model.generation_config.eos_token_id = [tok.eos_token_id, free[3]]
    eng = HFEngine(model=model, tokenizer=tok)
    gen = eng.generate([GenRequest(0, ctx, SamplingParams(max_new_tokens=10, temperature=0))])[0]
    first = free.index(free[3])
    assert gen.finish_reason == "eos" and gen.token_ids == free[: first + 1]


def test_bad_requests_get_errors_not_exceptions(engine):
    good = GenRequest("ok", _prompt(engine, "fine"), SamplingParams(max_new_tokens=3, seed=0))
    too_long = GenRequest("long-1", [65] * (engine.max_positions + 1), SamplingParams(max_new_tokens=3))
    bad_id = GenRequest("bad-id", [10, 10**6], SamplingParams(max_new_tokens=3))
    empty = GenRequest("empty", [], SamplingParams(max_new_tokens=3))
    gens = engine.generate([too_long, good, bad_id, empty])
    assert [g.finish_reason for g in gens] == ["error", "length", "error", "error"]
    assert "long-1" in gens[0].error and "maximum" in gens[0].error and "bad-id" in gens[2].error
    # at the position limit generation ends with "length" instead of overrunning the positions
    edge = GenRequest("edge", [65] * (engine.max_positions - 2), SamplingParams(max_new_tokens=50, seed=0))
    gen = engine.generate([edge])[0]
    assert gen.finish_reason == "length" and len(gen.token_ids) == 3


def test_lru_capacity_release_and_weight_invalidation(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, kv_cache_capacity_tokens=40)
    reqs = [GenRequest(i, eng.tokenizer.encode("y" * 10), SamplingParams(max_new_tokens=6, seed=i)) for i in range(4)]
    gens = eng.generate(reqs)
    st = eng.stats()
    assert st["kv_evictions"] == 2 and st["kv_cached_tokens"] == 30
    eng.release([gens[3].cache_key])
    assert eng.stats()["kv_cached_tokens"] == 15
    ctx = reqs[2].token_ids + gens[2].token_ids
    # weights change in place (as a shared learner module would): cached KV is stale and must not be used
    with torch.no_grad():
        eng.model.model.norm.weight.mul_(1.5)
    gen = eng.generate([GenRequest("c", ctx, SamplingParams(max_new_tokens=5, seed=0), prefix_key=gens[2].cache_key)])
    st = eng.stats()
    assert st["kv_invalidations"] == 1 and st["prefix_misses"] == 1 and st["reused_tokens"] == 0
    lps, _, _ = _teacher_forced(eng.model, ctx, gen[0].token_ids)
    assert _maxdiff(lps, gen[0].logprobs) < 1e-4
    # load_state_dict: same effect, and the new weights are used
    sd = {k: v.clone() for k, v in eng.model.state_dict().items()}
    sd["model.norm.weight"] = sd["model.norm.weight"] / 1.5
    eng.load_state_dict(sd)
    assert torch.allclose(eng.model.model.norm.weight, sd["model.norm.weight"])
    with pytest.raises(ConfigError, match="does not match the engine's model"):
        eng.load_state_dict({"not.a.weight": torch.zeros(1)})


def test_weights_updated_after_a_fused_optimizer_step(tiny_model_dir):
    # torch's fused AdamW changes a shared module's weights without bumping autograd's version counters: the engine
    # learns of it through weights_updated() (what the Algorithm calls before each rollout) and then decodes with the
    # new weights, in its transposed-linear layout too.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eng = HFEngine(model=model, tokenizer=tok, linear_layout="transposed")
    ctx = tok.encode("fused step")
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    eng.generate([GenRequest(0, ctx, greedy)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.tensor([ctx])).logits.float().pow(2).mean().backward()
    opt.step()
    eng.weights_updated()
    gen = eng.generate([GenRequest(1, ctx, greedy)])[0]
    lps, _, _ = _teacher_forced(model, ctx, gen.token_ids)
    assert _maxdiff(lps, gen.logprobs) < 1e-4


def test_sleep_frees_the_weight_copies_and_stored_kv_and_decoding_resumes(tiny_model_dir):
    # The Algorithm calls engine.sleep() between the rollout and the learner update to lower the update's peak
    # memory: the transposed copies of the linear weights and the stored KV must really be freed, and the next call
    # rebuilds them.
    import gc
    import weakref

    eng = HFEngine(tiny_model_dir, linear_layout="transposed")
    ctx = eng.tokenizer.encode("sleep and wake")
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    first = eng.generate([GenRequest(0, ctx, greedy)])[0]
    copies = [weakref.ref(w) for _, w in eng._transposed._layers]
    assert copies and eng.stats()["kv_cached_tokens"] > 0
    eng.sleep()
    gc.collect()
    assert all(ref() is None for ref in copies) and eng.stats()["kv_cached_tokens"] == 0
    again = eng.generate([GenRequest(1, ctx, greedy)])[0]
    assert again.token_ids == first.token_ids and _maxdiff(again.logprobs, first.logprobs) < 1e-6


def test_topk_logprobs_and_reference_entropy_method(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, entropy_method="topk_sum_lnV")
    req = GenRequest("k", eng.tokenizer.encode("top k"), SamplingParams(max_new_tokens=10, seed=4))
    gen = eng.generate([req])[0]
    assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.token_ids)
    for tok, lp, top, ent in zip(gen.token_ids, gen.logprobs, gen.top_logprobs, gen.entropies):
        ids = [i for i, _ in top]
        assert len(top) in (10, 11) and tok in ids and dict(top)[tok] == pytest.approx(lp)
        assert [v for _, v in top[:10]] == sorted((v for _, v in top[:10]), reverse=True)
        assert ent == pytest.approx(topk_token_term(top))
    full = HFEngine(tiny_model_dir)
    g2 = full.generate([GenRequest("k", req.token_ids, SamplingParams(max_new_tokens=10, seed=4, logprobs_topk=3))])[0]
    assert g2.token_ids == gen.token_ids and all(len(t) in (3, 4) for t in g2.top_logprobs)
    # the truncated per-token term is a lower bound of the exact entropy
    assert all(t <= e + 1e-6 for t, e in zip(gen.entropies, g2.entropies))


def test_bf16_logprob_error_bound(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, dtype="bfloat16")
    ref = HFEngine(tiny_model_dir)
    req = GenRequest("b", eng.tokenizer.encode("bfloat16 check"), SamplingParams(max_new_tokens=16, seed=3))
    gen = eng.generate([req])[0]
    lps, ents, _ = _teacher_forced(ref.model, req.token_ids, gen.token_ids)
    assert _maxdiff(lps, gen.logprobs) < 0.1 and _maxdiff(ents, gen.entropies) < 0.1
    assert all(math.isfinite(x) for x in gen.logprobs)


def test_identical_contexts_are_prefilled_once(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, max_batch_size=2)
    prompt = eng.tokenizer.encode("the same prompt for every initial sample")
    reqs = [
        GenRequest(i, list(prompt) if i != 2 else prompt[:-3], SamplingParams(max_new_tokens=5 + i, seed=i))
        for i in range(5)
    ]
    gens = eng.generate(reqs)
    st = eng.stats()
    assert st["shared_prefills"] == 3
    # the shorter context is the others' leading run: prefilled once, it feeds only its own last token
    assert len(prompt) - 4 >= SHARED_PREFIX_MIN and st["shared_prefix_rows"] == 1
    assert st["prefill_tokens"] == len(prompt) + 1
    assert st["reused_tokens"] == 3 * len(prompt) + len(prompt) - 4
    for req, gen in zip(reqs, gens):  # the same tokens and logprobs as a request decoded alone
        alone = eng.generate([req])[0]
        assert gen.token_ids == alone.token_ids and _maxdiff(gen.logprobs, alone.logprobs) < 1e-5
    assert len({tuple(g.token_ids) for g in gens}) > 1  # each row still samples with its own seed


def test_transposed_linear_layout_matches_native_and_follows_weight_updates(tiny_model_dir):
    fast = HFEngine(tiny_model_dir, linear_layout="transposed")
    native = HFEngine(model=fast.model, tokenizer=fast.tokenizer, linear_layout="native")
    assert HFEngine(tiny_model_dir).linear_layout == "transposed"  # "auto" on CPU
    req = GenRequest("l", fast.tokenizer.encode("layout check"), SamplingParams(max_new_tokens=12, seed=2))
    a, b = fast.generate([req])[0], native.generate([req])[0]
    assert a.token_ids == b.token_ids and _maxdiff(a.logprobs, b.logprobs) < 1e-5
    linears = [m for m in fast.model.modules() if type(m) is torch.nn.Linear]
    assert linears and all("forward" not in vars(m) for m in linears)  # the shared module is left as it was
    # an optimizer-style in-place update of a linear weight: the transposed copies are rebuilt, never stale
    with torch.no_grad():
        fast.model.model.layers[0].mlp.down_proj.weight.mul_(-2.0)
    gen = fast.generate([req])[0]
    lps, _, _ = _teacher_forced(fast.model, req.token_ids, gen.token_ids)
    assert _maxdiff(lps, gen.logprobs) < 1e-4
    assert _maxdiff(lps[:3], a.logprobs[:3]) > 1e-3  # the update really changed the policy


def test_config_errors(tiny_model_dir):
    with pytest.raises(ConfigError, match="linear_layout"):
        HFEngine(tiny_model_dir, linear_layout="column")
    with pytest.raises(ConfigError, match="dtype"):
        HFEngine(tiny_model_dir, dtype="float8")
    with pytest.raises(ConfigError, match="entropy_method"):
        HFEngine(tiny_model_dir, entropy_method="mean")
    with pytest.raises(ConfigError, match="exactly one of model_or_path or model="):
        HFEngine()


@pytest.mark.slow
def test_bf16_smollm2(smollm2_dir):
    eng = HFEngine(smollm2_dir, dtype="bfloat16")
    ref = HFEngine(smollm2_dir)
    ctx = ref.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12*7? Think step by step."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    gen = eng.generate([GenRequest("s", ctx, SamplingParams(max_new_tokens=32, seed=0))])[0]
    lps, ents, _ = _teacher_forced(ref.model, ctx, gen.token_ids)
    err = _maxdiff(lps, gen.logprobs)
    print(f"SmolLM2 bf16 vs fp32: max |dlogprob| = {err:.4f}, max |dentropy| = {_maxdiff(ents, gen.entropies):.4f}")
    assert err < 0.5
