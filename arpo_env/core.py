"""``ToolTextEnv``: a Gymnasium environment where one action is one macro action of a tool-using LLM.

An action is the text the policy wrote in one turn: it ends with a tool call's closing tag (the engines' stop
strings, ``env.stop_sequences``), with the final answer, or at end of text. ``step`` returns as observation EXACTLY
the text to append after the action (the formatted tool result), so a token-level consumer tokenizes only that
segment. The reward is computed on the whole response (every action and observation concatenated), as the reference
scorer sees it. Policy output never raises; configuration mistakes raise :class:`ConfigError` naming the key.

Example:
    >>> env = ToolTextEnv(task="toolmath", tools={"python": {}})
    >>> question, info = env.reset(seed=0)
    >>> info["messages"][0]["role"], info["messages"][1]["content"] == question
    ('system', True)
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from arpo_base.errors import ArpoError, ConfigError
from arpo_base.options import check_choice, check_keys
from arpo_env.protocol import ToolProtocol
from arpo_env.rewards import REWARDS
from arpo_env.session import (
    SESSION_CHOICES,
    SESSION_DEFAULTS,
    TEXT_MAX_CHARS,
    SessionStep,
    ToolSession,
    build_tools_from_spec,
    check_session_config,
)
from arpo_env.tasks.registry import DEFAULT_TASK, task_spec
from arpo_env.tools.registry import default_settings

# Text spaces: every Unicode code point of the Basic Multilingual Plane except the surrogates (U+D800-U+DFFF),
# i.e. all printable ASCII, whitespace, Latin, Greek, math symbols, CJK, typographic quotes. Characters outside the BMP
# (emoji) can still appear in real tool output; gymnasium only checks observations passively.
TEXT_CHARSET: frozenset[str] = frozenset(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF)

#: Every task's config keys: the task, its split and reward, plus the session keys (:data:`SESSION_DEFAULTS`; the
#: tool-call limit and tools default per task).
COMMON_DEFAULTS: dict[str, Any] = {
    "task": DEFAULT_TASK,
    "split": "train",
    "reward": None,
    "reward_kwargs": {},
    **SESSION_DEFAULTS,
    "max_tool_calls": None,
    "expose_answer": False,
}
CHOICES = {**SESSION_CHOICES, "split": ("train", "test")}


def resolve_config(config: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Merge a config dict and keyword arguments over the defaults; unknown or invalid keys raise ConfigError."""
    merged = dict(config or {})
    for key, value in kwargs.items():
        if key in merged and merged[key] != value:
            raise ConfigError(f"env config: {key} given twice with different values ({merged[key]!r}, {value!r})")
        merged[key] = value
    task = merged.get("task", COMMON_DEFAULTS["task"])
    spec = task_spec(task)
    allowed = {**COMMON_DEFAULTS, **spec.keys}
    check_keys(merged, allowed, f"env config (task {task!r})")
    cfg = {**allowed, **merged}
    for key, options in CHOICES.items():
        check_choice(key, cfg[key], options, "env config")
    if cfg["reward"] is None:
        cfg["reward"] = spec.reward
    check_choice("reward", cfg["reward"], tuple(sorted(REWARDS)), "env config")
    if cfg["max_tool_calls"] is None:
        cfg["max_tool_calls"] = spec.max_tool_calls
    check_session_config(cfg, "env config")
    if not isinstance(cfg["expose_answer"], bool):
        raise ConfigError(f"env config: expose_answer must be true or false, got {cfg['expose_answer']!r}")
    if not isinstance(cfg["reward_kwargs"], Mapping):
        raise ConfigError(f"env config: reward_kwargs must be a dict, got {cfg['reward_kwargs']!r}")
    return cfg


@functools.lru_cache(maxsize=1)
def _text_space() -> spaces.Text:
    # Built once: a Text space over ~63k characters costs tens of ms, and envs are created often (one per rollout).
    return spaces.Text(max_length=TEXT_MAX_CHARS, min_length=0, charset=TEXT_CHARSET)


def build_env_tools(cfg: dict[str, Any]) -> dict[str, Any]:
    """The env's tools: built from a spec (shared per identical spec, tools are stateless handles) or given objects;
    no spec = the task's default tools."""
    tools = cfg["tools"]
    return build_tools_from_spec(tools, default_settings(task_spec(cfg["task"]).tools, cfg) if tools is None else None)


class ToolTextEnv(gym.Env):
    """A multi-turn tool-use text environment (one action = one macro action). See the module docstring.

    Args:
        config: a config dict (Ray Tune passes one dict); see :data:`COMMON_DEFAULTS` and each task's ``keys`` in
            :data:`arpo_env.tasks.registry.TASKS`.
        render_mode: None or "ansi" (``render()`` returns the transcript).
        **kwargs: config keys as keyword arguments (``gym.make(id, **cfg)`` and RLlib pass these).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, config: Mapping[str, Any] | None = None, render_mode: str | None = None, **kwargs: Any):
        if render_mode not in (None, "ansi"):
            raise ConfigError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.config = resolve_config(config, **kwargs)
        self.tasks = task_spec(self.config["task"]).build(self.config)
        self.tools = build_env_tools(self.config)
        self.session = ToolSession({k: self.config[k] for k in SESSION_DEFAULTS if k != "tools"}, tools=self.tools)
        self.protocol: ToolProtocol = self.session.protocol
        self.reward_fn = REWARDS[self.config["reward"]]
        self.observation_space = _text_space()
        self.action_space = _text_space()
        self._task: dict[str, Any] | None = None
        self._messages: list[dict[str, str]] = []
        self._done = True

    # ------------------------------------------------------------------------------------------ properties

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """Stop strings the generation engine must use (the closing tags of tool calls)."""
        return self.protocol.stop_sequences

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def response(self) -> str:
        """All actions and observations of the current episode, concatenated."""
        return self.session.response

    def default_system_prompt(self) -> str:
        """The system prompt of a task that brings none of its own (what a served agent trained here is shown)."""
        return self._system_prompt({})

    def _system_prompt(self, task: dict[str, Any]) -> str:
        if self.config["system_prompt"] is not None:
            return self.config["system_prompt"]
        if self.config["protocol"] == "json":
            return self.session.system_prompt()
        return task.get("system") or getattr(self.tasks, "system_prompt", None) or self.session.system_prompt()

    # ------------------------------------------------------------------------------------------ gym API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on a random task (or ``options={"task_index": i}``); obs is the question."""
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = set(options) - {"task_index"}
        if unknown:
            raise ConfigError(f"unknown reset option(s) {sorted(unknown)}; known: ['task_index']")
        if "task_index" in options:
            index = options["task_index"]
            if not isinstance(index, int) or not 0 <= index < self.num_tasks:
                raise ConfigError(f"reset option 'task_index' must be in [0, {self.num_tasks}), got {index!r}")
        else:
            index = int(self.np_random.integers(self.num_tasks))
        task = dict(self.tasks[index])
        task["index"] = index
        self._task = task
        self.session.reset()
        self._done = False
        messages = [
            {"role": "system", "content": self._system_prompt(task)},
            {"role": "user", "content": task["question"]},
        ]
        self._messages = messages
        public_task = _public_task(task, answer=self.config["expose_answer"])
        return task["question"], {"messages": messages, "task": public_task, "stop_sequences": self.stop_sequences}

    def task_record(self, index: int) -> dict[str, Any]:
        """Task ``index`` as arpo's own readers record it (sampler, demonstrations, trees): the fields ``reset`` puts
        in ``info["task"]`` plus the task's ``ground_truth``, read from the task list, so they never depend on
        ``expose_answer`` (``info`` withholds the answer by default: a caller feeding ``info`` into a prompt or a log
        would otherwise give the answer away)."""
        if not isinstance(index, int) or not 0 <= index < self.num_tasks:
            raise ConfigError(f"task index must be in [0, {self.num_tasks}), got {index!r}")
        return _public_task({**self.tasks[index], "index": index}, answer=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one macro action (the :class:`ToolSession` does the turn); see the module docstring."""
        if self._task is None or self._done:
            raise ArpoError("step() called without an active episode", hint="call reset() first")
        st = self.session.step(action)
        info = _info(st)
        if not st.done:
            return st.observation, 0.0, False, False, info
        return self._finish(info, terminated=st.kind != "turn_limit")

    def _finish(self, info: dict[str, Any], terminated: bool) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._done = True
        task = self._task
        assert task is not None, "only step() finishes an episode, and it checked that one is active"
        kwargs = {**task.get("reward_kwargs", {}), **self.config["reward_kwargs"]}
        score, breakdown = self.reward_fn(self.response, task["ground_truth"], **kwargs)
        info["reward_info"] = {"reward_name": self.config["reward"], "score": float(score), **breakdown}
        info["truncated_by"] = None if terminated else "max_turns"
        return "", float(score), terminated, not terminated, info

    # gymnasium types render() with a free TypeVar (RenderFrame) that no concrete return type can match; text is what
    # its "ansi" render mode returns by convention.
    def render(self) -> str | None:  # type: ignore[override]
        """The transcript (question + response) for ``render_mode="ansi"``."""
        if self.render_mode != "ansi" or self._task is None:
            return None
        return f"{self._task['question']}\n---\n{self.response}"

    def clone(self) -> ToolTextEnv:
        """An independent copy in identical state (history, counters, task, RNG); tools and data are shared."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for name in ("_task", "_messages", "_np_random"):
            if name in self.__dict__:
                new.__dict__[name] = copy.deepcopy(self.__dict__[name])
        new.session = self.session.clone()
        return new

    def seed_tools(self, seed: int | None) -> None:
        """Seed this episode's persistent interpreters (:meth:`arpo_env.session.ToolSession.seed_tools`); a reset
        clears it."""
        self.session.seed_tools(seed)

    def fork(self) -> ToolTextEnv:
        """:meth:`clone` under the name other RL libraries' tree searches use: with ``tools.python.persistent``
        the copy's interpreter is a fork of this one's (docs/concepts/stateful-tools.md)."""
        return self.clone()

    def close(self) -> None:
        """End this env's persistent interpreters (stateless tools hold nothing)."""
        self.session.close()


def _public_task(task: Mapping[str, Any], answer: bool) -> dict[str, Any]:
    """A task's fields a caller may see (the system prompt and reward settings are the env's own business); the
    answer only when asked for."""
    hidden = ("system", "reward_kwargs") if answer else ("system", "reward_kwargs", "ground_truth")
    return {k: v for k, v in task.items() if k not in hidden}


def _info(st: SessionStep) -> dict[str, Any]:
    """The gymnasium ``info`` of one step (the session's turn in the env's historical key names)."""
    return {
        "kind": st.action_kind,
        "parse_status": st.parse_status,
        "problem": st.problem,
        "tool": st.tool,
        "args": dict(st.args),
        "latency_s": st.latency_s,
        "cache_hit": st.cache_hit,
        "tool_error": st.tool_error,
        "tool_output": st.tool_output,
        "tool_meta": dict(st.tool_meta),
        "append_eos": st.append_eos,
        **st.counts,
    }
