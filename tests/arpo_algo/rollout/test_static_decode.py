"""The static-cache decode path (HFEngine decode="static") against the dynamic path, and the CUDA-graph path on a GPU.

Both engines share one float32 tiny model, so any difference comes from the decode path itself: the tokens must be
identical (greedy and sampled under the same seeds), logprobs, entropies and top logprobs equal within ``TOL``,
across refill (more requests than slots, different lengths and budgets), prefix reuse, shared prefill, stop strings
and per-request max tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from arpo_algo.rollout.engines import build_engine
from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.decode_mode import (
    AUTO_CUDA_GRAPHS,
    available_ram,
    graph_memory_problem,
    kv_bytes,
    static_problem,
)
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_base.errors import ConfigError

TOL = 1e-5


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(dynamic, static) engines over one module, 3 slots each."""
    dyn = HFEngine(tiny_model_dir, max_batch_size=3, decode="dynamic")
    sta = HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=3, decode="static", static_cache_tokens=512)
    return dyn, sta


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _assert_same(a, b, tol: float = TOL) -> None:
    """Two lists of Generations are the same up to floating-point noise in the numbers."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.request_id, x.token_ids, x.finish_reason, x.stop_string) == (
            y.request_id,
            y.token_ids,
            y.finish_reason,
            y.stop_string,
        ), (x, y)
        assert len(x.logprobs) == len(y.logprobs) == len(x.entropies) == len(y.entropies) == len(x.token_ids)
        assert max((abs(u - v) for u, v in zip(x.logprobs, y.logprobs)), default=0.0) < tol
        assert max((abs(u - v) for u, v in zip(x.entropies, y.entropies)), default=0.0) < tol
        assert (x.top_logprobs is None) == (y.top_logprobs is None)
        for tx, ty in zip(x.top_logprobs or [], y.top_logprobs or []):
            assert [i for i, _ in tx] == [i for i, _ in ty]
            assert max(abs(u - v) for (_, u), (_, v) in zip(tx, ty)) < tol


def _mixed_requests(engine, stop: str) -> list[GenRequest]:
    """More requests than slots: different lengths, budgets (0 and 1 included), sampling settings and stops."""
    settings = [
        dict(temperature=0.0),
        dict(seed=1),
        dict(temperature=0.7, top_p=0.9, seed=2),
        dict(temperature=1.3, top_k=5, seed=3, logprobs_topk=4),
        dict(top_k=20, top_p=0.8, seed=4),
        dict(seed=5, stop=("\x00never", stop)),
        dict(temperature=0.0, logprobs_topk=2),
        dict(seed=7),
        dict(seed=8, top_k=1),
    ]
    budgets = [12, 40, 7, 25, 1, 40, 0, 33, 9]
    return [
        GenRequest(
            f"r{i}", _ids(engine, f"request {i}: " + "context " * (1 + 3 * i)), SamplingParams(max_new_tokens=n, **kw)
        )
        for i, (n, kw) in enumerate(zip(budgets, settings))
    ]


def _a_stop(engine) -> str:
    """A stop string that request 5 really produces (a character first seen after its 3rd token)."""
    req = _mixed_requests(engine, "@@")[5]
    free = engine.generate([GenRequest("f", req.token_ids, SamplingParams(max_new_tokens=40, seed=5))])[0]
    text = engine.tokenizer.decode(free.token_ids)
    return next(c for i, c in enumerate(text) if i >= 3 and c.isascii() and c.isalnum() and c not in text[:i])


@pytest.mark.parametrize("entropy_method", ["full", "topk_sum_lnV"])
def test_static_equals_dynamic_across_refill_settings_stops_and_budgets(tiny_model_dir, entropy_method):
    dyn = HFEngine(tiny_model_dir, max_batch_size=3, decode="dynamic", entropy_method=entropy_method)
    sta = HFEngine(
        model=dyn.model,
        tokenizer=dyn.tokenizer,
        max_batch_size=3,
        decode="static",
        static_cache_tokens=512,
        entropy_method=entropy_method,
    )
    reqs = _mixed_requests(dyn, _a_stop(dyn))
    streams: dict[str, list] = {"dynamic": [], "static": []}
    a = dyn.generate(reqs, on_token=lambda rid, tok: streams["dynamic"].append((rid, tok)))
    b = sta.generate(reqs, on_token=lambda rid, tok: streams["static"].append((rid, tok)))
    _assert_same(a, b)
    assert [len(g.token_ids) for g in b][6] == 0 and len(b[4].token_ids) == 1  # per-request budgets
    assert b[5].finish_reason == "stop" and any(g.finish_reason == "length" for g in b)
    for g in b:  # on_token: every token of every request, in order
        assert [t for rid, t in streams["static"] if rid == g.request_id] == g.token_ids
    assert len({tuple(g.token_ids) for g in b}) == len(b)  # the rows really differ (no slot mix-up could pass)
    st = sta.stats()
    assert st["decode_steps"] > 0 and st["generated_tokens"] == sum(len(g.token_ids) for g in b)
    assert st["decode_steps"] < sum(len(g.token_ids) for g in b) - len(b)  # rows decode together, not one by one


def test_static_prefix_reuse_and_shared_prefill_equal_dynamic(pair):
    dyn, sta = pair
    prompt = _ids(dyn, "<|im_start|>user\nsolve it, then call a tool<|im_end|>\n")
    first = [e.generate([GenRequest("p", prompt, SamplingParams(max_new_tokens=10, seed=1))])[0] for e in pair]
    _assert_same(first[:1], first[1:])
    tool = _ids(dyn, " <result>\n42\n</result>")
    outs, stats = [], []
    for eng, head in zip(pair, first):
        eng.stats()
        ctx = prompt + head.token_ids + tool
        branches = [
            GenRequest(f"b{s}", ctx, SamplingParams(max_new_tokens=8 + s, seed=s), prefix_key=head.cache_key)
            for s in range(4)
        ]  # four identical contexts: one prefill on top of the stored prefix, shared
        outs.append(eng.generate(branches))
        stats.append(eng.stats())
    _assert_same(*outs)
    assert stats[1]["prefix_hits"] == 1 and stats[1]["shared_prefills"] == 3
    assert stats[1]["prefill_tokens"] == stats[0]["prefill_tokens"] == len(tool) + 1
    assert stats[1]["reused_tokens"] == stats[0]["reused_tokens"]
    assert len({tuple(g.token_ids) for g in outs[1]}) > 1  # shared KV, own seeds


@pytest.mark.parametrize("which", [0, 1], ids=["dynamic", "static"])
def test_requests_that_join_a_running_call_decode_as_in_a_call_of_their_own(pair, which):
    """``on_finish`` answers with new requests; they join the running call and come out as if sent on their own:
    a continuation on its stored prefix, twins, a refused request, and (static) requests the pass's sampling shape
    or token room cannot hold, decoded in a further pass."""
    eng = pair[which]
    base = [
        GenRequest(f"b{i}", _ids(eng, "base " * (i + 1)), SamplingParams(max_new_tokens=4 + 3 * i, seed=i))
        for i in range(4)
    ]
    twin = _ids(eng, "twins share one context")
    joins = [
        GenRequest("twin0", twin, SamplingParams(max_new_tokens=6, seed=10)),
        GenRequest("twin1", twin, SamplingParams(max_new_tokens=6, seed=11)),
        GenRequest("bad", [], SamplingParams(max_new_tokens=3)),
        GenRequest("nucleus", _ids(eng, "top p"), SamplingParams(max_new_tokens=5, top_p=0.8, seed=12)),
        GenRequest("long", _ids(eng, "a longer budget"), SamplingParams(max_new_tokens=30, seed=13)),
    ]
    seen: list[int] = []

    def on_finish(i, gen):
        seen.append(i)
        if gen.request_id == "b0":  # the first base request's continuation, on its stored KV, and the others
            more = list(base[0].token_ids) + gen.token_ids
            return [
                GenRequest("cont", more, SamplingParams(max_new_tokens=7, seed=14), prefix_key=gen.cache_key),
                *joins,
            ]
        return None

    out = eng.generate(base, on_finish=on_finish)
    assert sorted(seen) == list(range(len(out))) and len(out) == len(base) + 1 + len(joins)
    by_id = {g.request_id: g for g in out}
    assert by_id["bad"].finish_reason == "error" and "empty context" in by_id["bad"].error
    cont = GenRequest(
        "cont", list(base[0].token_ids) + by_id["b0"].token_ids, SamplingParams(max_new_tokens=7, seed=14)
    )
    alone = eng.generate([*base, cont, *[r for r in joins if r.request_id != "bad"]])
    _assert_same([by_id[g.request_id] for g in alone], alone)


def test_static_prefills_the_entering_requests_in_one_forward(tiny_model_dir, monkeypatch):
    """Requests of similar length entering free slots are prefilled together (left-padded, each at its own
    positions, on top of its own stored prefix or none), and equal the dynamic path's one-by-one prefills; a bound on
    the forward's size splits them into more forwards with the same results."""
    from arpo_algo.rollout.engines.hf import slot_prefill

    dyn = HFEngine(tiny_model_dir, max_batch_size=4, decode="dynamic")
    sta = HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=4, decode="static", static_cache_tokens=512)
    heads = {}
    for eng in (dyn, sta):  # two finished requests whose KV each engine stores
        heads[eng] = eng.generate(
            [
                GenRequest(f"h{i}", _ids(dyn, "question " * (2 + 5 * i)), SamplingParams(max_new_tokens=6, seed=i))
                for i in range(2)
            ]
        )

    def batch(eng):  # two continuations after a tool result (prefix reuse) and two fresh prompts, 4 slots
        conts = [
            GenRequest(
                f"c{i}",
                _ids(dyn, "question " * (2 + 5 * i)) + h.token_ids + _ids(dyn, " <result>7</result>"),
                SamplingParams(max_new_tokens=9, seed=10 + i),
                prefix_key=h.cache_key,
            )
            for i, h in enumerate(heads[eng])
        ]
        fresh = [
            GenRequest(
                f"f{i}",
                _ids(dyn, "a fresh prompt " + "ok " * (2 * i)),  # about the suffixes' size
                SamplingParams(max_new_tokens=7, temperature=0.0 if i else 0.8, seed=20 + i),
            )
            for i in range(2)
        ]
        return conts + fresh

    dyn.stats(), sta.stats()
    want = dyn.generate(batch(dyn))
    got = sta.generate(batch(sta))
    _assert_same(want, got)
    st = sta.stats()
    assert st["prefix_hits"] == 2 and st["prefill_forwards"] == 1  # four requests, one forward
    assert st["prefill_tokens"] == dyn.stats()["prefill_tokens"]  # the same tokens fed: the prefixes were reused
    monkeypatch.setattr(slot_prefill, "PREFILL_TOKENS", 24)  # fewer positions per forward than the four need
    again = sta.generate(batch(sta))
    assert sta.stats()["prefill_forwards"] >= 3
    _assert_same(want, again)


@pytest.mark.parametrize("decode,slots", [("dynamic", 6), ("static", 6), ("dynamic", 2), ("static", 2)])
def test_a_shared_leading_run_is_prefilled_once(tiny_model_dir, decode, slots):
    """Fresh prompts that share a long leading run (a system prompt) get it prefilled once and reused by the others
    (static: copied into their slots), also when they enter in different refills (2 slots): the same tokens as each
    request generated alone, and the run is fed once. A row whose whole context is the run still feeds its last
    token; a row that shares nothing is fed whole; token ids may come as a tuple."""
    from arpo_algo.rollout.engines.hf import slot_prefill

    alone = HFEngine(tiny_model_dir, max_batch_size=6, decode="dynamic")
    eng = HFEngine(
        model=alone.model, tokenizer=alone.tokenizer, max_batch_size=slots, decode=decode, static_cache_tokens=512
    )
    system = _ids(
        eng, "<|im_start|>system\nYou solve problems step by step. " + "Think carefully. " * 8 + "<|im_end|>\n"
    )
    assert len(system) > slot_prefill.SHARED_PREFIX_MIN
    asks = ["what is two plus two", "name a prime above ten", "how long is a year on mars", "spell seven"]
    contexts = [system + _ids(eng, q) for q in asks] + [system, _ids(eng, "an unrelated short prompt")]
    reqs = [
        GenRequest(
            f"q{i}",
            ctx if i != 2 else tuple(ctx),
            SamplingParams(max_new_tokens=8, temperature=0.0 if i == 1 else 1.0, seed=i),
        )
        for i, ctx in enumerate(contexts)
    ]
    want = [alone.generate([r])[0] for r in reqs]  # one request per call: nothing shared
    assert alone.stats().get("shared_prefix_rows", 0) == 0
    got = eng.generate(reqs)
    _assert_same(want, got)
    assert len({tuple(g.token_ids) for g in got}) > 1
    st = eng.stats()
    run = len(system) - 1  # the system-only row keeps its last token to feed
    assert st["shared_prefix_rows"] == 4  # five rows share the run: one prefills it, four reuse it
    assert st["prefill_tokens"] == sum(map(len, contexts)) - 4 * run and st["reused_tokens"] == 4 * run
    if decode == "static" and slots == 6:
        assert st["prefill_forwards"] == 2  # the run, then every row's own tokens together
    again = eng.generate(reqs)  # a new call plans and makes its runs again
    _assert_same(want, again)
    assert eng.stats()["shared_prefix_rows"] == 4


def test_shared_runs_group_neighbours_above_the_minimum():
    from arpo_algo.rollout.engines.hf.slot_prefill import SHARED_PREFIX_MIN, shared_runs

    a, b = list(range(100, 100 + SHARED_PREFIX_MIN + 5)), list(range(500, 500 + SHARED_PREFIX_MIN))
    contexts = [
        a + [1, 2],
        b + [3],
        a + [4],
        b + [5, 6],
        a[: SHARED_PREFIX_MIN - 1] + [7, 8],  # shares too short a run with the a-rows
        None,  # takes no part (fed on top of a stored prefix)
        [11] * 50,
    ]
    assert sorted(shared_runs(contexts)) == sorted([(len(a), [0, 2]), (len(b), [1, 3])])
    assert shared_runs([a, a[: SHARED_PREFIX_MIN + 1]]) == [(SHARED_PREFIX_MIN, [1, 0])]  # one token left to feed
    assert shared_runs([a, None, tuple(a + [1])]) == [(len(a) - 1, [0, 2])]  # any sequence type
    # five rows sharing 100 tokens and one sharing only 40 of them: the five keep their 100-token run
    c = list(range(1000, 1100))
    many = [c + [i] for i in range(5)] + [c[:40] + [7]]
    assert shared_runs(many) == [(100, [0, 1, 2, 3, 4])]


def test_forward_groups_pad_rows_only_to_neighbours_of_similar_length():
    from arpo_algo.rollout.engines.hf.slot_prefill import FORWARD_COST_POSITIONS, PREFILL_TOKENS, forward_groups

    assert forward_groups([]) == []
    assert forward_groups([5, 5, 6]) == [3]  # similar lengths: one forward
    assert forward_groups([5, 5, 6, 60, 61]) == [3, 5]  # not padding three short rows to 61
    assert forward_groups([10, 10 + FORWARD_COST_POSITIONS // 2]) == [2]  # padding cheaper than another forward
    cap = PREFILL_TOKENS // 4
    assert forward_groups([cap] * 5) == [4, 5]  # at most PREFILL_TOKENS positions per forward
    assert forward_groups([1, PREFILL_TOKENS + 10]) == [1, 2]  # a row above the bound still gets its forward


def test_static_rows_cross_column_buckets_and_stop_at_the_context_limit(tiny_model_dir):
    dyn = HFEngine(tiny_model_dir, max_batch_size=2, decode="dynamic")
    sta = HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=2, decode="static", static_cache_tokens=150)
    assert sta.max_context == 150 and dyn.max_context == 4096
    long = GenRequest("long", [65 + i % 26 for i in range(50)], SamplingParams(max_new_tokens=90, seed=3))
    short = GenRequest("short", _ids(dyn, "tiny"), SamplingParams(max_new_tokens=5, seed=4))
    _assert_same(dyn.generate([short, long]), sta.generate([short, long]))  # 50 + 90 crosses 64 and 128 columns
    edge = GenRequest("edge", [66] * 146, SamplingParams(max_new_tokens=50, seed=0))
    over = GenRequest("over", [66] * 151, SamplingParams(max_new_tokens=5))
    res = sta.generate([edge, over])
    assert res[0].finish_reason == "length" and len(res[0].token_ids) == 5  # 150 - 146 + 1: the last is never fed
    assert res[1].finish_reason == "error" and "150" in res[1].error


def test_sleep_frees_the_static_kv_cache_and_decoding_resumes(tiny_model_dir):
    """The Algorithm calls engine.sleep() before each learner update: on the static path the slot buffers (the whole
    static KV cache) are freed too, and the next call rebuilds them with the same results."""
    import gc
    import weakref

    eng = HFEngine(tiny_model_dir, decode="static", max_batch_size=3, static_cache_tokens=256)
    reqs = _mixed_requests(eng, _a_stop(eng))
    first = eng.generate(reqs)
    buffers = [weakref.ref(b) for b in eng.static_decoder.keys + eng.static_decoder.values]
    assert buffers
    eng.sleep()
    gc.collect()
    assert all(ref() is None for ref in buffers)
    _assert_same(first, eng.generate(reqs), tol=1e-6)
    assert eng.static_decoder.keys


def test_engines_pass_the_kv_cache_under_the_forwards_own_name(pair):
    """Every forward of both paths (the dynamic prefill and step, the static buffers' probe, its batched prefill and
    step) passes the cache under the keyword this transformers names it, so none goes through the deprecated alias
    that a later release removes."""
    dyn, _ = pair
    fresh = HFEngine(
        model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=2, decode="static", static_cache_tokens=256
    )  # a new decoder: its buffers are probed by a forward on first use
    reqs = [
        GenRequest(f"w{i}", _ids(dyn, f"warn {i}: " + "context " * i), SamplingParams(max_new_tokens=6, seed=i))
        for i in range(3)
    ]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for eng in (dyn, fresh):
            assert [len(g.token_ids) for g in eng.generate(reqs)] == [6, 6, 6]
    assert not [w for w in seen if "past_key_values" in str(w.message)], [str(w.message) for w in seen]


def test_static_follows_in_place_weight_updates(pair):
    dyn, sta = pair
    req = GenRequest("w", _ids(dyn, "weights move "), SamplingParams(max_new_tokens=16, temperature=0.0))
    before = sta.generate([req])[0]
    norm = dyn.model.model.norm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.mul_(torch.linspace(0.2, 3.0, norm.numel()))  # in place, as a shared learner's optimizer step
        after = [e.generate([req])[0] for e in pair]
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    _assert_same(after[:1], after[1:])
    assert after[1].logprobs != pytest.approx(before.logprobs, abs=1e-3)  # the update really reached the step


def test_static_with_eager_attention_equals_dynamic(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    dyn = HFEngine(model=model, tokenizer=tok, max_batch_size=3, decode="dynamic")
    sta = HFEngine(model=model, tokenizer=tok, max_batch_size=3, decode="static", static_cache_tokens=256)
    reqs = [
        GenRequest(i, _ids(dyn, "eager " * (i + 1)), SamplingParams(max_new_tokens=6 + 3 * i, seed=i)) for i in range(5)
    ]
    _assert_same(dyn.generate(reqs), sta.generate(reqs))


def test_the_step_folds_grouped_query_heads_and_leaves_the_model_as_it_was(pair):
    """Decode steps run their attention through ``folded_sdpa`` (one query token per row, the query heads that share
    a key head folded into SDPA's query length), which equals attention over the key/value heads repeated per query
    head; the shared model's attention setting is "sdpa" again after a static call and after a block that raised (a
    learner's forward must never run under the step's setting)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    from arpo_algo.rollout.engines.hf.static_decode import FOLDED_SDPA, folded_attention, folded_sdpa

    dyn, sta = pair
    attn = dyn.model.model.layers[0].self_attn
    groups = attn.num_key_value_groups
    assert groups > 1  # the tiny model has grouped-query attention
    gen = torch.Generator().manual_seed(0)
    rows, kv, dim, cols = 3, dyn.model.config.num_key_value_heads, 16, 11
    q = torch.randn(rows, kv * groups, 1, dim, generator=gen)
    k, v = (torch.randn(rows, kv, cols, dim, generator=gen) for _ in range(2))
    mask = (torch.arange(cols)[None, :] <= torch.tensor([3, 10, 6])[:, None])[:, None, None, :]
    ours, _ = folded_sdpa(attn, q, k, v, mask, scaling=dim**-0.5)
    ref = F.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=dim**-0.5
    ).transpose(1, 2)
    assert ours.shape == ref.shape == (rows, 1, kv * groups, dim)
    assert torch.allclose(ours, ref, atol=1e-6)
    seen = []  # (query length, the attention setting) of every forward of the first attention layer
    hook = attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((kwargs["hidden_states"].shape[1], mod.config._attn_implementation)),
        with_kwargs=True,
    )
    try:
        sta.generate([GenRequest("a", _ids(sta, "fold"), SamplingParams(max_new_tokens=3, seed=0))])
    finally:
        hook.remove()
    assert {impl for n, impl in seen if n == 1} == {FOLDED_SDPA} and len(seen) >= 3  # the decode steps, folded
    assert dyn.model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with folded_attention(dyn.model):
            assert dyn.model.config._attn_implementation == FOLDED_SDPA
            raise RuntimeError("inside")
    assert dyn.model.config._attn_implementation == "sdpa"


def test_decode_option_errors_and_auto(tiny_model_dir, pair):
    dyn, _ = pair
    assert HFEngine(model=dyn.model, tokenizer=dyn.tokenizer).decode == "dynamic"  # "auto" on CPU
    with pytest.raises(ConfigError, match="needs a CUDA device") as err:
        HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, decode="cuda_graph")
    assert "static" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="unknown decode"):
        HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, decode="graphs")
    with pytest.raises(ConfigError, match="static_cache_tokens"):
        HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, decode="static", static_cache_tokens=1)
    # a static cache larger than the RAM available now is refused when the engine is made, not at its first call
    slots = available_ram() // kv_bytes(dyn.model, 1, dyn.max_positions) + 1
    with pytest.raises(ConfigError, match=r"static KV cache needs .* GiB free") as err:
        HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, decode="static", max_batch_size=slots)
    assert "static_cache_tokens" in err.value.hint
    with pytest.raises(ConfigError, match="cuda_graph"):
        build_engine("hf", model_or_path=str(tiny_model_dir), decode="cuda_graph")
    # what "auto" checks before it picks cuda_graph on a GPU (and what an explicit request is refused for)
    assert static_problem(dyn.model, "native", graphs=True) is None
    assert "transposed" in static_problem(dyn.model, "transposed", graphs=True)
    assert static_problem(dyn.model, "transposed", graphs=False) is None  # eager static steps may use the copies
    # "auto" leaves CUDA graphs alone where their static cache would take more than a quarter of the free memory
    assert graph_memory_problem(2 * 2**30, 8 * 2**30) is None
    assert "2.1 GiB, more than 25% of the 8.0 GiB free" in graph_memory_problem(2 * 2**30 + 10**8, 8 * 2**30)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_dynamic_on_gpu(tiny_model_dir):
    dyn = HFEngine(tiny_model_dir, device="cuda", max_batch_size=3, decode="dynamic")
    graph = HFEngine(
        model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=3, decode="cuda_graph", static_cache_tokens=512
    )
    assert AUTO_CUDA_GRAPHS
    assert HFEngine(model=dyn.model, tokenizer=dyn.tokenizer).decode == "cuda_graph"
    # a static cache over a quarter of the free memory: auto decodes dynamically (nothing allocated for the slots)
    free = torch.cuda.mem_get_info()[0]
    slots = int(free / kv_bytes(dyn.model, 1, dyn.max_positions)) + 1
    assert HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=slots).decode == "dynamic"
    reqs = _mixed_requests(dyn, _a_stop(dyn))
    a = dyn.generate(reqs)
    graph.stats()
    b = graph.generate(reqs)
    _assert_same(a, b, tol=1e-4)  # CUDA kernels differ with the key length (dynamic width vs column bucket)
    st = graph.stats()
    assert st["graph_captures"] >= 1 and st["graph_replays"] == st["decode_steps"] > st["graph_captures"]
    again = graph.generate(reqs)  # replays the captured graphs, captures nothing new
    _assert_same(b, again, tol=1e-12)  # replays are deterministic
    assert graph.stats().get("graph_captures", 0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_writes_each_rows_new_key_and_value_at_its_position_only(dtype):
    """The decode step's KV write (indexed on the CPU, where scatter_ copies a whole bf16 buffer): every row's token
    lands at its own column, nothing else in the buffer changes, bit for bit what scatter_ writes."""
    from arpo_algo.rollout.engines.hf.slot_prefill import write_rows

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(5, 3, 16, 8, generator=g).to(dtype)
    states = torch.randn(5, 3, 1, 8, generator=g).to(dtype)
    pos = torch.tensor([0, 15, 7, 7, 3])
    want = buf.clone().scatter_(2, pos[:, None, None, None].expand(-1, 3, 1, 8), states)
    write_rows(buf, torch.arange(5), pos, states)
    assert torch.equal(buf, want)
    assert [torch.equal(buf[r, :, p], states[r, :, 0]) for r, p in enumerate(pos.tolist())] == [True] * 5
