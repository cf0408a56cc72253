"""The one rollout summarizer (:func:`summarize`) and its metric names, used by the sampler, the algorithm and eval.

Quality of the sampled trajectories (plain names; training logs them at the top level, eval under ``evaluation/``):
``reward_mean``, ``reward_max``, ``accuracy`` (fraction correct, :func:`is_correct`; eval's pass@1), ``pass_at_k``
(fraction of groups with a correct trajectory), ``tool_calls_per_traj``, ``format_ok``, ``response_len`` (mean tokens
per trajectory), ``tokens_sampled`` (trained tokens), ``num_trajectories``, ``num_tasks``, ``samples_per_task``.
How they were sampled (``rollout/...``): the tree's shape, tokens and KV reuse, tool calls, entropies around tool
results, finish reasons, engine counters and timers (the sampler passes its paths, engine stats and timers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ROLLOUT = "rollout/"
#: The section of the held-out evaluation's numbers: the quality names below, as ``evaluation/accuracy``.
EVALUATION = "evaluation/"
#: The run folder's section for the training summary names below (``train/reward_mean`` in metrics.jsonl).
TRAIN = "train/"
#: The Algorithm's timer section (``timers/rollout_time``) and its timers.
TIMERS = "timers/"
SYNC_TIME, ROLLOUT_TIME, UPDATE_TIME = "sync_time", "rollout_time", "update_time"
#: Seconds spent writing the iteration's rollout trees (``rollouts.record_trees``).
RECORD_TIME = "record_time"
#: Trajectories sampled since the run started (RLlib lifetime sum).
TRAJECTORIES_LIFETIME = "num_trajectories_lifetime"
#: Seconds one held-out evaluation took.
EVAL_TIME_S = "time_s"

REWARD_MEAN = "reward_mean"
REWARD_MAX = "reward_max"
ACCURACY = "accuracy"
PASS_AT_K = "pass_at_k"
TOOL_CALLS_PER_TRAJ = "tool_calls_per_traj"
FORMAT_OK = "format_ok"
RESPONSE_LEN = "response_len"
TOKENS_SAMPLED = "tokens_sampled"
TRAJECTORIES = "num_trajectories"
NUM_TASKS = "num_tasks"
SAMPLES_PER_TASK = "samples_per_task"
# Throughput and health of a training iteration, added by the Algorithm next to the quality names.
TOKENS_PER_S = "tokens_per_s"  # sampled tokens per second of rollout
UPDATE_TOKENS_PER_S = "update_tokens_per_s"  # trained tokens per second of learner update
NAN_UPDATES_SKIPPED = "nan_updates_skipped"  # updates skipped for a non-finite loss or gradient norm

TOKENS_GENERATED = "rollout/tokens_generated"  # sampled tokens (engine), premonitor probes included
TOKENS_PREFILLED = "rollout/tokens_prefilled"  # context tokens the engine had to compute
TOKENS_REUSED = "rollout/tokens_reused"  # context tokens served from shared-prefix KV
KV_REUSE_RATE = "rollout/kv_reuse_rate"  # reused / (reused + prefilled)
# tokens in the output trajectories (inserted + sampled; a shared prefix counted once per path)
RESPONSE_TOKENS = "rollout/response_tokens"
TOOL_CALLS = "rollout/tool_calls"  # tool executions (each shared prefix's calls counted once)
TOOL_CACHE_HIT_RATE = "rollout/tool_cache_hit_rate"
BRANCHES = "rollout/branches"
BRANCHES_AT_DEPTH = "rollout/branches_depth_{}"  # format with the depth of the new branch (1 = branch of an initial)
FILLUPS = "rollout/fillups"
INITIAL_SAMPLES = "rollout/initial_samples"  # mean per prompt (pre-monitoring's m)
MAX_DEPTH = "rollout/max_depth"
ENTROPY_BEFORE_TOOL = "rollout/entropy_before_tool"  # mean token entropy of the k sampled tokens before a result
ENTROPY_AFTER_TOOL = "rollout/entropy_after_tool"  # ... of the k sampled tokens right after a result
ENGINE_ERRORS = "rollout/engine_errors"
ENV_ERRORS = "rollout/env_errors"
FINISH = "rollout/finish_{}"  # fraction of trajectories per finish reason
TIME_GENERATE = "rollout/time_generate_s"
TIME_TOOLS = "rollout/time_tools_s"
TIME_OVERHEAD = "rollout/time_overhead_s"
TIME_TOTAL = "rollout/time_total_s"
STOP_BOUNDARY_CUTS = "rollout/stop_boundary_cuts"  # turns cut at a stop string that spanned two requests
BRANCH_DECISIONS = "rollout/branch_decisions"  # branch decisions taken with budget free and depth left
# How often the branch policy branched, from the trees' decision records: a candidate is a post-tool position the
# policy was asked at (budget free, depth left), its opportunities the clones it could make there (the cap, min(Z,
# free budget)). A random arm at tree.random_rate = p makes p opportunities' worth of branches in expectation, so an
# entropy arm's BRANCHES_PER_OPPORTUNITY is the p of its equal-count control (per group: diag/branches_per_group).
BRANCH_CANDIDATES = "rollout/branch_candidates"
BRANCH_OPPORTUNITIES = "rollout/branch_opportunities"
BRANCHES_PER_CANDIDATE = "rollout/branches_per_candidate"  # branches / candidates (at most the mean cap)
BRANCHES_PER_OPPORTUNITY = "rollout/branches_per_opportunity"  # branches / opportunities, in [0, 1]
# Policy versions (learner updates applied): the version that sampled the batch and how far the learner's version at
# update time is ahead of it, over the batch's trajectories (asynchronous rollouts: at most rollouts.max_staleness).
POLICY_VERSION = "rollout/policy_version"
STALENESS_MEAN = "rollout/staleness_mean"
STALENESS_MAX = "rollout/staleness_max"

# The tree counters of one prompt, in ``Group.metrics`` (:func:`arpo_algo.rollout.tree_state.assemble_group`);
# :func:`summarize` adds them up over the groups into the ``rollout/`` names above.
GROUP_STEP = "step"  # the training iteration that sampled the group
GROUP_TOKENS_GENERATED = "tokens_generated"
GROUP_TOOL_CALLS = "tool_calls"
GROUP_INITIAL_SAMPLES = "initial_samples"
GROUP_FILLUPS = "fillups"
GROUP_BRANCHES = "branches"
GROUP_BRANCH_CANDIDATES = "branch_candidates"
GROUP_BRANCH_OPPORTUNITIES = "branch_opportunities"
GROUP_MAX_DEPTH = "max_depth"
GROUP_BRANCHES_AT_DEPTH = "branches_depth_{}"  # format with the depth, as BRANCHES_AT_DEPTH

# The sampler's timers of one step (the ``timers`` argument of :func:`summarize`): seconds, then counts.
TIMER_GENERATE = "generate"
TIMER_TOOLS = "tools"
TIMER_TOTAL = "total"
TIMER_STOP_BOUNDARY_CUTS = "stop_boundary_cuts"
TIMER_BRANCH_DECISIONS = "branch_decisions"


def mean(values: Iterable[float]) -> float:
    """Mean of ``values``; 0.0 when empty (a metric, not a statistic: an empty step logs 0)."""
    vals = list(values)
    return sum(vals) / len(vals) if vals else 0.0


def is_correct(traj: Any) -> bool:
    """Whether a finished trajectory's answer is right (F1 of 1.0 for QA rewards, else a score of at least 1.0)."""
    info = traj.reward_info
    if "f1" in info:
        return float(info["f1"]) >= 1.0
    if "score" in info:
        return float(info["score"]) >= 1.0
    return False


def summarize(
    groups: list,
    *,
    paths: Iterable[Any] = (),
    engine_stats: dict[str, float] | None = None,
    timers: dict[str, float] | None = None,
) -> dict[str, float]:
    """All metrics of a list of :class:`~arpo_algo.rollout.types.Group` (see the module docstring for the names).

    Args:
        groups: The groups (their ``metrics`` hold the tree counters the sampler recorded).
        paths: The sampler's paths (entropies around tool results); empty = those two metrics are 0.
        engine_stats: ``engine.stats()`` of the step (HFEngine keys; every key also passes through as
            ``rollout/engine/<key>``); None = no engine metrics.
        timers: Seconds spent in "generate", "tools" and "total" and the step's counts (the ``TIMER_*`` keys);
            None = no timing metrics.
    """
    trajs = [t for g in groups for t in g.trajectories]
    n = len(trajs)
    out = _quality(groups, trajs)
    out.update(
        {
            TOOL_CALLS: sum(g.metrics.get(GROUP_TOOL_CALLS, 0.0) for g in groups),
            BRANCHES: sum(g.metrics.get(GROUP_BRANCHES, 0.0) for g in groups),
            BRANCH_CANDIDATES: sum(g.metrics.get(GROUP_BRANCH_CANDIDATES, 0.0) for g in groups),
            BRANCH_OPPORTUNITIES: sum(g.metrics.get(GROUP_BRANCH_OPPORTUNITIES, 0.0) for g in groups),
            FILLUPS: sum(g.metrics.get(GROUP_FILLUPS, 0.0) for g in groups),
            INITIAL_SAMPLES: mean(g.metrics.get(GROUP_INITIAL_SAMPLES, 0.0) for g in groups),
            MAX_DEPTH: max((g.metrics.get(GROUP_MAX_DEPTH, 0.0) for g in groups), default=0.0),
            RESPONSE_TOKENS: float(sum(len(t.response_ids) for t in trajs)),
            ENTROPY_BEFORE_TOOL: mean(x for p in paths for x in p.ent_before),
            ENTROPY_AFTER_TOOL: mean(x for p in paths for x in p.ent_after),
            ENGINE_ERRORS: float(sum(t.finish_reason == "error" and "engine_error" in t.reward_info for t in trajs)),
            ENV_ERRORS: float(sum("env_error" in t.reward_info for t in trajs)),
            TOOL_CACHE_HIT_RATE: mean(float(c.get("cache_hit", False)) for t in trajs for c in t.tool_calls),
        }
    )
    out.update(branch_rates(out))
    for g in groups:
        for k, v in g.metrics.items():
            if k.startswith(GROUP_BRANCHES_AT_DEPTH.format("")):
                out[ROLLOUT + k] = out.get(ROLLOUT + k, 0.0) + v
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    for r, k in reasons.items():
        out[FINISH.format(r or "unknown")] = k / n
    if engine_stats is not None:
        gen = engine_stats.get("generated_tokens")
        out[TOKENS_GENERATED] = (
            float(gen) if gen is not None else sum(g.metrics.get(GROUP_TOKENS_GENERATED, 0.0) for g in groups)
        )
        prefilled, reused = engine_stats.get("prefill_tokens", 0.0), engine_stats.get("reused_tokens", 0.0)
        out[TOKENS_PREFILLED], out[TOKENS_REUSED] = prefilled, reused
        out[KV_REUSE_RATE] = reused / (reused + prefilled) if reused + prefilled else 0.0
        for k, v in engine_stats.items():
            out[f"{ROLLOUT}engine/{k}"] = float(v)
    if timers is not None:
        total = timers.get(TIMER_TOTAL, 0.0)
        out[TIME_GENERATE], out[TIME_TOOLS] = timers.get(TIMER_GENERATE, 0.0), timers.get(TIMER_TOOLS, 0.0)
        out[TIME_TOTAL] = total
        out[TIME_OVERHEAD] = max(0.0, total - out[TIME_GENERATE] - out[TIME_TOOLS])
        out[STOP_BOUNDARY_CUTS] = float(timers.get(TIMER_STOP_BOUNDARY_CUTS, 0))
        out[BRANCH_DECISIONS] = float(timers.get(TIMER_BRANCH_DECISIONS, 0))
    return out


def branch_rates(metrics: dict[str, float]) -> dict[str, float]:
    """The branch rates of summed counts (:data:`BRANCHES`, :data:`BRANCH_CANDIDATES`, :data:`BRANCH_OPPORTUNITIES`);
    a rate with nothing to divide by is 0 (a step without candidates branched nowhere)."""
    branches = metrics.get(BRANCHES, 0.0)
    cands, opps = metrics.get(BRANCH_CANDIDATES, 0.0), metrics.get(BRANCH_OPPORTUNITIES, 0.0)
    return {
        BRANCHES_PER_CANDIDATE: branches / cands if cands else 0.0,
        BRANCHES_PER_OPPORTUNITY: branches / opps if opps else 0.0,
    }


def quality(metrics: dict[str, float]) -> dict[str, float]:
    """Only the trajectory-quality metrics of a :func:`summarize` result (what eval reports)."""
    return {k: v for k, v in metrics.items() if not k.startswith(ROLLOUT)}


def _quality(groups: list, trajs: list) -> dict[str, float]:
    n = len(trajs)
    if not n:
        return {TRAJECTORIES: 0.0, NUM_TASKS: float(len(groups))}
    correct = [is_correct(t) for t in trajs]
    return {
        REWARD_MEAN: mean(t.reward for t in trajs),
        REWARD_MAX: max(t.reward for t in trajs),
        ACCURACY: sum(correct) / n,
        PASS_AT_K: mean(float(any(is_correct(t) for t in g.trajectories)) for g in groups),
        TOOL_CALLS_PER_TRAJ: sum(len(t.tool_calls) for t in trajs) / n,
        FORMAT_OK: sum(bool(t.reward_info.get("format_ok", False)) for t in trajs) / n,
        RESPONSE_LEN: sum(len(t.response_ids) for t in trajs) / n,
        TOKENS_SAMPLED: float(sum(sum(t.trained_mask) for t in trajs)),
        TRAJECTORIES: float(n),
        NUM_TASKS: float(len(groups)),
        SAMPLES_PER_TASK: n / len(groups),
    }


# RLlib's result names (what its guides and Tune examples stop and rank on), reported beside arpo's own. An episode is
# one trajectory (one root-to-leaf path of a tree: a tree's shared prefix counts once per path, as each path is its own
# episode); an env step is one ``env.step``, i.e. one model turn (a run of sampled tokens between tool results).
ENV_RUNNERS = "env_runners/"
EPISODE_RETURN_MEAN = "episode_return_mean"
EPISODE_RETURN_MAX = "episode_return_max"
EPISODE_RETURN_MIN = "episode_return_min"
EPISODE_LEN_MEAN = "episode_len_mean"
NUM_EPISODES = "num_episodes"
NUM_ENV_STEPS_SAMPLED = "num_env_steps_sampled"
NUM_EPISODES_LIFETIME = "num_episodes_lifetime"
NUM_ENV_STEPS_SAMPLED_LIFETIME = "num_env_steps_sampled_lifetime"


def model_turns(traj: Any) -> int:
    """The trajectory's model turns (env steps): the runs of sampled tokens, each ended by a tool result or the end."""
    mask = traj.trained_mask
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def rllib_results(groups: Iterable[Any]) -> dict[str, float]:
    """The iteration's RLlib-named numbers (``env_runners/`` section, without that prefix) over ``groups``."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {NUM_EPISODES: 0.0, NUM_ENV_STEPS_SAMPLED: 0.0}
    turns = [model_turns(t) for t in trajs]
    return {
        EPISODE_RETURN_MEAN: mean(t.reward for t in trajs),
        EPISODE_RETURN_MAX: max(t.reward for t in trajs),
        EPISODE_RETURN_MIN: min(t.reward for t in trajs),
        EPISODE_LEN_MEAN: mean(turns),
        NUM_EPISODES: float(len(trajs)),
        NUM_ENV_STEPS_SAMPLED: float(sum(turns)),
    }


def staleness(groups: Iterable[Any], learner_version: int) -> dict[str, float]:
    """:data:`POLICY_VERSION`, :data:`STALENESS_MEAN` and :data:`STALENESS_MAX` of a batch the learner at
    ``learner_version`` is about to train on. Every trajectory must carry its sampling version."""
    versions = [t.policy_version for g in groups for t in g.trajectories]
    if not versions or any(v is None for v in versions):
        raise ValueError("every trajectory of a training batch must record the policy version that sampled it")
    lags = [learner_version - v for v in versions]
    return {POLICY_VERSION: mean(versions), STALENESS_MEAN: mean(lags), STALENESS_MAX: float(max(lags))}
