"""An arpo environment behind TRL's ``GRPOTrainer(environment_factory=...)`` interface (TRL 1.16).

TRL builds one environment instance per rollout, calls ``reset(**row)`` with the dataset row, exposes every public
method of the class as a tool the model may call (its JSON schema read from the method's signature and docstring),
and hands the instances to the reward functions as ``environments``. :func:`trl_environment` returns such a class for
any arpo env: one method per tool of the env (named after the tool, with the tool's own schema), each running its
call through ``env.step``, so the env's sandboxed tools, tool-call limit and bookkeeping apply; :func:`trl_reward`
scores each rollout's final assistant message with the env's own reward. Tool calls travel in the env's JSON
protocol (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), the format TRL parses.

Example (TRL installed with ``pip install "arpo[bench]"``)::

    Env = trl_environment("arpo/ToolMath-v0", levels=[1])
    rows = trl_rows(Env, 8)  # {"prompt": [system, user], "task_index": i}
    GRPOTrainer(model=..., reward_funcs=trl_reward, train_dataset=Dataset.from_list(rows), environment_factory=Env)

Invariant: the answer never reaches the model or the rows (the env withholds it from ``info``); only the env's reward
reads it.
"""

from __future__ import annotations

import json
import keyword
from typing import Any

from arpo_base.errors import ArpoError, ConfigError

#: The TRL line this adapter follows (``environment_factory`` and its ``environments`` reward argument).
TRL_REQUIREMENT = "trl==1.16.*"
TRL_HINT = 'pip install "arpo[bench]" (TRL is an optional dependency: ' + TRL_REQUIREMENT + ")"

#: The system message of :func:`trl_rows`: TRL's chat template lists the tools itself, so it only says how to answer.
TRL_SYSTEM = (
    "Solve the problem step by step. To compute, call a tool; its output comes back to you. "
    "Give the final answer as <answer>\\boxed{answer}</answer>."
)

_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def require_trl() -> Any:
    """The ``trl`` module; :class:`ArpoError` naming the extra to install when TRL (or its ``datasets``) is missing."""
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as e:
        raise ArpoError(f"TRL is not installed ({type(e).__name__}: {e})", hint=TRL_HINT) from None
    major_minor = tuple(int(p) for p in trl.__version__.split(".")[:2])
    if major_minor != (1, 16):
        raise ArpoError(f"TRL {trl.__version__} is installed; this adapter follows {TRL_REQUIREMENT}", hint=TRL_HINT)
    return trl


class TRLEnvironment:
    """Base of the classes :func:`trl_environment` makes; TRL calls the tool methods the subclass adds.

    Public methods are tools for TRL, so everything else here is private except ``reset`` (which TRL requires).
    """

    _env_id: str = ""
    _config: dict[str, Any] = {}

    def __init__(self) -> None:
        from arpo_env import ENV_IDS
        from arpo_env.core import ToolTextEnv

        task = ENV_IDS.get(self._env_id, {}).get("task")
        self._env = ToolTextEnv({**self._config, **({"task": task} if task else {})})
        self._reward: float | None = None
        self._tool_calls = 0

    def reset(self, task_index: int, **_row: Any) -> None:
        """Start the episode on task ``task_index`` of the env; the question is already the row's prompt, so nothing is
        appended to it (``None``)."""
        self._env.reset(options={"task_index": int(task_index)})
        self._reward, self._tool_calls = None, 0

    def _call(self, tool: str, arguments: dict[str, Any]) -> str:
        if self._reward is not None:
            return "the episode has ended (tool-call limit reached); give the final answer"
        call = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
        _, reward, terminated, truncated, info = self._env.step(f"<tool_call>{call}</tool_call>")
        self._tool_calls += 1
        if terminated or truncated:  # the env ended the episode (tool-call limit): its reward is final
            self._reward = float(reward)
            return str(info.get("problem") or "the tool-call limit is reached; no more tool calls")
        return str(info.get("tool_output") or info.get("problem") or "")

    def _finish(self, final_text: str) -> float:
        """Hand the final assistant message to the env; its reward (0 for an episode the message did not end)."""
        if self._reward is None:
            _, reward, terminated, truncated, _ = self._env.step(final_text)
            self._reward = float(reward) if (terminated or truncated) else 0.0
        return self._reward


def trl_environment(env_id: str = "arpo/ToolMath-v0", **env_config: Any) -> type[TRLEnvironment]:
    """A class for TRL's ``environment_factory``: an arpo env (a registered id, its config as keyword arguments)
    with one method per tool. The env runs in the JSON protocol (the tool-call format TRL parses); another protocol
    is refused."""
    require_trl()
    from arpo_env import ENV_IDS
    from arpo_env.core import ToolTextEnv

    if env_id not in ENV_IDS:
        raise ConfigError(f"unknown env {env_id!r} for TRL", hint=f"one of {sorted(ENV_IDS)}")
    if env_config.get("protocol", "json") != "json":
        raise ConfigError(
            f"protocol={env_config['protocol']!r}: TRL parses JSON tool calls only", hint="leave protocol unset"
        )
    config = {**env_config, "protocol": "json"}
    probe = ToolTextEnv({**config, "task": ENV_IDS[env_id]["task"]})  # validates the config and lists the tools
    try:
        methods = {name: _tool_method(tool.schema()) for name, tool in probe.tools.items()}
    finally:
        probe.close()
    name = "".join(c for c in env_id.split("/")[-1].split("-")[0] if c.isalnum()) + "TRLEnvironment"
    return type(name, (TRLEnvironment,), {"_env_id": env_id, "_config": config, **methods})


def _tool_method(schema: dict[str, Any]) -> Any:
    """A method with the tool's name, typed parameters and a Google-style docstring: what TRL (through transformers'
    ``get_json_schema``) turns back into the tool's schema."""
    import inspect

    spec = schema.get("function", schema)
    params = spec.get("parameters", {}).get("properties", {})
    required = set(spec.get("parameters", {}).get("required", []))
    bad = [p for p in params if not p.isidentifier() or keyword.iskeyword(p)]
    if bad or not spec["name"].isidentifier():
        raise ConfigError(f"tool {spec['name']!r}: names {bad or [spec['name']]} cannot be Python parameters for TRL")

    def method(self: TRLEnvironment, **arguments: Any) -> str:
        return self._call(spec["name"], arguments)

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    for p, prop in params.items():
        kind = _JSON_TYPES.get(prop.get("type", "string"), str)
        default = inspect.Parameter.empty if p in required else None
        parameters.append(inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind))
        annotations[p] = kind
    method.__signature__ = inspect.Signature(parameters, return_annotation=str)
    method.__annotations__ = annotations
    method.__name__ = method.__qualname__ = spec["name"]
    args = "\n".join(f"    {p}: {prop.get('description') or p}" for p, prop in params.items())
    method.__doc__ = f"{spec.get('description') or spec['name']}\n\nArgs:\n{args}\n\nReturns:\n    The tool's output."
    return method


def trl_rows(environment: type[TRLEnvironment], n: int | None = None, split: str = "train") -> list[dict[str, Any]]:
    """Dataset rows for TRL: ``{"prompt": [system, user], "task_index": i}`` for the first ``n`` tasks of ``split``
    (all when None). The answer is not in a row."""
    from arpo_env import ENV_IDS
    from arpo_env.core import ToolTextEnv

    env = ToolTextEnv({**environment._config, "split": split, "task": ENV_IDS[environment._env_id]["task"]})
    count = env.num_tasks if n is None else min(n, env.num_tasks)
    rows = []
    for i in range(count):
        question, _ = env.reset(options={"task_index": i})
        prompt = [{"role": "system", "content": TRL_SYSTEM}, {"role": "user", "content": question}]
        rows.append({"prompt": prompt, "task_index": i})
    env.close()
    return rows


def trl_reward(
    prompts: list[Any], completions: list[Any], environments: list[TRLEnvironment], **_kwargs: Any
) -> list[float]:
    """TRL reward function: each rollout's env scores its final assistant message with the env's own reward."""
    out = []
    for completion, env in zip(completions, environments, strict=True):
        if isinstance(completion, str):
            text = completion
        else:
            texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
            text = texts[-1] if texts else ""
        out.append(env._finish(text if isinstance(text, str) else str(text)))
    return out
