"""Do the HF and vLLM engines report the same top-k entropies and logprobs on a real model?

    python -m benchmarks.engine_entropy_check runs/quickstart/sft --prompts 8 --max-new-tokens 96

Both engines continue the same ToolMath level-3 prompts greedily (so they should produce the same tokens) with the
top-k entropy estimator (``topk_sum_lnV``: per token ``-sum exp(l) l`` over the 10 top logprobs plus the sampled
token) and report, over the tokens where both sequences still agree: the largest and mean absolute difference of
the per-token entropy term and of the sampled-token logprob, and where the sequences first diverge. A systematic
difference here would change ARPO's branching decisions between engines; float noise would not.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="an HF model folder (e.g. the quickstart's SFT checkpoint)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    from arpo_algo.rollout import layout
    from arpo_algo.rollout.engines import build_engine
    from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
    from arpo_env.core import ToolTextEnv

    hf = build_engine("hf", model_or_path=args.model, entropy_method="topk_sum_lnV")
    env = ToolTextEnv(task="toolmath", levels=[3], max_tool_calls=3)
    contexts = []
    for i in range(args.prompts):
        _, info = env.reset(options={"task_index": i})
        contexts.append(layout.prompt_ids(hf.tokenizer, info["messages"]))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, logprobs_topk=10)
    reqs = [GenRequest(i, list(c), params) for i, c in enumerate(contexts)]
    out_hf = hf.generate(reqs)
    hf.close()
    vl = build_engine("vllm", model_or_path=args.model)
    out_vl = vl.generate(reqs)
    vl.close()
    d_ent, d_lp, rows = [], [], []
    for a, b in zip(out_hf, out_vl):
        same = 0
        while same < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[same] == b.token_ids[same]:
            same += 1
        d_ent += [abs(x - y) for x, y in zip(a.entropies[:same], b.entropies[:same])]
        d_lp += [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])]
        rows.append(
            {
                "tokens_hf": len(a.token_ids),
                "tokens_vllm": len(b.token_ids),
                "agree_for": same,
                "mean_entropy_hf": sum(a.entropies[:same]) / max(same, 1),
                "mean_entropy_vllm": sum(b.entropies[:same]) / max(same, 1),
            }
        )
    res = {
        "tokens_compared": len(d_ent),
        "entropy_abs_diff_max": max(d_ent, default=0.0),
        "entropy_abs_diff_mean": sum(d_ent) / max(len(d_ent), 1),
        "logprob_abs_diff_max": max(d_lp, default=0.0),
        "logprob_abs_diff_mean": sum(d_lp) / max(len(d_lp), 1),
        "per_prompt": rows,
    }
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
