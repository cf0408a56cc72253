"""The task registry: every task family with its defaults, in ONE place.

A new task is one :class:`TaskSpec` in :data:`TASKS` (or :func:`register_task` from outside): its Gymnasium id, its
default tools, reward and tool-call limit, its own config keys with their defaults, and how to build its task list.
:func:`arpo_env.core.resolve_config`, :class:`arpo_env.core.ToolTextEnv`, the Gymnasium registration
(:data:`arpo_env.ENV_IDS`) and ``arpo env list`` all read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.options import check_choice


@dataclass(frozen=True)
class TaskSpec:
    """One task family.

    Attributes:
        env_id: The Gymnasium id ("arpo/ToolMath-v0").
        tools: Default tools (their order is the stop-string order).
        reward: Default reward name (a key of :data:`arpo_env.rewards.REWARDS`).
        max_tool_calls: Default tool-call limit per episode.
        keys: The family's own config keys and their defaults (beyond the common ones).
        build: ``build(resolved_config) -> task sequence`` (dicts with id, question, ground_truth, split, ...).
        data_backed: Tasks come from data files (``arpo data pull``); checks skip it when they are missing.
    """

    env_id: str
    tools: tuple[str, ...]
    reward: str
    max_tool_calls: int
    build: Callable[[Mapping[str, Any]], Any]
    keys: Mapping[str, Any] = field(default_factory=dict)
    data_backed: bool = False


def _toolmath(cfg: Mapping[str, Any]) -> Any:
    from arpo_env.tasks.toolmath import ToolMathTasks

    return ToolMathTasks(cfg["split"], cfg["levels"], cfg["num_tasks"])


def _reference(cfg: Mapping[str, Any]) -> Any:
    from arpo_env.tasks.reference import ReferenceTasks

    return ReferenceTasks(cfg["task"], cfg["split"], cfg["data_dir"], cfg["data_files"], cfg["keep_boxed_bug"])


_REFERENCE_KEYS = {"data_dir": None, "data_files": None, "keep_boxed_bug": False}

#: The task of an env config that names none.
DEFAULT_TASK = "toolmath"

#: task name -> its spec.
TASKS: dict[str, TaskSpec] = {
    "toolmath": TaskSpec(
        "arpo/ToolMath-v0", ("python",), "math_equiv", 4, _toolmath, {"levels": (1, 2, 3), "num_tasks": None}
    ),
    "reasoning": TaskSpec(
        "arpo/Reasoning-v0", ("python", "search"), "arpo_reference", 3, _reference, _REFERENCE_KEYS, data_backed=True
    ),
    "deepsearch": TaskSpec(
        "arpo/DeepSearch-v0", ("python", "search"), "arpo_reference", 6, _reference, _REFERENCE_KEYS, data_backed=True
    ),
}


def register_task(name: str, spec: TaskSpec) -> None:
    """Add a task family (then ``arpo_env.register_envs()`` registers its Gymnasium id)."""
    if name in TASKS and TASKS[name] != spec:
        raise ConfigError(f"task {name!r} is already registered with another spec")
    TASKS[name] = spec


def task_spec(name: str, where: str = "env config") -> TaskSpec:
    """The spec of task ``name``; ConfigError naming the known ones (and the closest) otherwise."""
    check_choice("task", name, tuple(sorted(TASKS)), where)
    return TASKS[name]
