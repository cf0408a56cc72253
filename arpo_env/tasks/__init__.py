"""Task families behind the registered environments.

* ``toolmath``: generated problems needing Python (:mod:`arpo_env.tasks.toolmath`), no data files.
* ``reasoning``: ``train_10k`` / ``valid`` reference parquet files (math + multi-hop QA).
* ``deepsearch``: ``hard_search_1k`` / ``gaia_test`` + ``hle_test``.

Each family is one :class:`~arpo_env.tasks.registry.TaskSpec` in :data:`~arpo_env.tasks.registry.TASKS` (a new task
touches only that registry). A task list is a sequence of dicts with at least ``id``, ``question``, ``ground_truth``,
``split`` and ``reward_kwargs`` (extra arguments for the reward, e.g. a numeric tolerance), plus an optional
``system`` prompt.
"""

from __future__ import annotations

from arpo_env.tasks.registry import TASKS, TaskSpec, register_task
from arpo_env.tasks.toolmath import ToolMathTasks

__all__ = ["TASKS", "TaskSpec", "ToolMathTasks", "register_task"]
