"""Correct tool-use demonstrations for cold-start SFT, replayed through the real environment (ToolMath).

They live outside :mod:`arpo_env.tasks.toolmath` because they drive :class:`arpo_env.core.ToolTextEnv`, which itself
loads the task lists (keeping the import direction one-way: core -> tasks).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from arpo_base.errors import ArpoError, ConfigError
from arpo_env.core import ToolTextEnv
from arpo_env.tasks.toolmath import DEFAULT_LEVELS, Problem


def toolmath_demonstrations(
    n: int,
    seed: int = 0,
    split: str = "train",
    levels: Sequence[int] = DEFAULT_LEVELS,
    env_config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Correct tool-use demonstrations for cold-start SFT, produced by replaying them through the real env.

    Each step's code is run by the environment's real Python tool; later steps use the printed earlier results, and
    the final answer boxes the last printed result. Each demo is checked to score 1.0 through the env's reward.

    Args:
        n: number of demonstrations (distinct tasks, chosen by ``seed``).
        seed: picks which tasks of the split are used.
        split: "train" or "test".
        levels: difficulty levels.
        env_config: extra env config (e.g. ``{"tools": {...cache...}}`` to make repeated runs cache-friendly).

    Returns:
        ``[{"messages": [system, user], "segments": [(text, trained), ...], "answer": str, "task": {...}}]``;
        assistant segments are trained, tool-result segments are not.

    Raises:
        ArpoError: a demonstration did not score 1.0 (the Python tool is broken or too slow on this machine).
    """
    env = ToolTextEnv({**(env_config or {}), "task": "toolmath", "split": split, "levels": list(levels)})
    try:
        if n > env.num_tasks:
            raise ConfigError(f"n={n} exceeds the {env.num_tasks} tasks of split {split!r}")
        indices = random.Random(seed).sample(range(env.num_tasks), n)
        return [_one_demo(env, i) for i in indices]
    finally:
        env.close()


def _one_demo(env: Any, index: int) -> dict[str, Any]:
    _obs, info = env.reset(options={"task_index": index})
    problem: Problem = env.tasks.problem(index)
    segments: list[tuple[str, bool]] = []
    outputs: list[str] = []
    # A persistent interpreter keeps what earlier calls defined: its demonstrations use it instead of recomputing.
    persistent = getattr(env.tools.get("python"), "persistent", False)
    steps = problem.stateful_steps if persistent and problem.stateful_steps else problem.steps
    for k, (thought, make_expr) in enumerate(steps):
        action = f"{'' if k == 0 else chr(10)}<think>{thought}</think>\n<python>print({make_expr(outputs)})</python>"
        obs, _r, terminated, _t, step_info = env.step(action)
        if terminated or step_info["tool_error"]:
            raise ArpoError(f"demonstration for task {index} failed at step {k}: {step_info.get('tool_output')!r}")
        segments += [(action, True), (obs, False)]
        outputs.append(step_info["tool_output"].strip())
    final = f"\n<think>The answer is {outputs[-1]}.</think>\n<answer>\\boxed{{{outputs[-1]}}}</answer>"
    _obs, reward, terminated, _t, step_info = env.step(final)
    if not terminated or reward != 1.0:
        raise ArpoError(f"demonstration for task {index} scored {reward} (expected 1.0): {step_info['reward_info']}")
    segments.append((final, True))
    return {"messages": info["messages"], "segments": segments, "answer": outputs[-1], "task": env.task_record(index)}
