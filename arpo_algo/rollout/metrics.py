"""Metric keys shared by the sampler, the learner and the algorithm, so dashboards and tests use one spelling."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ROLLOUT = "rollout/"

TOKENS_GENERATED = "rollout/tokens_generated"  # sampled tokens (engine), premonitor probes included
TOKENS_PREFILLED = "rollout/tokens_prefilled"  # context tokens the engine had to compute
TOKENS_REUSED = "rollout/tokens_reused"  # context tokens served from shared-prefix KV
KV_REUSE_RATE = "rollout/kv_reuse_rate"  # reused / (reused + prefilled)
RESPONSE_TOKENS = "rollout/response_tokens"  # tokens in the output trajectories (inserted + sampled, shared counted per path)
TOOL_CALLS = "rollout/tool_calls"  # tool executions (each shared prefix's calls counted once)
TOOL_CACHE_HIT_RATE = "rollout/tool_cache_hit_rate"
TRAJECTORIES = "rollout/trajectories"
BRANCHES = "rollout/branches"
BRANCHES_AT_DEPTH = "rollout/branches_depth_{}"  # format with the depth of the new branch (1 = branch of an initial)
FILLUPS = "rollout/fillups"
INITIAL_SAMPLES = "rollout/initial_samples"  # mean per prompt (AEPO's m)
MAX_DEPTH = "rollout/max_depth"
ENTROPY_BEFORE_TOOL = "rollout/entropy_before_tool"  # mean token entropy of the k sampled tokens before a result
ENTROPY_AFTER_TOOL = "rollout/entropy_after_tool"  # ... of the k sampled tokens right after a result
REWARD_MEAN = "rollout/reward_mean"
ENGINE_ERRORS = "rollout/engine_errors"
ENV_ERRORS = "rollout/env_errors"
FINISH = "rollout/finish_{}"  # fraction of trajectories per finish reason
TIME_GENERATE = "rollout/time_generate_s"
TIME_TOOLS = "rollout/time_tools_s"
TIME_OVERHEAD = "rollout/time_overhead_s"
TIME_TOTAL = "rollout/time_total_s"
STOP_BOUNDARY_CUTS = "rollout/stop_boundary_cuts"  # turns cut at a stop string that spanned two requests
BRANCH_DECISIONS = "rollout/branch_decisions"  # branch decisions taken with budget free and depth left


def mean(values: Iterable[float]) -> float:
    """Mean of ``values``; 0.0 when empty (a metric, not a statistic: an empty step logs 0)."""
    vals = list(values)
    return sum(vals) / len(vals) if vals else 0.0


def step_metrics(groups: list, paths: list, engine_stats: dict[str, float], timers: dict[str, float]) -> dict[str, float]:
    """One sampler step's rollout metrics from its groups, its paths and the engine's counters.

    Args:
        groups: The step's :class:`~arpo_algo.rollout.types.Group` list (their ``metrics`` are summed).
        paths: Every sampler path of the step (for entropies around tool results).
        engine_stats: ``engine.stats()`` since the step began (HFEngine keys; others pass through as
            ``rollout/engine/<key>``).
        timers: Seconds spent in "generate", "tools" and "total".
    """
    trajs = [t for g in groups for t in g.trajectories]
    out: dict[str, float] = {
        TRAJECTORIES: float(len(trajs)),
        TOOL_CALLS: sum(g.metrics.get("tool_calls", 0.0) for g in groups),
        BRANCHES: sum(g.metrics.get("branches", 0.0) for g in groups),
        FILLUPS: sum(g.metrics.get("fillups", 0.0) for g in groups),
        INITIAL_SAMPLES: mean(g.metrics.get("initial_samples", 0.0) for g in groups),
        MAX_DEPTH: max((g.metrics.get("max_depth", 0.0) for g in groups), default=0.0),
        RESPONSE_TOKENS: float(sum(len(t.response_ids) for t in trajs)),
        REWARD_MEAN: mean(t.reward for t in trajs),
        ENTROPY_BEFORE_TOOL: mean(x for p in paths for x in p.ent_before),
        ENTROPY_AFTER_TOOL: mean(x for p in paths for x in p.ent_after),
        ENGINE_ERRORS: float(sum(t.finish_reason == "error" and "engine_error" in t.reward_info for t in trajs)),
        ENV_ERRORS: float(sum("env_error" in t.reward_info for t in trajs)),
    }
    for g in groups:
        for k, v in g.metrics.items():
            if k.startswith("branches_depth_"):
                key = ROLLOUT + k
                out[key] = out.get(key, 0.0) + v
    calls = [c for t in trajs for c in t.tool_calls]
    out[TOOL_CACHE_HIT_RATE] = mean(float(c.get("cache_hit", False)) for c in calls)
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    for r, n in reasons.items():
        out[FINISH.format(r or "unknown")] = n / len(trajs)
    gen = engine_stats.get("generated_tokens")
    out[TOKENS_GENERATED] = float(gen) if gen is not None else sum(g.metrics.get("tokens_generated", 0.0)
                                                                    for g in groups)
    prefilled, reused = engine_stats.get("prefill_tokens", 0.0), engine_stats.get("reused_tokens", 0.0)
    out[TOKENS_PREFILLED], out[TOKENS_REUSED] = prefilled, reused
    out[KV_REUSE_RATE] = reused / (reused + prefilled) if reused + prefilled else 0.0
    for k, v in engine_stats.items():
        out[f"{ROLLOUT}engine/{k}"] = float(v)
    total = timers.get("total", 0.0)
    out[TIME_GENERATE], out[TIME_TOOLS], out[TIME_TOTAL] = timers.get("generate", 0.0), timers.get("tools", 0.0), total
    out[TIME_OVERHEAD] = max(0.0, total - out[TIME_GENERATE] - out[TIME_TOOLS])
    out[STOP_BOUNDARY_CUTS] = float(timers.get("stop_boundary_cuts", 0))
    out[BRANCH_DECISIONS] = float(timers.get("branch_decisions", 0))
    return out


def is_correct(traj: Any) -> bool:
    """Whether a finished trajectory's answer is right (F1 of 1.0 for QA rewards, else a score of at least 1.0)."""
    info = traj.reward_info
    if "f1" in info:
        return float(info["f1"]) >= 1.0
    if "score" in info:
        return float(info["score"]) >= 1.0
    return False


def summarize_groups(groups: list[Any]) -> dict[str, float]:
    """Per-iteration training metrics computed from the sampled groups themselves."""
    trajs = [t for g in groups for t in g.trajectories]
    n = max(len(trajs), 1)
    rewards = [t.reward for t in trajs]
    sampled = sum(sum(t.trained_mask) for t in trajs)
    return {
        "reward_mean": sum(rewards) / n,
        "reward_max": max(rewards) if rewards else 0.0,
        "accuracy": sum(1.0 for t in trajs if is_correct(t)) / n,
        "tool_calls_per_traj": sum(len(t.tool_calls) for t in trajs) / n,
        "branches": float(sum(1 for t in trajs if t.kind == "branch")),
        "response_len": sum(len(t.response_ids) for t in trajs) / n,
        "tokens_sampled": float(sampled),
        "num_trajectories": float(len(trajs)),
    }
