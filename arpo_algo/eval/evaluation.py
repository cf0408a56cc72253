"""Held-out evaluation: the protocol the paper leaves open, written down
(docs/concepts/reference-choices.md#evaluation-protocol).

* Tasks: the first ``evaluation.num_prompts`` tasks of the environment's ``evaluation.split`` (all when None), in
  index order, so every evaluation of a run (and of two runs with the same settings) sees the same tasks.
* Samples: ``evaluation.samples`` (n) independent trajectories per task (the GRPO tree: no branching), decoded
  greedily when ``evaluation.temperature == 0``, else sampled with that temperature; seeds are fixed (step 0), so
  evaluations differ only by the weights.
* Correct: the reward's answer-quality score reaches 1. For rewards that report a token-F1 (``arpo_reference``,
  ``f1``) that is ``f1 == 1`` (the reference's +0.1 multi-tool bonus does not make a wrong answer right); for the
  others (``math_equiv``, ``exact_match``) it is ``score >= 1``.
* Metrics (:func:`arpo_algo.rollout.metrics.summarize`, the names training uses): ``accuracy`` = mean correctness
  over all samples (pass@1); ``pass_at_k`` = fraction of tasks with at least one correct sample (k = n);
  ``reward_mean``; ``tool_calls_per_traj``; ``format_ok``; ``response_len``; ``num_tasks``; ``time_s``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.types import Group

if TYPE_CHECKING:
    from arpo_algo.rollout.engines.base import RolloutEngine

__all__ = ["EvalSettings", "eval_settings", "evaluate_engine", "evaluate_policy", "sample_held_out"]

#: Tasks sampled together in one sampler call (bounds the number of live environments and KV caches).
EVAL_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """The evaluation protocol's knobs, as :func:`evaluate_engine` takes them (see its arguments)."""

    num_prompts: int | None
    samples: int
    temperature: float
    max_response_tokens: int
    top_p: float = 1.0
    tool_workers: int = 8
    prompt_overflow: str = "error"
    seed: int = 0

    def as_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def eval_settings(cfg: Any) -> EvalSettings:
    """THE mapping from an ARPOConfig to evaluation settings; training's evaluate(), the quickstart and ``arpo eval
    --experiment`` all use it, so no caller can drop a setting (top_p, tool_workers and prompt_overflow once were)."""
    evaluation, rollouts = cfg.settings.evaluation, cfg.settings.rollouts
    return EvalSettings(
        num_prompts=evaluation.num_prompts,
        samples=evaluation.samples,
        temperature=evaluation.temperature,
        max_response_tokens=evaluation.max_response_tokens or rollouts.max_response_tokens,
        top_p=evaluation.top_p,
        tool_workers=rollouts.tool_workers,
        prompt_overflow=rollouts.prompt_overflow,
        seed=cfg.seed,
    )


def sample_held_out(
    engine: RolloutEngine,
    env_creator: Callable[[], Any],
    *,
    num_prompts: int | None,
    samples: int,
    temperature: float,
    max_response_tokens: int,
    top_p: float = 1.0,
    tool_workers: int = 8,
    prompt_overflow: str = "error",
    seed: int = 0,
) -> list[Group]:
    """Run the held-out protocol with any rollout engine and return its groups (one per task, in task order).

    Args:
        engine: A RolloutEngine (the algorithm's, or an HFEngine over any checkpoint folder).
        env_creator: Zero-argument factory of the evaluation environment (the held-out split).
        num_prompts: First N tasks of the split; None = all.
        samples: n samples per task.
        temperature: 0 = greedy.
        max_response_tokens: Response budget per trajectory.
        top_p: Nucleus mass when sampling.
        tool_workers: Threads for tool calls.
        prompt_overflow: "error" or "left_truncate".
        seed: Base seed of the sampling requests.
    """
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.sampler import TreeSampler

    env = env_creator()
    total = env.num_tasks if num_prompts is None else min(num_prompts, env.num_tasks)
    sampling = SamplingParams(
        max_new_tokens=max_response_tokens, temperature=temperature, top_p=top_p, stop=tuple(env.stop_sequences)
    )
    sampler = TreeSampler(
        engine,
        env_creator,
        TreeConfig.grpo(samples),
        sampling,
        max_response_tokens=max_response_tokens,
        tool_workers=tool_workers,
        prompt_overflow=prompt_overflow,
        seed=seed,
    )
    groups: list[Group] = []
    try:
        for start in range(0, total, EVAL_CHUNK):
            chunk, _ = sampler.sample(list(range(start, min(start + EVAL_CHUNK, total))), step=0)
            groups += chunk
    finally:
        sampler.close()
    return groups


def evaluate_engine(engine: RolloutEngine, env_creator: Callable[[], Any], **settings: Any) -> dict[str, float]:
    """Run the held-out protocol with any rollout engine and return flat metrics (the keyword arguments are
    :func:`sample_held_out`'s)."""
    t0 = time.perf_counter()
    out = MK.quality(MK.summarize(sample_held_out(engine, env_creator, **settings)))
    out[MK.EVAL_TIME_S] = time.perf_counter() - t0
    return out


def evaluate_policy(algo: Any, env_creator: Callable[[], Any]) -> dict[str, float]:
    """The algorithm's evaluate(): its engine (current weights) under its config's evaluation settings."""
    return evaluate_engine(algo.engine, env_creator, **eval_settings(algo.config).as_kwargs())
