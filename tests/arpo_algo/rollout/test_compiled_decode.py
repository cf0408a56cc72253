"""The compiled decode step (HFEngine decode="compiled") against the dynamic path, across learner updates.

One compiled engine for the whole module, sharing its float32 tiny model with a dynamic engine; its static cache
holds 128 tokens, and it compiles one graph (symbolic in the columns) for the one sampling shape every call here uses
(the settings of :data:`SETTINGS`). Tokens must equal the dynamic path's except at near-ties (the two paths sum
in different orders; a token may differ only where the dynamic path's top two log-probs are within ``TIE_TOL``, and
the test reports how many such ties it met), and logprobs/entropies/top logprobs within ``TOL``. Weights change in
place between calls (an optimizer step on the shared module, ``load_state_dict``): the compiled step must read the
new weights and compile nothing new, with the CPU's default transposed layout and with the native one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.compiled_step import compiler_problem
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_base.errors import ConfigError

pytestmark = pytest.mark.skipif(compiler_problem() is not None, reason=f"no C++ compiler: {compiler_problem()}")

TOL = 1e-5
TIE_TOL = 1e-4
#: One sampling shape for every call (greedy, seeded, top-k, top-p, top logprobs, a stop string): one graph.
SETTINGS = [
    dict(temperature=0.0),
    dict(seed=1),
    dict(temperature=0.7, top_p=0.9, seed=2),
    dict(temperature=1.3, top_k=5, seed=3, logprobs_topk=4),
    dict(top_k=20, top_p=0.8, seed=4),
    dict(seed=5, stop=("\x00never",)),
    dict(temperature=0.0, logprobs_topk=2),
    dict(seed=7),
]


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Inductor's code cache in one folder for the module (compiled kernels are reused, not rebuilt per test)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(dynamic, compiled) engines over one module, 3 slots each, the default (transposed on CPU) layout."""
    dyn = HFEngine(tiny_model_dir, max_batch_size=3, decode="dynamic")
    com = HFEngine(
        model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=3, decode="compiled", static_cache_tokens=128
    )
    assert com.linear_layout == "transposed" and com.static_decoder.bucket_columns(1) == 8
    yield dyn, com
    com.close()


def _requests(engine, tag: str = "", budgets=(12, 40, 7, 25, 1, 30, 0, 33)) -> list[GenRequest]:
    """More requests than slots: different prompt lengths, budgets (0 and 1 included) and the shared settings."""
    return [
        GenRequest(
            f"{tag}r{i}",
            engine.tokenizer.encode(f"q{i} " + "ab " * (2 * i), add_special_tokens=False),
            SamplingParams(max_new_tokens=n, **kw),
        )
        for i, (n, kw) in enumerate(zip(budgets, SETTINGS))
    ]


def _top2_gap(model, ctx: list[int], new: list[int], n: int) -> float:
    """The gap between the two best log-probs of ``model`` at the ``n``-th new token (teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([ctx + new[:n]], device=model.device)).logits[0, -1].double()
    top = torch.log_softmax(logits, -1).topk(2).values
    return float(top[0] - top[1])


def _assert_close(a, b, reqs, model, tol: float = TOL) -> int:
    """``b`` equals ``a`` (tokens up to near-ties of the reference, numbers within ``tol``); returns the near-ties."""
    ties = 0
    for x, y, r in zip(a, b, reqs, strict=True):
        assert x.request_id == y.request_id
        n = next((i for i, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v), None)
        if n is not None:  # allowed only where the two best tokens tie (after that the rows go their own ways)
            assert r.params.temperature == 0 and _top2_gap(model, r.token_ids, x.token_ids, n) <= TIE_TOL, (x, y)
            ties += 1
            continue
        assert (x.token_ids, x.finish_reason, x.stop_string) == (y.token_ids, y.finish_reason, y.stop_string)
        assert max((abs(u - v) for u, v in zip(x.logprobs + x.entropies, y.logprobs + y.entropies)), default=0) < tol
        for tx, ty in zip(x.top_logprobs or [], y.top_logprobs or []):
            assert [i for i, _ in tx] == [i for i, _ in ty]
            assert max(abs(u - v) for (_, u), (_, v) in zip(tx, ty)) < tol
    return ties


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_equals_dynamic_across_refill_settings_stops_and_budgets(pair):
    dyn, com = pair
    reqs = _requests(dyn)
    free = dyn.generate([reqs[5]])[0]  # a stop string request 5 really produces: a character new after token 3
    text = dyn.tokenizer.decode(free.token_ids)
    stop = next(c for i, c in enumerate(text) if i >= 3 and c.isascii() and c.isalnum() and c not in text[:i])
    reqs[5] = GenRequest(
        reqs[5].request_id, reqs[5].token_ids, dataclasses.replace(reqs[5].params, stop=(*reqs[5].params.stop, stop))
    )
    streams: dict[str, list] = {"dynamic": [], "compiled": []}
    a = dyn.generate(reqs, on_token=lambda rid, tok: streams["dynamic"].append((rid, tok)))
    graphs = _graphs()
    b = com.generate(reqs, on_token=lambda rid, tok: streams["compiled"].append((rid, tok)))
    # one graph for every column count the call's steps ran at (rows of 2 to 75 tokens: steps from 8 to 80 columns)
    assert _graphs() - graphs == 1
    assert max(len(r.token_ids) + len(g.token_ids) for r, g in zip(reqs, b)) > 64 > len(reqs[0].token_ids) + 8
    ties = _assert_close(a, b, reqs, dyn.model)
    print(f"near-ties: {ties} of {len(reqs)} requests")  # shown with pytest -s
    assert len(b[6].token_ids) == 0 and len(b[4].token_ids) == 1  # per-request budgets
    assert b[5].finish_reason == "stop" and any(g.finish_reason == "length" for g in b)
    for g in b:  # on_token: every token of every request, in order
        assert [t for rid, t in streams["compiled"] if rid == g.request_id] == g.token_ids
    st = com.stats()
    assert st["decode_steps"] < sum(len(g.token_ids) for g in b) - len(b)  # rows decode together
    assert st["compiles"] == 1 and st["compile_seconds"] > 0  # paid once, reported
    assert com.static_decoder.compiled.compile_seconds  # by shape, for the log and the benchmark


def test_compiled_prefix_reuse_and_seeds_equal_dynamic(pair):
    dyn, com = pair
    heads = _requests(dyn, "p", budgets=(6,) * 8)
    first = [e.generate(heads) for e in pair]
    _assert_close(*first, heads, dyn.model)
    tool = dyn.tokenizer.encode(" <result>42</result>", add_special_tokens=False)
    outs, stats = [], []
    for eng, gens in zip(pair, first):  # continue every head after a tool result, on top of its stored KV
        eng.stats()
        conts = [
            GenRequest(f"c{i}", h.token_ids + g.token_ids + tool, h.params, prefix_key=g.cache_key)
            for i, (h, g) in enumerate(zip(heads, gens))
        ]
        outs.append(eng.generate(conts))
        stats.append(eng.stats())
    _assert_close(*outs, conts, dyn.model)
    assert stats[1]["prefix_hits"] == stats[0]["prefix_hits"] > 0
    assert stats[1]["reused_tokens"] == stats[0]["reused_tokens"] > 0
    again = com.generate(heads)  # the same seeds give the same samples
    assert [g.token_ids for g in again] == [g.token_ids for g in first[1]]
    assert com.stats().get("compiles", 0) == 0  # nothing new to compile: same rows, same sampling shape
    graphs = _graphs()  # the bare step the benchmark times is the loop's step: same layout, same graph
    assert com.static_decoder.time_step(3, 50, com.static_decoder._call_shape(heads), repeats=1) > 0
    assert _graphs() == graphs


def test_compiled_rows_reach_the_context_on_the_same_graph(pair):
    """A step that attends over the whole context (a row at the 128-token limit) runs the graph compiled for shorter
    steps: the slot buffers keep a spare column, so no slice spans a whole buffer (which dynamo would specialise)."""
    dyn, com = pair
    short = _requests(dyn, "s", budgets=(3,) * 8)
    com.generate(short)
    com.stats()
    graphs = _graphs()
    long = [
        GenRequest(
            f"l{i}",
            r.token_ids + dyn.tokenizer.encode("x" * (90 - len(r.token_ids)), add_special_tokens=False),
            r.params,
        )
        for i, r in enumerate(_requests(dyn, budgets=(60,) * 8))
    ]
    a, b = dyn.generate(long), com.generate(long)
    ends = [len(g.token_ids) for g in b]  # the dynamic engine's context is the model's: compare up to the slot's end
    a = [
        dataclasses.replace(
            x,
            token_ids=x.token_ids[:n],
            logprobs=x.logprobs[:n],
            entropies=x.entropies[:n],
            top_logprobs=x.top_logprobs and x.top_logprobs[:n],
            finish_reason=y.finish_reason,
            stop_string=y.stop_string,
        )
        for x, y, n in zip(a, b, ends)
    ]
    _assert_close(a, b, long, dyn.model)
    # a row filled its slot: its last step attended over all 128 columns and sampled token 129 (never fed)
    assert any(len(r.token_ids) + n == 129 for r, n in zip(long, ends))
    assert _graphs() == graphs and com.stats().get("compiles", 0) == 0


def _learner_step(model, reqs) -> None:
    """One SGD step on the shared module, in place (as a colocated learner's optimizer does)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.tensor([reqs[1].token_ids], device=model.device)
    model.train()
    model(batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


@pytest.mark.parametrize("layout", ["transposed", "native"])
def test_compiled_follows_in_place_weight_updates_without_recompiling(pair, layout):
    dyn, com = pair
    if layout == "native":  # the same module through the native layout: its own graphs, compiled here once
        com = HFEngine(
            model=dyn.model,
            tokenizer=dyn.tokenizer,
            max_batch_size=3,
            decode="compiled",
            static_cache_tokens=128,
            linear_layout="native",
        )
    reqs = _requests(dyn, "w", budgets=(8,) * 8)  # one graph per layout (the native one compiled here once)
    saved = {k: v.clone() for k, v in dyn.model.state_dict().items()}
    com.stats()
    before = com.generate(reqs)
    if layout == "native":  # the other layout's guards fail: a new graph, counted and timed as a compile
        assert com.stats()["compiles"] == 1
    graphs = _graphs()
    try:
        for update in range(3):
            if update < 2:
                _learner_step(dyn.model, reqs)
                for eng in (dyn, com):
                    eng.weights_updated()
            else:  # load_state_dict copies into the same tensors
                com.load_state_dict({k: v * 1.05 if v.is_floating_point() else v for k, v in saved.items()})
                dyn.weights_updated()
            a, b = dyn.generate(reqs), com.generate(reqs)
            _assert_close(a, b, reqs, dyn.model)
        assert b[0].logprobs != pytest.approx(before[0].logprobs, abs=1e-3)  # the updates really reached the step
        assert _graphs() == graphs  # zero recompiles across the updates
    finally:
        dyn.model.load_state_dict(saved)
        dyn.weights_updated()
        if layout == "native":
            com.close()
        else:
            com.weights_updated()


def test_compiled_columns_and_errors(pair):
    from torch._inductor import config

    dyn, com = pair
    assert [com.static_decoder.bucket_columns(n) for n in (1, 100, 127, 128)] == [8, 104, 128, 128]
    with config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        with pytest.raises(ConfigError, match="C\\+\\+ compiler.*nonexistent") as err:
            HFEngine(model=dyn.model, tokenizer=dyn.tokenizer, decode="compiled", static_cache_tokens=128)
    assert "static" in (err.value.hint or "") and "doctor" in err.value.hint
    from arpo_algo.rollout.engines.config import HFEngineConfig

    HFEngineConfig(decode="compiled").check_device("cpu")
    HFEngineConfig(decode="compiled", linear_layout="transposed").check_device("cpu")
    HFEngineConfig(decode="compiled").check_device("cuda")  # captured as CUDA graphs there, from the native weights
    with pytest.raises(ConfigError, match="'compiled' on CUDA with linear_layout='transposed'"):
        HFEngineConfig(decode="compiled", linear_layout="transposed").check_device("cuda")


def test_compiled_on_a_cuda_device_needs_triton_and_the_native_layout(pair, monkeypatch):
    """The refusals for a CUDA device, decided from the device and the model's config (no GPU needed to ask)."""
    import torch.utils._triton

    from arpo_algo.rollout.engines.hf.decode_mode import resolve_decode

    model, cuda = pair[0].model, torch.device("cuda")
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    assert "Triton" in compiler_problem("cuda")
    assert compiler_problem("cpu") is None  # the CPU's code generation needs only the C++ compiler
    with pytest.raises(ConfigError, match="cannot compile for cuda: Triton") as err:
        resolve_decode("compiled", cuda, model, "native")
    assert "triton" in err.value.hint and "'cuda_graph'" in err.value.hint
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    assert resolve_decode("compiled", cuda, model, "native") == "compiled"
    with pytest.raises(ConfigError, match="'compiled' on CUDA"):  # captured there: the copies would move under it
        resolve_decode("compiled", cuda, model, "transposed")
    assert resolve_decode("compiled", torch.device("cpu"), model, "transposed") == "compiled"


#: One CPU compile of a sampling-like step (softmax, its log, a running sum over a 4,099-wide row) by the engine's
#: CompiledStep, in a process of its own; prints the vector width it compiled for and its largest difference from eager.
_VECTOR_WIDTH_STEP = """
import json
from collections import Counter
import torch
from arpo_algo.rollout.engines.hf.compiled_step import CompiledStep, cpu_vector_bits
torch.set_num_threads(2)
x = torch.randn(6, 4099, generator=torch.Generator().manual_seed(0))
res = torch.zeros(6, 4099)
def values(rows, length):
    return torch.softmax(x[:rows, :length] * 1.3, -1).cumsum(-1) + torch.log_softmax(x[:rows, :length], -1)
def body(rows, length, shape, res):
    res[:rows, :length] = values(rows, length)
step = CompiledStep(body, Counter())
diff = 0.0
for rows, length in ((6, 4099), (4, 4000)):
    step(rows, length, None, res)
    wrong = (res[:rows, :length] - values(rows, length)).abs().nan_to_num(nan=float("inf"))
    diff = max(diff, float(wrong.max()))
print(json.dumps({"bits": cpu_vector_bits(), "max_diff": diff}))
"""


def test_a_cpu_compile_cached_for_another_vector_width_is_not_reused(tmp_path):
    """Inductor's on-disk cache leaves the CPU's instruction set out of its key, while the C++ of a cached graph is
    built for the present one: two processes sharing ``TORCHINDUCTOR_CACHE_DIR``, the first compiling for AVX-512
    and the second under ``ATEN_CPU_CAPABILITY=avx2`` (as an AVX2 machine would), must each compute what eager
    does (a loop written 16 floats wide and built for 8-float vectors gives wrong numbers, or hangs)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if not any(isa.bit_width() == 512 for isa in valid_vec_isa_list()):
        pytest.skip("needs a CPU with AVX-512: with one vector width there is one kind of cached code to share")
    # the caches on (a process told to skip them would pass without sharing anything), no inherited instruction set
    off = {
        "ATEN_CPU_CAPABILITY",
        "TORCHINDUCTOR_FX_GRAPH_CACHE",
        "TORCHINDUCTOR_AUTOGRAD_CACHE",
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
        "TORCHINDUCTOR_VEC_ISA_OK",
    }
    env = {k: v for k, v in os.environ.items() if k not in off}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    seen = []
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        out = subprocess.run(
            [sys.executable, "-c", _VECTOR_WIDTH_STEP],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert [s["bits"] for s in seen] == [512, 256]
    assert [s["max_diff"] < 1e-5 for s in seen] == [True, True], seen


@pytest.mark.gpu
def test_compiled_on_gpu_is_captured_equals_dynamic_and_follows_updates(tiny_model_dir):
    """On CUDA the compiled step is captured as CUDA graphs: it equals the dynamic path (tokens up to near-ties,
    numbers within 1e-4 as for the eager step's graphs: CUDA kernels differ with the key length), a second call
    compiles and captures nothing, and an in-place learner step reaches the replays with no recompile and without
    capturing the graphs it already had again."""
    if compiler_problem("cuda"):
        pytest.skip(f"decode='compiled' cannot compile for CUDA here: {compiler_problem('cuda')}")
    dyn = HFEngine(tiny_model_dir, device="cuda", max_batch_size=3, decode="dynamic")
    com = HFEngine(
        model=dyn.model, tokenizer=dyn.tokenizer, max_batch_size=3, decode="compiled", static_cache_tokens=512
    )
    assert com.static_decoder.graphs and com.linear_layout == "native"
    saved = {k: v.clone() for k, v in dyn.model.state_dict().items()}
    try:
        reqs = _requests(dyn, "g")
        a = dyn.generate(reqs)
        com.stats()
        b = com.generate(reqs)
        st = com.stats()
        print(f"near-ties: {_assert_close(a, b, reqs, dyn.model, tol=1e-4)} of {len(reqs)} requests")
        assert st["compiles"] == 1 and st["compile_seconds"] > 0
        assert st["graph_captures"] >= 1 and st["graph_replays"] == st["decode_steps"] > st["graph_captures"]
        again = com.generate(reqs)  # seeded rows, replayed graphs: the same samples
        assert [g.token_ids for g in again] == [g.token_ids for g in b]
        st = com.stats()
        assert st.get("compiles", 0) == 0 and st.get("graph_captures", 0) == 0 and st["graph_replays"] > 0
        graphs, captured = _graphs(), dict(com.static_decoder._graphs)
        _learner_step(dyn.model, reqs)
        for eng in (dyn, com):
            eng.weights_updated()
        a, c = dyn.generate(reqs), com.generate(reqs)
        _assert_close(a, c, reqs, dyn.model, tol=1e-4)
        assert c[0].logprobs != pytest.approx(b[0].logprobs, abs=1e-3)  # the update reached the replays
        assert _graphs() == graphs  # no recompile
        # the graphs captured before the update are replayed, not captured again (new rows after the update may
        # reach a column bucket the first calls did not, and that one is captured)
        assert all(com.static_decoder._graphs.get(k) is g for k, g in captured.items())
    finally:
        com.close()
        dyn.model.load_state_dict(saved)


@pytest.mark.gpu
def test_the_compiled_step_writes_keys_and_values_in_place_on_the_gpu():
    """Compiled for CUDA, the step's KV write allocates nothing near the size of the buffer and writes what eager
    ``scatter_`` writes (inductor turns ``scatter_`` into an out-of-place copy of the whole buffer and a copy back:
    two passes over every layer's keys and values each step)."""
    if compiler_problem("cuda"):
        pytest.skip(f"nothing compiles for CUDA here: {compiler_problem('cuda')}")
    from arpo_algo.rollout.engines.hf.slot_prefill import write_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(32, 3, 512, 64, device="cuda", generator=g).to(torch.bfloat16)
    states = torch.randn(32, 3, 1, 64, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 512, (32,), device="cuda", generator=g)
    rows = torch.arange(32, device="cuda")
    want = buf.clone().scatter_(2, pos[:, None, None, None].expand(-1, 3, 1, 64), states)
    write = torch.compile(write_rows, fullgraph=True)
    write(buf.clone(), rows, pos, states)  # compiles outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    write(buf, rows, pos, states)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < buf.nbytes // 8
    assert torch.equal(buf, want)
