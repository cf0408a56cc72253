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
import json
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from arpo_env.errors import ArpoError, ConfigError
from arpo_env.options import check_choice, check_keys
from arpo_env.protocol import DEFAULT_MAX_ACTION_CHARS, DEFAULT_MAX_ARG_CHARS, ToolProtocol, build_protocol
from arpo_env.rewards import REWARDS

# Text spaces: every Unicode code point of the Basic Multilingual Plane except the surrogates (U+D800-U+DFFF),
# i.e. all printable ASCII, whitespace, Latin, Greek, math symbols, CJK, typographic quotes. Characters outside the BMP
# (emoji) can still appear in real tool output; gymnasium only checks observations passively.
TEXT_CHARSET: frozenset[str] = frozenset(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF)
TEXT_MAX_CHARS = 131_072  # also a hard cap on one observation (results are cut to fit, with a visible marker)

TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # task: default tools (order = stop-string order), reward, max_tool_calls
    "toolmath": {"tools": ("python",), "reward": "math_equiv", "max_tool_calls": 4},
    "reasoning": {"tools": ("python", "search"), "reward": "arpo_reference", "max_tool_calls": 3},
    "deepsearch": {"tools": ("python", "search"), "reward": "arpo_reference", "max_tool_calls": 6},
}
COMMON_DEFAULTS: dict[str, Any] = {
    "task": "toolmath",
    "split": "train",
    "protocol": "arpo",
    "result_format": "train",
    "tools": None,
    "reward": None,
    "reward_kwargs": {},
    "max_tool_calls": None,
    "max_turns": 16,
    "max_result_chars": None,
    "max_action_chars": DEFAULT_MAX_ACTION_CHARS,
    "max_arg_chars": DEFAULT_MAX_ARG_CHARS,
    "on_tool_limit": "end_with_eos",
    "on_invalid_call": "error_observation",
    "system_prompt": None,
}
TASK_KEYS: dict[str, dict[str, Any]] = {
    "toolmath": {"levels": (1, 2, 3), "num_tasks": None},
    "reasoning": {"data_dir": None, "data_files": None, "keep_boxed_bug": False},
    "deepsearch": {"data_dir": None, "data_files": None, "keep_boxed_bug": False},
}
CHOICES = {
    "protocol": ("arpo", "json"),
    "result_format": ("train", "eval"),
    "on_tool_limit": ("end_with_eos", "error_observation"),
    "on_invalid_call": ("error_observation", "end"),
    "split": ("train", "test"),
}


def resolve_config(config: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Merge a config dict and keyword arguments over the defaults; unknown or invalid keys raise ConfigError."""
    merged = dict(config or {})
    for key, value in kwargs.items():
        if key in merged and merged[key] != value:
            raise ConfigError(f"env config: {key} given twice with different values ({merged[key]!r}, {value!r})")
        merged[key] = value
    task = merged.get("task", COMMON_DEFAULTS["task"])
    check_choice("task", task, tuple(TASK_DEFAULTS), "env config")
    allowed = {**COMMON_DEFAULTS, **TASK_KEYS[task]}
    check_keys(merged, allowed, f"env config (task {task!r})")
    cfg = {**allowed, **merged}
    for key, options in CHOICES.items():
        check_choice(key, cfg[key], options, "env config")
    if cfg["reward"] is None:
        cfg["reward"] = TASK_DEFAULTS[task]["reward"]
    check_choice("reward", cfg["reward"], tuple(sorted(REWARDS)), "env config")
    if cfg["max_tool_calls"] is None:
        cfg["max_tool_calls"] = TASK_DEFAULTS[task]["max_tool_calls"]
    for key in ("max_tool_calls", "max_turns", "max_action_chars", "max_arg_chars", "max_result_chars"):
        value = cfg[key]
        if value is None and key == "max_result_chars":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "max_tool_calls" else 1):
            raise ConfigError(f"env config: {key} must be a positive integer, got {value!r}")
    if not isinstance(cfg["reward_kwargs"], Mapping):
        raise ConfigError(f"env config: reward_kwargs must be a dict, got {cfg['reward_kwargs']!r}")
    return cfg


@functools.lru_cache(maxsize=1)
def _text_space() -> spaces.Text:
    # Built once: a Text space over ~63k characters costs tens of ms, and envs are created often (one per rollout).
    return spaces.Text(max_length=TEXT_MAX_CHARS, min_length=0, charset=TEXT_CHARSET)


_TOOL_SETS: dict[str, dict[str, Any]] = {}


def _default_tool_spec(cfg: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for name in TASK_DEFAULTS[cfg["task"]]["tools"]:
        if name == "search":
            from arpo_env.data import find_data_file

            cache_json = find_data_file("search_cache.json", cfg.get("data_dir"))
            spec["search"] = {"backend": "replay", "cache_json": str(cache_json)}
        else:
            spec[name] = {}
    return spec


def build_env_tools(cfg: dict[str, Any]) -> dict[str, Any]:
    """The env's tools: built from a spec (shared per identical spec, tools are stateless handles) or given objects."""
    tools = cfg["tools"]
    if tools is not None and not isinstance(tools, Mapping):
        raise ConfigError(f"config key 'tools' must be a dict, got {type(tools).__name__}")
    if tools and all(callable(t) and hasattr(t, "schema") for t in tools.values()):
        return dict(tools)  # already-built tool objects
    spec = _default_tool_spec(cfg) if tools is None else dict(tools)
    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _TOOL_SETS:
        from arpo_env.tools import build_tools

        _TOOL_SETS[key] = build_tools(spec)
    return _TOOL_SETS[key]


def _make_tasks(cfg: dict[str, Any]) -> Any:
    if cfg["task"] == "toolmath":
        from arpo_env.tasks.toolmath import ToolMathTasks

        return ToolMathTasks(cfg["split"], cfg["levels"], cfg["num_tasks"])
    from arpo_env.tasks.reference import ReferenceTasks

    return ReferenceTasks(cfg["task"], cfg["split"], cfg["data_dir"], cfg["data_files"], cfg["keep_boxed_bug"])


class ToolTextEnv(gym.Env):
    """A multi-turn tool-use text environment (one action = one macro action). See the module docstring.

    Args:
        config: a config dict (Ray Tune passes one dict); see :data:`COMMON_DEFAULTS` and :data:`TASK_KEYS`.
        render_mode: None or "ansi" (``render()`` returns the transcript).
        **kwargs: config keys as keyword arguments (``gym.make(id, **cfg)`` and RLlib pass these).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, config: Mapping[str, Any] | None = None, render_mode: str | None = None, **kwargs: Any):
        if render_mode not in (None, "ansi"):
            raise ConfigError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.config = resolve_config(config, **kwargs)
        self.tasks = _make_tasks(self.config)
        self.tools = build_env_tools(self.config)
        self.protocol: ToolProtocol = build_protocol(
            self.config["protocol"],
            self.tools,
            result_format=self.config["result_format"],
            max_action_chars=self.config["max_action_chars"],
            max_arg_chars=self.config["max_arg_chars"],
        )
        missing = [t for t in self.protocol.tool_names if t not in self.tools]
        if missing:
            raise ConfigError(f"config key 'tools' lacks {missing}")
        self.reward_fn = REWARDS[self.config["reward"]]
        self.observation_space = _text_space()
        self.action_space = _text_space()
        self._task: dict[str, Any] | None = None
        self._history: list[str] = []
        self._counts: dict[str, int] = {}
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
        return "".join(self._history)

    def _system_prompt(self, task: dict[str, Any]) -> str:
        if self.config["system_prompt"] is not None:
            return self.config["system_prompt"]
        if self.config["protocol"] == "json":
            return self.protocol.system_prompt(self.tools)
        return task.get("system") or getattr(self.tasks, "system_prompt", None) or self.protocol.system_prompt()

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
        self._history = []
        self._counts = {"tool_calls": 0, "turns": 0, "invalid_actions": 0, "tool_errors": 0, "limit_hits": 0}
        self._done = False
        messages = [{"role": "system", "content": self._system_prompt(task)}, {"role": "user", "content": task["question"]}]
        self._messages = messages
        public_task = {k: v for k, v in task.items() if k not in ("system", "reward_kwargs")}
        return task["question"], {"messages": messages, "task": public_task, "stop_sequences": self.stop_sequences}

    def _info(self, parsed: Any) -> dict[str, Any]:
        return {
            "kind": parsed.kind,
            "parse_status": parsed.status,
            "problem": parsed.problem,
            "tool": parsed.tool,
            "args": dict(parsed.args),
            "latency_s": 0.0,
            "cache_hit": False,
            "tool_error": False,
            "tool_output": None,
            "tool_meta": {},
            "append_eos": False,
            **self._counts,
        }

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one macro action; see the module docstring for the returned observation."""
        if self._task is None or self._done:
            raise ArpoError("step() called without an active episode", hint="call reset() first")
        parsed = self.protocol.parse(action)
        self._counts["turns"] += 1
        # Lone surrogates cannot be encoded; keep the rest of the text (as "?") so rewards still see the response.
        self._history.append(action.encode("utf-8", "replace").decode("utf-8") if isinstance(action, str) else "")
        info = self._info(parsed)
        if parsed.kind in ("answer", "text"):
            return self._finish(info, terminated=True)
        if parsed.kind == "invalid":
            self._counts["invalid_actions"] += 1
            if self.config["on_invalid_call"] == "end":
                return self._finish(info, terminated=True)
            return self._continue(info, self.protocol.format_result(f"Error: {parsed.problem}."))
        if self._counts["tool_calls"] >= self.config["max_tool_calls"]:
            self._counts["limit_hits"] += 1
            if self.config["on_tool_limit"] == "end_with_eos":
                info["append_eos"] = True
                return self._finish(info, terminated=True)
            n = self.config["max_tool_calls"]
            return self._continue(info, self.protocol.format_result(f"Error: the tool call limit ({n}) is reached; no more tool calls, give the final answer."))
        if self._counts["turns"] >= self.config["max_turns"]:
            return self._finish(info, terminated=False)
        return self._continue(info, self._run_tool(parsed, info))

    def _run_tool(self, parsed: Any, info: dict[str, Any]) -> str:
        self._counts["tool_calls"] += 1
        try:
            result = self.tools[parsed.tool](**parsed.args)
        except Exception as e:  # tools must not raise; if one does, the policy still gets an observation
            from arpo_env.tools.base import ToolResult

            result = ToolResult(text=f"Error: Tool({parsed.tool}) execution failed with message: {e}", error=True)
        text = result.text if result.text != "" else f"Tool({parsed.tool}) returned empty output."
        if result.error:
            self._counts["tool_errors"] += 1
        info.update(latency_s=result.latency_s, cache_hit=result.cache_hit, tool_error=result.error,
                    tool_output=text, tool_meta=dict(result.meta))
        return self.protocol.format_result(self._truncate(text))

    def _truncate(self, text: str) -> str:
        limit = self.config["max_result_chars"]
        hard = TEXT_MAX_CHARS - 200  # leave room for the template and the marker
        limit = hard if limit is None else min(limit, hard)
        if len(text) <= limit:
            return text
        return f"{text[:limit]}\n[... truncated {len(text) - limit} characters]"

    def _continue(self, info: dict[str, Any], obs: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        info.update(self._counts)
        if self._counts["turns"] >= self.config["max_turns"]:
            return self._finish(info, terminated=False)
        self._history.append(obs)
        return obs, 0.0, False, False, info

    def _finish(self, info: dict[str, Any], terminated: bool) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._done = True
        info.update(self._counts)
        task = self._task
        kwargs = {**task.get("reward_kwargs", {}), **self.config["reward_kwargs"]}
        score, breakdown = self.reward_fn(self.response, task["ground_truth"], **kwargs)
        info["reward_info"] = {"reward_name": self.config["reward"], "score": float(score), **breakdown}
        info["truncated_by"] = None if terminated else "max_turns"
        return "", float(score), terminated, not terminated, info

    def render(self) -> str | None:
        """The transcript (question + response) for ``render_mode="ansi"``."""
        if self.render_mode != "ansi" or self._task is None:
            return None
        return f"{self._task['question']}\n---\n{self.response}"

    def clone(self) -> ToolTextEnv:
        """An independent copy in identical state (history, counters, task, RNG); tools and data are shared."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for name in ("_history", "_counts", "_task", "_messages", "_np_random"):
            if name in self.__dict__:
                new.__dict__[name] = copy.deepcopy(self.__dict__[name])
        return new
