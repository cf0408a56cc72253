"""Benchmark: HFEngine against ``model.generate`` on agentic-rollout workloads (CPU, same threads, side by side).

Scenarios (equal batch size and sampling settings on both sides; throughput counts *useful* tokens only, i.e. each
request's tokens up to its own EOS, stop string or ``max_new_tokens``, because that is what a rollout keeps):

1. ``refill``: 16 requests with varied prompt lengths, varied per-request ``max_new_tokens`` and a stop string.
   ``generate`` runs them in fixed batches (each batch lasts as long as its longest member, with the batch-wide
   maximum ``max_new_tokens``); the engine refills finished rows from the queue.
2. ``tool_continuation``: after a first segment, 20 "tool result" tokens are appended and generation continues.
   The engine reuses the cached KV of the first segment (``prefix_key``) and prefills only the tool tokens;
   ``generate`` re-prefills the whole context. Only the continuation is timed.

The engine runs twice on the same module, with ``linear_layout="transposed"`` (the CPU default) and ``"native"``,
so the table separates what the weight layout buys from what refill and prefix reuse buy.

Usage::

    python -m experiments.bench_engine --model smollm2-135m-instruct --out results.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from arpo_algo.engines.base import GenRequest, SamplingParams
from arpo_algo.engines.hf import HFEngine

SYSTEM = ("You are a helpful assistant that solves problems step by step. You may call tools: write python code "
          "inside <python></python> to run it, or a query inside <search></search> to search the web. Results come "
          "back inside <result></result>. Give the final answer inside <answer></answer>.")
QUESTIONS = ["What is 17 * 23?", "Name the capital of Australia and explain briefly why it is not Sydney.",
             "Compute the sum of the first 50 odd numbers.", "Who wrote the novel 'The Master and Margarita'?",
             "Is 221 a prime number? Show your reasoning.", "Convert 3.5 kilometres to miles.",
             "What is the derivative of x^3 * sin(x)?", "List three uses of the Fourier transform in engineering."]


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


def _hf_generate(model, tok, contexts: list[list[int]], max_new: list[int], batch: int, stops: tuple[str, ...],
                 eos: set[int], seed: int) -> tuple[int, float]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    useful, t0 = 0, time.perf_counter()
    for b in range(0, len(contexts), batch):
        ctxs, mns = contexts[b:b + batch], max_new[b:b + batch]
        width = max(len(c) for c in ctxs)
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in ctxs])
        att = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in ctxs])
        torch.manual_seed(seed + b)
        kw = {"stop_strings": list(stops), "tokenizer": tok} if stops else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max(mns), do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad, **kw)
        for row, mn in zip(out[:, width:].tolist(), mns):
            useful += _useful(tok, row, mn, stops, eos)
    return useful, time.perf_counter() - t0


def _engine_run(eng: HFEngine, reqs: list[GenRequest]) -> tuple[int, float, list]:
    t0 = time.perf_counter()
    gens = eng.generate(reqs)
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - t0, gens


def _engine_scenarios(eng: HFEngine, prompts: list[list[int]], max_new: list[int], stops: tuple[str, ...],
                      seed: int) -> dict:
    """Both scenarios on one engine: (tokens, seconds) each, plus the continuation contexts for ``generate``."""
    reqs = [GenRequest(i, p, SamplingParams(max_new_tokens=m, stop=stops, seed=seed + i))
            for i, (p, m) in enumerate(zip(prompts, max_new))]
    refill_tok, refill_s, _ = _engine_run(eng, reqs)
    # continuation after a tool result: first segment (untimed), 20 tool tokens, continue from the cached prefix
    first = eng.generate([GenRequest(i, p, SamplingParams(max_new_tokens=32, seed=100 + i))
                          for i, p in enumerate(prompts)])
    tok = eng.tokenizer
    tool = tok.encode(" <result>\n" + "x = 42, y = 17, total = 59 " * 4, add_special_tokens=False)[:18]
    tool += tok.encode("\n</result>", add_special_tokens=False)[:2]
    contexts = [p + g.token_ids + tool for p, g in zip(prompts, first)]
    eng.stats()
    cont = [GenRequest(i, c, SamplingParams(max_new_tokens=32, seed=200 + i), prefix_key=g.cache_key)
            for i, (c, g) in enumerate(zip(contexts, first))]
    cont_tok, cont_s, _ = _engine_run(eng, cont)
    return {"refill": (refill_tok, refill_s), "tool_continuation": (cont_tok, cont_s), "contexts": contexts,
            "stats": eng.stats()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from arpo_algo.models import REGISTRY, pull

    path = pull(args.model, progress=False) if args.model in REGISTRY else args.model
    engines = {"transposed": HFEngine(path, max_batch_size=args.batch, kv_cache_capacity_tokens=1 << 20,
                                      linear_layout="transposed")}
    model, tok = engines["transposed"].model, engines["transposed"].tokenizer
    engines["native"] = HFEngine(model=model, tokenizer=tok, max_batch_size=args.batch,
                                 kv_cache_capacity_tokens=1 << 20, linear_layout="native")
    rng = random.Random(args.seed)
    prompts = _prompts(tok, args.requests, rng)
    stops = ("\n\n",)
    max_new = [rng.choice([16, 32, 64, 96]) for _ in prompts]
    for eng in engines.values():  # warm-up
        eng.generate([GenRequest("warm", prompts[0], SamplingParams(max_new_tokens=4, seed=0))])
    runs = {name: _engine_scenarios(eng, prompts, max_new, stops, args.seed) for name, eng in engines.items()}
    eos = engines["transposed"].eos_ids
    baseline = {"refill": _hf_generate(model, tok, prompts, max_new, args.batch, stops, eos, args.seed),
                "tool_continuation": _hf_generate(model, tok, runs["transposed"]["contexts"],
                                                  [32] * len(prompts), args.batch, (), eos, args.seed)}
    st = runs["transposed"]["stats"]
    contexts = runs["transposed"]["contexts"]
    result = {"model": args.model, "requests": args.requests, "batch": args.batch, "threads": args.threads,
              "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
              "mean_continuation_context": sum(map(len, contexts)) / len(contexts),
              "continuation_reused_tokens": st.get("reused_tokens", 0.0),
              "continuation_prefilled_tokens": st.get("prefill_tokens", 0.0), "scenarios": {}}
    print(f"\nHFEngine (transposed and native linear layout) vs model.generate on {args.model}, CPU, "
          f"{args.threads} threads, batch {args.batch}, {args.requests} requests (useful tokens only)\n")
    print("| scenario | engine tok/s | engine (native layout) tok/s | generate tok/s | engine / generate | "
          "native-layout engine / generate |")
    print("|---|---|---|---|---|---|")
    for name, (gt, gs) in baseline.items():
        (et, es), (nt, ns) = runs["transposed"][name], runs["native"][name]
        e_rate, n_rate, g_rate = et / es, nt / ns, gt / gs
        result["scenarios"][name] = {"engine_tokens": et, "engine_s": es, "engine_tok_s": e_rate,
                                     "native_layout_tokens": nt, "native_layout_s": ns, "native_layout_tok_s": n_rate,
                                     "generate_tokens": gt, "generate_s": gs, "generate_tok_s": g_rate,
                                     "ratio": e_rate / g_rate, "native_layout_ratio": n_rate / g_rate}
        print(f"| {name} | {e_rate:.1f} | {n_rate:.1f} | {g_rate:.1f} | {e_rate / g_rate:.2f}x | "
              f"{n_rate / g_rate:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
