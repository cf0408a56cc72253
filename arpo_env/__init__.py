"""arpo_env: Gymnasium environments for tool-using LLM agents (ARPO protocol, tools, rewards, tasks).

Importing this package registers the environments with Gymnasium (idempotent, string entry points):
``arpo/ToolMath-v0``, ``arpo/Reasoning-v0``, ``arpo/DeepSearch-v0``. It never imports torch, Ray or vLLM.

Example:
    >>> import gymnasium as gym, arpo_env
    >>> "arpo/ToolMath-v0" in gym.registry
    True
"""

from __future__ import annotations

import gymnasium as gym

from arpo_env.tasks.registry import TASKS

# Gymnasium id -> the env kwargs that select its task (from the task registry).
ENV_IDS: dict[str, dict[str, str]] = {spec.env_id: {"task": name} for name, spec in TASKS.items()}
ENTRY_POINT = "arpo_env.core:ToolTextEnv"
# Ids whose tasks come from the reference data files (check/CLI report them as skipped when the data is missing).
DATA_BACKED = tuple(spec.env_id for spec in TASKS.values() if spec.data_backed)


def register_envs() -> None:
    """Register every arpo environment with Gymnasium (safe to call repeatedly, e.g. inside Ray workers); tasks
    registered later (:func:`arpo_env.tasks.registry.register_task`) are added here too."""
    for name, spec in TASKS.items():
        ENV_IDS.setdefault(spec.env_id, {"task": name})
    global DATA_BACKED
    DATA_BACKED = tuple(spec.env_id for spec in TASKS.values() if spec.data_backed)
    for env_id, kwargs in ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=ENTRY_POINT, kwargs=dict(kwargs), disable_env_checker=False)


register_envs()


def __getattr__(name: str):  # lazy re-exports keep `import arpo_env` light
    if name == "ToolTextEnv":
        from arpo_env.core import ToolTextEnv

        return ToolTextEnv
    if name in ("ToolProtocol", "JsonToolProtocol", "ParsedAction"):
        from arpo_env import protocol

        return getattr(protocol, name)
    if name == "REWARDS":
        from arpo_env.rewards import REWARDS

        return REWARDS
    raise AttributeError(f"module 'arpo_env' has no attribute {name!r}")


__all__ = ["ENV_IDS", "DATA_BACKED", "register_envs", "ToolTextEnv", "ToolProtocol", "JsonToolProtocol", "REWARDS"]
