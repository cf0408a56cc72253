"""Benchmark: HFEngine against ``model.generate`` on agentic-rollout workloads (CPU, same threads, side by side).

Scenarios (equal batch size and sampling settings on both sides; throughput counts *useful* tokens only, i.e. each
request's tokens up to its own EOS, stop string or ``max_new_tokens``, because that is what a rollout keeps):

1. ``refill``: 16 requests with varied prompt lengths, varied per-request ``max_new_tokens`` and a stop string.
   ``generate`` runs them in fixed batches (each batch lasts as long as its longest member, with the batch-wide
   maximum ``max_new_tokens``); the engine refills finished rows from the queue.
2. ``tool_continuation``: after a first segment, 20 "tool result" tokens are appended and generation continues.
   The engine reuses the cached KV of the first segment (``prefix_key``) and prefills only the tool tokens;
   ``generate`` re-prefills the whole context. Only the continuation is timed.

3. ``rollout`` (with ``--rollout-model``): a real ARPO sampling step on ToolMath (``TreeSampler``, budget 8, 4 initial
   samples, level-3 tasks, real Python tool). The baseline is :class:`GenerateEngine`, the same ``RolloutEngine``
   interface on ``model.generate`` (fixed batches, batch-wide ``max_new_tokens``, stop strings, raw logits for
   logprobs and entropies, the whole context prefilled on every call). The trees differ (different random draws),
   so the figure is tokens the sampler received per second of engine time.

The engine runs twice on the same module, with ``linear_layout="transposed"`` (the CPU default) and ``"native"``,
so the table separates what the weight layout buys from what refill and prefix reuse buy.

4. ``--decode MODE [MODE ...]`` (instead of the scenarios above): the engine's decode paths side by side on one
   module (``HFEngine(decode=...)``: dynamic, static, cuda_graph, compiled), a batch of fresh prompts with
   ``--new-tokens`` each, at every ``--decode-batches`` size; tok/s per mode, its ratio to the dynamic path measured
   in the same run, for the fixed-shape modes the *bare step*: the same steps timed back to back with no host work
   (``StaticDecoder.time_step`` at each column bucket the run passes through; "% of bare" is how much of the step
   time the decode loop keeps), and for every mode the *hardware floor* from the machine's GEMM and streaming
   probes run first (:mod:`benchmarks.machine_floor`) with "% of floor"; "compile s" is the warm-up's compile time.
   ``--profile STEPS`` adds, per fixed-shape mode and batch, torch's profiler table of that many bare steps: where a
   step's time goes. ``--decode-rollout PROMPTS`` adds the rollout scenario (3.) per mode: each mode's engine
   (``max(--decode-batches)`` slots) runs the same ARPO sampling step over PROMPTS tasks, interleaved per repeat;
   tok/s is tokens the sampler received per second of engine time.

Usage::

    python -m benchmarks.bench_engine --model smollm2-135m-instruct --out results.json
    python -m benchmarks.bench_engine --rollout-model runs/quickstart/sft   # + the rollout scenario
    python -m benchmarks.bench_engine --vllm --vllm-batches 8 32   # HF vs arpo-vLLM vs plain vLLM (bench_engine_vllm)
    python -m benchmarks.bench_engine --vllm --push-only --push-shape qwen2.5-1.5b --vllm-dtype bfloat16  # push time
    python -m benchmarks.bench_engine --decode dynamic static --decode-batches 8 --new-tokens 64   # CPU
    python -m benchmarks.bench_engine --decode dynamic cuda_graph --device cuda --dtype bfloat16 \
        --decode-batches 8 32 128 --new-tokens 256 --static-cache-tokens 1024      # the GPU measurement
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine

SYSTEM = (
    "You are a helpful assistant that solves problems step by step. You may call tools: write python code "
    "inside <python></python> to run it, or a query inside <search></search> to search the web. Results come "
    "back inside <result></result>. Give the final answer inside <answer></answer>."
)
QUESTIONS = [
    "What is 17 * 23?",
    "Name the capital of Australia and explain briefly why it is not Sydney.",
    "Compute the sum of the first 50 odd numbers.",
    "Who wrote the novel 'The Master and Margarita'?",
    "Is 221 a prime number? Show your reasoning.",
    "Convert 3.5 kilometres to miles.",
    "What is the derivative of x^3 * sin(x)?",
    "List three uses of the Fourier transform in engineering.",
]


def _prompts(tok, n: int, rng: random.Random) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + " Please be thorough." * rng.randint(0, 12)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        out.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def _useful(tok, new: list[int], max_new: int, stops: tuple[str, ...], eos: set[int]) -> int:
    """Tokens a rollout would keep: up to EOS / the token completing a stop string / max_new (inclusive)."""
    for k in range(1, min(len(new), max_new) + 1):
        if new[k - 1] in eos or (stops and any(s in tok.decode(new[:k]) for s in stops)):
            return k
    return min(len(new), max_new)


def _pad_id(tok, eos: set[int]) -> int:  # noqa: ANN001
    return tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))


def _left_padded(contexts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A left-padded batch as ``generate`` takes it: input ids, attention mask, width."""
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[pad] * (width - len(c)) + list(c) for c in contexts])
    att = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    return ids, att, width


def _hf_generate(
    model,
    tok,
    contexts: list[list[int]],
    max_new: list[int],
    batch: int,
    stops: tuple[str, ...],
    eos: set[int],
    seed: int,
) -> tuple[int, float]:
    pad = _pad_id(tok, eos)
    useful, t0 = 0, time.perf_counter()
    for b in range(0, len(contexts), batch):
        ctxs, mns = contexts[b : b + batch], max_new[b : b + batch]
        ids, att, width = _left_padded(ctxs, pad)
        torch.manual_seed(seed + b)
        kw = {"stop_strings": list(stops), "tokenizer": tok} if stops else {}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=att,
                max_new_tokens=max(mns),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=pad,
                **kw,
            )
        for row, mn in zip(out[:, width:].tolist(), mns):
            useful += _useful(tok, row, mn, stops, eos)
    return useful, time.perf_counter() - t0


class GenerateEngine:
    """The rollout-engine interface on ``model.generate``: the baseline of the ``rollout`` scenario.

    Requests are decoded in fixed batches of ``batch`` in request order; each batch runs until its last row ends,
    with the batch's largest ``max_new_tokens`` and the union of its stop strings, and every row is then cut at its
    own EOS, stop string or budget. Logprobs and entropies come from the raw logits (``output_logits=True``), so
    the sampler gets what it gets from :class:`HFEngine`. No KV is kept between calls.
    """

    def __init__(self, model, tokenizer, batch: int, eos: set[int]) -> None:  # noqa: ANN001
        self.model, self.tokenizer, self.batch, self.eos = model, tokenizer, batch, eos
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        self.pad = _pad_id(tokenizer, eos)
        self._stats: dict[str, float] = {}

    def _count(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value

    def generate(self, requests: list[GenRequest]) -> list:
        from arpo_algo.rollout.engines.base import Generation

        t0, out = time.perf_counter(), []
        for b in range(0, len(requests), self.batch):
            chunk = requests[b : b + self.batch]
            p = chunk[0].params
            stops = sorted({s for r in chunk for s in r.params.stop})
            ids, att, width = _left_padded([r.token_ids for r in chunk], self.pad)
            torch.manual_seed(p.seed if p.seed is not None else b)
            kw = {"stop_strings": stops, "tokenizer": self.tokenizer} if stops else {}
            sampling = (
                {
                    "do_sample": True,
                    "temperature": p.temperature,
                    "top_p": p.top_p,
                    "top_k": p.top_k if p.top_k > 0 else 0,
                }
                if p.temperature > 0
                else {"do_sample": False}
            )
            with torch.inference_mode():
                res = self.model.generate(
                    input_ids=ids,
                    attention_mask=att,
                    pad_token_id=self.pad,
                    max_new_tokens=max(r.params.max_new_tokens for r in chunk),
                    output_logits=True,
                    return_dict_in_generate=True,
                    **sampling,
                    **kw,
                )
            logits = torch.stack(res.logits, 1).float()  # (rows, steps, vocab), raw
            logp = torch.log_softmax(logits / (p.temperature or 1.0), -1)
            ent = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
            for j, r in enumerate(chunk):
                new = res.sequences[j, width:].tolist()
                n = _useful(self.tokenizer, new, r.params.max_new_tokens, r.params.stop, self.eos)
                new = new[:n]
                hit = next((s for s in r.params.stop if s in self.tokenizer.decode(new)), None)
                finish = "eos" if new and new[-1] in self.eos else "stop" if hit else "length"
                lps = logp[j, torch.arange(n), torch.tensor(new, dtype=torch.long)].tolist()
                out.append(Generation(r.request_id, new, lps, ent[j, :n].tolist(), finish, stop_string=hit))
                self._count("generated_tokens", n)
                self._count("prefill_tokens", len(r.token_ids))
        self._count("seconds", time.perf_counter() - t0)
        return out

    def release(self, cache_keys: list) -> None:
        """Nothing is cached."""

    def load_state_dict(self, state_dict: dict) -> None:
        self.model.load_state_dict(state_dict)

    def stats(self) -> dict[str, float]:
        out, self._stats = self._stats, {}
        return out


def _rollout(engine, tasks: list[int], seed: int) -> tuple[int, float]:  # noqa: ANN001
    """One ARPO sampling step on ToolMath level 3: (tokens the sampler received, seconds inside the engine)."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout import metrics as MK
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_env.core import ToolTextEnv

    sampler = TreeSampler(
        engine,
        lambda: ToolTextEnv(task="toolmath", levels=(3,)),
        TreeConfig(budget=8, initial=4, branch_factor=1),
        SamplingParams(temperature=1.0),
        max_response_tokens=192,
        seed=seed,
    )
    try:
        _, m = sampler.sample(tasks, step=0)
    finally:
        sampler.close()
    return int(m[MK.TOKENS_GENERATED]), float(m[MK.TIME_GENERATE])


def _engine_run(eng: HFEngine, reqs: list[GenRequest]) -> tuple[int, float]:
    t0 = time.perf_counter()
    gens = eng.generate(reqs)
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0


def _engine_scenarios(
    eng: HFEngine, prompts: list[list[int]], max_new: list[int], stops: tuple[str, ...], seed: int
) -> dict:
    """Both scenarios on one engine: (tokens, seconds) each, plus the continuation contexts for ``generate``."""
    reqs = [
        GenRequest(i, p, SamplingParams(max_new_tokens=m, stop=stops, seed=seed + i))
        for i, (p, m) in enumerate(zip(prompts, max_new))
    ]
    refill = _engine_run(eng, reqs)
    # continuation after a tool result: first segment (untimed), 20 tool tokens, continue from the cached prefix
    first = eng.generate(
        [GenRequest(i, p, SamplingParams(max_new_tokens=32, seed=100 + i)) for i, p in enumerate(prompts)]
    )
    tok = eng.tokenizer
    tool = tok.encode(" <result>\n" + "x = 42, y = 17, total = 59 " * 4, add_special_tokens=False)[:18]
    tool += tok.encode("\n</result>", add_special_tokens=False)[:2]
    contexts = [p + g.token_ids + tool for p, g in zip(prompts, first)]
    cont = [
        GenRequest(i, c, SamplingParams(max_new_tokens=32, seed=200 + i), prefix_key=g.cache_key)
        for i, (c, g) in enumerate(zip(contexts, first))
    ]
    return {"refill": refill, "tool_continuation": _engine_run(eng, cont), "contexts": contexts}


def _one_repeat(
    args: argparse.Namespace,
    engines: dict,
    prompts: list[list[int]],
    max_new: list[int],
    stops: tuple[str, ...],
    rollout: dict | None,
) -> dict:
    """Every scenario once on every side: {scenario: {side: (tokens, seconds)}}."""
    runs = {name: _engine_scenarios(eng, prompts, max_new, stops, args.seed) for name, eng in engines.items()}
    model, tok, eos = engines["engine"].model, engines["engine"].tokenizer, engines["engine"].eos_ids
    contexts = runs["engine"]["contexts"]
    rows = {name: {side: runs[side][name] for side in engines} for name in ("refill", "tool_continuation")}
    rows["refill"]["generate"] = _hf_generate(model, tok, prompts, max_new, args.batch, stops, eos, args.seed)
    rows["tool_continuation"]["generate"] = _hf_generate(
        model, tok, contexts, [32] * len(prompts), args.batch, (), eos, args.seed
    )
    if rollout:
        tasks = list(range(args.rollout_prompts))
        rows["rollout"] = {side: _rollout(eng, tasks, args.seed) for side, eng in rollout.items()}
    return rows


def _rollout_engines(args: argparse.Namespace) -> dict:
    from arpo_algo.models import resolve_model_path

    fast = HFEngine(resolve_model_path(args.rollout_model), max_batch_size=args.batch, linear_layout="transposed")
    native = HFEngine(model=fast.model, tokenizer=fast.tokenizer, max_batch_size=args.batch, linear_layout="native")
    return {
        "engine": fast,
        "native": native,
        "generate": GenerateEngine(fast.model, fast.tokenizer, args.batch, fast.eos_ids),
    }


def _floor_seconds(eng: HFEngine, batch: int, starts: list[int], new_tokens: int) -> float:
    """Seconds the run's decode steps take back to back with no host work: one bare step per generated position,
    at the column bucket that position needs (the longest prompt sets the bucket, as in the decode loop)."""
    dec, width, total, cache = eng.static_decoder, max(starts), 0.0, {}
    for p in range(width, width + new_tokens - 1):  # the first token comes from the prefill
        length = dec.bucket_columns(p + 1)
        if length not in cache:
            cache[length] = dec.time_step(batch, length)
        total += cache[length]
    return total


def _profile_step(eng: HFEngine, batch: int, length: int, steps: int, top: int = 15) -> None:
    """Where a bare fixed-shape step's time goes: ``steps`` steps under torch's profiler, the operators (on CUDA: also
    the kernels) with the most self time, as torch prints them."""
    from torch.profiler import ProfilerActivity, profile

    dec = eng.static_decoder
    dec.time_step(batch, length, repeats=2)  # warm: a graph is captured or compiled outside the profile
    cuda = dec.state.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        seconds = dec.time_step(batch, length, repeats=steps)
    print(
        f"\nProfile of {steps} bare steps, decode={eng.decode}, batch {batch}, {dec.bucket_columns(length)} columns "
        f"({seconds * 1e3:.2f} ms per step under the profiler):\n"
    )
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top))


def _decode_bench(args: argparse.Namespace, path, dtype: str) -> dict:  # noqa: ANN001
    """Decode modes side by side on one module in ``dtype`` (see the module docstring, item 4)."""
    from benchmarks.machine_floor import floor_tok_s, probe

    if args.random_weights:
        model, tok = random_weights_model(path, dtype, args.seed)
        base = HFEngine(model=model.to(args.device), tokenizer=tok, dtype=dtype, max_batch_size=1, decode="dynamic")
    else:
        base = HFEngine(path, device=args.device, dtype=dtype, max_batch_size=1, decode="dynamic")
    rows = []
    machine = probe(str(base.device), getattr(torch, dtype))
    where = f"{args.threads} threads" if base.device.type == "cpu" else torch.cuda.get_device_name(base.device)
    print(
        f"\nMachine ({where}): {dtype} GEMM {machine['gemm_gflops']:.0f} GFLOP/s, streaming read "
        f"{machine['stream_gbs']:.1f} GB/s"
    )
    weights = "random weights at the shape of " if args.random_weights else ""
    print(
        f"\nHFEngine decode modes on {weights}{args.model}, {base.device}, {dtype}, "
        f"{args.new_tokens} new tokens per request, one request per slot, median of {args.repeats} interleaved "
        "repeat(s)\n"
    )
    print(
        "| batch | decode | tok/s | vs dynamic | bare step tok/s | % of bare | hardware floor tok/s | % of floor | "
        "compile s | prefill % of time | steps % of time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.decode_batches:
        engines = {
            m: HFEngine(
                model=base.model,
                tokenizer=base.tokenizer,
                dtype=dtype,
                max_batch_size=batch,
                decode=m,
                static_cache_tokens=args.static_cache_tokens,
                seed=args.seed,
            )
            for m in args.decode
        }
        prompts = _prompts(base.tokenizer, batch, random.Random(args.seed))
        reqs = [
            GenRequest(i, p, SamplingParams(max_new_tokens=args.new_tokens, seed=args.seed + i))
            for i, p in enumerate(prompts)
        ]
        for eng in engines.values():  # warm-up on the same workload: graphs are captured/compiled here, not timed
            errors = [g.error for g in eng.generate(reqs) if g.finish_reason == "error"]
            if errors:
                raise SystemExit(f"{errors[0]} (raise --static-cache-tokens?)")
        warm = {m: eng.stats() for m, eng in engines.items()}
        hw, limit = floor_tok_s(base.model, batch, machine)
        rates: dict[str, list[float]] = {m: [] for m in engines}
        walls = dict.fromkeys(engines, 0.0)
        for _ in range(args.repeats):
            for m, eng in engines.items():
                tokens, seconds = _engine_run(eng, reqs)
                rates[m].append(tokens / seconds)
                walls[m] += seconds
        timed = {m: eng.stats() for m, eng in engines.items()}  # counters of the timed repeats only
        for m, eng in engines.items():
            rate = statistics.median(rates[m])
            ref = statistics.median(rates["dynamic"]) if "dynamic" in rates else None
            row = {
                "batch": batch,
                "decode": m,
                "dtype": dtype,
                "tok_s": rate,
                "vs_dynamic": rate / ref if ref else None,
                "graphs_captured": warm[m].get("graph_captures", 0.0),
                "hw_floor_tok_s": hw,
                "hw_limit": limit,
                "of_hw_floor": rate / hw,
                "compile_seconds": warm[m].get("compile_seconds"),
                # the fixed-shape paths time their prefills (batched per refill) and their decode steps
                "prefill_share": (timed[m]["prefill_seconds"] / walls[m]) if "prefill_seconds" in timed[m] else None,
                "step_share": (timed[m]["decode_seconds"] / walls[m]) if "prefill_seconds" in timed[m] else None,
            }
            if eng.static_decoder is not None:
                floor = (
                    batch
                    * (args.new_tokens - 1)
                    / _floor_seconds(eng, batch, [len(p) for p in prompts], args.new_tokens)
                )
                row.update(floor_tok_s=floor, of_floor=rate / floor)
            rows.append(row)
            fmt = lambda v, f: f.format(v) if v is not None else "-"  # noqa: E731
            print(
                f"| {batch} | {m} | {rate:.1f} | {fmt(row['vs_dynamic'], '{:.2f}x')} | "
                f"{fmt(row.get('floor_tok_s'), '{:.1f}')} | {fmt(row.get('of_floor'), '{:.0%}')} | "
                f"{hw:.0f} ({limit}) | {rate / hw:.0%} | {fmt(row['compile_seconds'], '{:.0f}')} | "
                f"{fmt(row['prefill_share'], '{:.0%}')} | {fmt(row['step_share'], '{:.0%}')} |",
                flush=True,
            )
        if args.profile:
            for eng in engines.values():
                if eng.static_decoder is not None:
                    _profile_step(eng, batch, max(len(p) for p in prompts) + 1, args.profile)
        for eng in engines.values():
            eng.close()
    if args.decode_rollout:
        rows += _decode_rollout_rows(
            args, base, dtype, hw=floor_tok_s(base.model, max(args.decode_batches), machine)[0]
        )
    return {
        "model": args.model,
        "random_weights": args.random_weights,
        "device": str(base.device),
        "device_name": where,
        "machine": machine,
        "dtype": dtype,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "decode": rows,
    }


def _decode_rollout_rows(args: argparse.Namespace, base: HFEngine, dtype: str, hw: float) -> list[dict]:
    """The rollout scenario per decode mode (see the module docstring, item 4): median tok/s of engine time."""
    slots = max(args.decode_batches)
    engines = {
        m: HFEngine(
            model=base.model,
            tokenizer=base.tokenizer,
            dtype=dtype,
            max_batch_size=slots,
            decode=m,
            static_cache_tokens=args.static_cache_tokens,
            seed=args.seed,
        )
        for m in args.decode
    }
    tasks = list(range(args.decode_rollout))
    for eng in engines.values():  # warm-up (graphs captured or compiled here), on other tasks
        _rollout(eng, [t + len(tasks) for t in tasks], args.seed)
    rates: dict[str, list[float]] = {m: [] for m in engines}
    for r in range(args.repeats):
        for m, eng in engines.items():
            tokens, seconds = _rollout(eng, tasks, args.seed + r)
            rates[m].append(tokens / seconds)
    rows = []
    for m, eng in engines.items():
        rate = statistics.median(rates[m])
        ref = statistics.median(rates["dynamic"]) if "dynamic" in rates else None
        rows.append(
            {
                "batch": "rollout",
                "decode": m,
                "dtype": dtype,
                "tok_s": rate,
                "slots": slots,
                "vs_dynamic": rate / ref if ref else None,
                "hw_floor_tok_s": hw,
                "of_hw_floor": rate / hw,
            }
        )
        print(
            f"| rollout ({len(tasks)} tasks, {slots} slots) | {m} | {rate:.1f} | "
            f"{f'{rate / ref:.2f}x' if ref else '-'} | - | - | {hw:.0f} | {rate / hw:.0%} | - | - | - |",
            flush=True,
        )
        eng.close()
    return rows


def random_weights_model(folder, dtype: str, seed: int):  # noqa: ANN001, ANN201
    """A randomly initialised model of ``folder``'s config in ``dtype`` and ``folder``'s tokenizer: the shape of a
    model without its weights file (the decode steps cost the same; the tokens are meaningless)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype))
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every scenario on every side this many times, interleaved; report medians",
    )
    ap.add_argument(
        "--rollout-model",
        default=None,
        help="also run the rollout scenario with this model (one that calls tools, e.g. the quickstart's "
        "runs/quickstart/sft)",
    )
    ap.add_argument("--rollout-prompts", type=int, default=4)
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="run the vLLM side instead (HF engine, arpo's vLLM engine, plain vLLM; needs vllm)",
    )
    ap.add_argument("--vllm-batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument(
        "--vllm-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="with --vllm: the dtype of both engines (and of the pushed weights)",
    )
    ap.add_argument("--push-only", action="store_true", help="with --vllm: time only the weight push")
    ap.add_argument(
        "--push-shape",
        default=None,
        help="with --push-only: random weights of this shape (qwen2.5-1.5b), --model's tokenizer",
    )
    ap.add_argument("--push-repeats", type=int, default=3)
    ap.add_argument(
        "--kv-cache-gib", type=float, default=0.5, help="with --push-only: vLLM's KV cache (room for 8192 tokens)"
    )
    ap.add_argument(
        "--decode",
        nargs="+",
        default=None,
        choices=["dynamic", "static", "cuda_graph", "compiled"],
        help="compare these HFEngine decode modes instead of running the scenarios (item 4)",
    )
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--static-cache-tokens", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="with --decode: random weights at --model's config (a folder with config and tokenizer "
        "only is enough), for a machine the weights cannot reach",
    )
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="with --decode: the engines' dtype; several run one after the other in this run, each "
        "with its own probe of the machine in that dtype",
    )
    ap.add_argument(
        "--decode-rollout",
        type=int,
        default=0,
        metavar="PROMPTS",
        help="with --decode: also the rollout scenario per mode, an ARPO sampling step over PROMPTS tasks",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --decode: also profile this many bare steps of each fixed-shape mode at each batch "
        "and print the operators with the most self time",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from arpo_algo.models import REGISTRY, pull

    path = pull(args.model, progress=False) if args.model in REGISTRY else args.model
    if args.decode:
        runs = [_decode_bench(args, path, dtype) for dtype in args.dtype]
        res = {
            **runs[0],
            "dtype": args.dtype,
            "machine": {r["dtype"]: r["machine"] for r in runs},
            "decode": [row for r in runs for row in r["decode"]],
        }
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return res
    if args.vllm:
        from arpo_algo.rollout.engines.vllm.support import cpu_features
        from benchmarks.bench_engine_vllm import print_vllm_table, run_vllm_side

        if args.push_only:
            from benchmarks.bench_engine_vllm import run_push_only

            res = run_push_only(args, path)
            print(json.dumps(res))
            return res
        if args.rollout_model:
            path = pull(args.rollout_model, progress=False) if args.rollout_model in REGISTRY else args.rollout_model
        res = run_vllm_side(args, path, _prompts, _rollout, args.vllm_dtype)
        res.update(model=str(path), cpu=cpu_features())
        print_vllm_table(res, res["cpu"])
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return res
    engines = {
        "engine": HFEngine(
            path, max_batch_size=args.batch, kv_cache_capacity_tokens=1 << 20, linear_layout="transposed"
        )
    }
    tok = engines["engine"].tokenizer
    engines["native"] = HFEngine(
        model=engines["engine"].model,
        tokenizer=tok,
        max_batch_size=args.batch,
        kv_cache_capacity_tokens=1 << 20,
        linear_layout="native",
    )
    rng = random.Random(args.seed)
    prompts = _prompts(tok, args.requests, rng)
    stops = ("\n\n",)
    max_new = [rng.choice([16, 32, 64, 96]) for _ in prompts]
    for eng in engines.values():  # warm-up
        eng.generate([GenRequest("warm", prompts[0], SamplingParams(max_new_tokens=4, seed=0))])
    rollout = _rollout_engines(args) if args.rollout_model else None
    repeats = [_one_repeat(args, engines, prompts, max_new, stops, rollout) for _ in range(args.repeats)]
    result = {
        "model": args.model,
        "rollout_model": args.rollout_model,
        "requests": args.requests,
        "batch": args.batch,
        "threads": args.threads,
        "repeats": repeats,
        "scenarios": {},
    }
    print(
        f"\nHFEngine (transposed and native linear layout) vs model.generate on {args.model}, CPU, "
        f"{args.threads} threads, batch {args.batch}, {args.requests} requests (useful tokens only), "
        f"median of {args.repeats} interleaved repeat(s)\n"
    )
    print(
        "| scenario | engine tok/s | engine (native layout) tok/s | generate tok/s | engine / generate "
        "(min-max) | native-layout engine / generate |"
    )
    print("|---|---|---|---|---|---|")
    for name in repeats[0]:
        rate = {
            side: [r[name][side][0] / r[name][side][1] for r in repeats] for side in ("engine", "native", "generate")
        }
        ratio = [e / g for e, g in zip(rate["engine"], rate["generate"])]
        native = [n / g for n, g in zip(rate["native"], rate["generate"])]
        row = {
            "engine_tok_s": statistics.median(rate["engine"]),
            "native_layout_tok_s": statistics.median(rate["native"]),
            "generate_tok_s": statistics.median(rate["generate"]),
            "ratio": statistics.median(ratio),
            "ratio_min": min(ratio),
            "ratio_max": max(ratio),
            "native_layout_ratio": statistics.median(native),
            "engine_tokens": repeats[0][name]["engine"][0],
            "generate_tokens": repeats[0][name]["generate"][0],
        }
        result["scenarios"][name] = row
        print(
            f"| {name} | {row['engine_tok_s']:.1f} | {row['native_layout_tok_s']:.1f} | "
            f"{row['generate_tok_s']:.1f} | {row['ratio']:.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) | "
            f"{row['native_layout_ratio']:.2f}x |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
