"""Measure the rollout/learner mismatch (``learner/kl_rollout``, ``learner/logprob_diff_max``) the alarm levels
of ``[training]`` are set from: ARPO on ToolMath with an HF engine holding its own float32 weight copy (as a rollout
actor does), the learner's weights pushed to it after every update, or, with ``--stale``, never pushed; with
``--engine-dtype bfloat16`` the engine computes in bf16 against the float32 learner (a bf16 rollout actor).

    python -m benchmarks.measure_rollout_mismatch --model smollm2-135m-instruct --iterations 3 [--stale]
        [--engine-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.sampler import TreeSampler
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_env.core import ToolTextEnv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2.5e-5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tool-calls", type=int, default=3)
    ap.add_argument("--stale", action="store_true", help="never send the learner's weights to the engine")
    ap.add_argument(
        "--engine-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the engine's compute dtype (the learner stays float32)",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    # The alarm itself is off here (stop level infinite): this script measures what it would see.
    learner = Learner(args.model, LearnerConfig(lr=args.lr, micro_batch_tokens=1024, **ALARM_OFF), seed=0)
    engine = HFEngine(args.model, dtype=args.engine_dtype, seed=0)

    def env() -> ToolTextEnv:
        return ToolTextEnv(task="toolmath", levels=[3], max_tool_calls=args.max_tool_calls, tools={"python": {}})

    sampler = TreeSampler.from_config(
        engine, env, TreeConfig(budget=4, initial=2, branch_factor=1), RolloutsConfig(max_response_tokens=192), seed=0
    )
    try:
        for it in range(args.iterations):
            t0 = time.perf_counter()
            groups, _ = sampler.sample(list(range(it * args.prompts, (it + 1) * args.prompts)), step=it)
            m = learner.update(groups)
            limit_eos = sum(t.finish_reason == "tool_limit" for g in groups for t in g.trajectories)
            print(
                f"iteration {it}: kl_rollout {m['kl_rollout']:.3e} logprob_diff_max {m['logprob_diff_max']:.3e} "
                f"trained_tokens {m['trained_tokens']:.0f} tool_limit_eos {limit_eos} "
                f"skipped_no_signal {m['skipped_no_signal']:.0f} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            if not args.stale:
                engine.load_state_dict(learner.model.state_dict())
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
