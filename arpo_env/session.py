"""``ToolSession``: the protocol, tools and limits of one tool-using conversation, without a task or a reward.

What serve needs (a live chat with tools), what :class:`arpo_env.core.ToolTextEnv` delegates its ``step`` to (the
env adds the task, the reward and gymnasium's API), and what :func:`arpo_algo.rollout.agent_loop.run_agents` drives.
One ``step(action)`` takes the text the model wrote in one turn and returns a :class:`SessionStep` whose
``observation`` is EXACTLY the text to append after it (the formatted tool result; empty when the conversation ends).

Example:
    >>> s = ToolSession(tools={"python": {}})
    >>> st = s.step("<python>print(6 * 7)</python>")
    >>> st.kind, st.tool_output.strip(), st.done
    ('tool', '42', False)
    >>> s.step("<answer>\\\\boxed{42}</answer>").kind
    'answer'
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from arpo_base.errors import ArpoError, ConfigError
from arpo_base.options import check_choice, check_keys
from arpo_env.protocol import DEFAULT_MAX_ACTION_CHARS, DEFAULT_MAX_ARG_CHARS, ToolProtocol, build_protocol

TEXT_MAX_CHARS = 131_072  # a hard cap on one observation (results are cut to fit, with a visible marker)

#: The task-free config keys with their defaults (``tools=None``: the python tool).
SESSION_DEFAULTS: dict[str, Any] = {
    "protocol": "arpo",
    "result_format": "train",
    "tools": None,
    "max_tool_calls": 4,
    "max_turns": 16,
    "max_result_chars": None,
    "max_action_chars": DEFAULT_MAX_ACTION_CHARS,
    "max_arg_chars": DEFAULT_MAX_ARG_CHARS,
    "on_tool_limit": "end_with_eos",
    "on_invalid_call": "error_observation",
    "system_prompt": None,
}
SESSION_CHOICES = {
    "protocol": ("arpo", "json"),
    "result_format": ("train", "eval"),
    "on_tool_limit": ("end_with_eos", "error_observation"),
    "on_invalid_call": ("error_observation", "end"),
}
_COUNTS = ("tool_calls", "turns", "invalid_actions", "tool_errors", "limit_hits")
_TOOL_SETS: dict[str, dict[str, Any]] = {}


def build_tools_from_spec(tools: Any, default: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Tools from a spec dict (shared per identical spec: tools are stateless handles) or already-built tool objects;
    ``None`` uses ``default`` (``{"python": {}}`` when not given)."""
    if tools is not None and not isinstance(tools, Mapping):
        raise ConfigError(f"config key 'tools' must be a dict, got {type(tools).__name__}")
    if tools and all(callable(t) and hasattr(t, "schema") for t in tools.values()):
        return dict(tools)  # already-built tool objects
    spec = dict(default if default is not None else {"python": {}}) if tools is None else dict(tools)
    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _TOOL_SETS:
        from arpo_env.tools import build_tools

        _TOOL_SETS[key] = build_tools(spec)
    return _TOOL_SETS[key]


def check_session_config(cfg: Mapping[str, Any], where: str = "session config") -> None:
    """Raise ConfigError for an invalid value of a session key (choices and integer limits)."""
    for key, options in SESSION_CHOICES.items():
        check_choice(key, cfg[key], options, where)
    for key in ("max_tool_calls", "max_turns", "max_action_chars", "max_arg_chars", "max_result_chars"):
        value = cfg[key]
        if value is None and key == "max_result_chars":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "max_tool_calls" else 1):
            raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")


@dataclass
class SessionStep:
    """What one turn did.

    Attributes:
        observation: The exact text to append after the action ("" when the conversation ended).
        done: The conversation ended (answer, plain text, invalid call with ``on_invalid_call="end"``, tool-call limit
            with ``on_tool_limit="end_with_eos"``, or the turn limit).
        kind: "tool" (a tool ran), "answer", "text", "invalid", "limit" (tool-call limit hit) or "turn_limit" (the
            turn limit ended the conversation; a tool may have run in that turn: see ``tool_output``).
        action_kind: What the parser saw in the action: "tool_call", "answer", "text" or "invalid".
        tool, args: The parsed call (None / {} when there was none).
        tool_output: The tool's text when a tool ran this turn, else None.
        tool_error: The tool reported an error.
        latency_s, cache_hit, tool_meta: From the tool's result.
        append_eos: The caller appends EOS (``on_tool_limit="end_with_eos"``).
        counts: Counters after this turn: tool_calls, turns, invalid_actions, tool_errors, limit_hits.
        parse_status, problem: The parser's status and problem text (invalid calls).
    """

    observation: str
    done: bool
    kind: str
    action_kind: str
    tool: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    tool_output: str | None = None
    tool_error: bool = False
    latency_s: float = 0.0
    cache_hit: bool = False
    tool_meta: dict[str, Any] = field(default_factory=dict)
    append_eos: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    parse_status: str = ""
    problem: str | None = None


class ToolSession:
    """One conversation's tool protocol, tools and limits (see the module docstring).

    Args:
        config: Task-free config keys (:data:`SESSION_DEFAULTS`); unknown keys raise ConfigError.
        **kwargs: The same keys as keyword arguments.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        merged = {**dict(config or {}), **kwargs}
        check_keys(merged, SESSION_DEFAULTS, "session config")
        self.config = {**SESSION_DEFAULTS, **merged}
        if self.config["max_tool_calls"] is None:
            self.config["max_tool_calls"] = SESSION_DEFAULTS["max_tool_calls"]
        check_session_config(self.config)
        self.tools = build_tools_from_spec(self.config["tools"])
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
        self.reset()

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """Stop strings the generation engine must use (the closing tags of tool calls)."""
        return self.protocol.stop_sequences

    @property
    def response(self) -> str:
        """All actions and observations so far, concatenated."""
        return "".join(self.history)

    @property
    def done(self) -> bool:
        return self._done

    def system_prompt(self) -> str:
        """The configured system prompt, else the protocol's (the JSON protocol lists the tools' schemas)."""
        if self.config["system_prompt"] is not None:
            return self.config["system_prompt"]
        if self.config["protocol"] == "json":
            return self.protocol.system_prompt(self.tools)
        return self.protocol.system_prompt()

    def reset(self) -> None:
        """Start a new conversation (history and counters cleared; persistent interpreters ended)."""
        self.close()
        self.tool_seed: int | None = None  # one conversation's: a new conversation is seeded anew (seed_tools)
        self.history: list[str] = []
        self.counts: dict[str, int] = dict.fromkeys(_COUNTS, 0)
        self._done = False

    def seed_tools(self, seed: int | None) -> None:
        """Seed this conversation's persistent interpreters: the first one a call starts seeds ``random`` and numpy
        from ``seed`` (clones continue its state instead; None: the OS). Set before the first tool call."""
        self.tool_seed = seed

    def clone(self) -> ToolSession:
        """An independent copy in the same state (tools and protocol shared)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.history, new.counts = list(self.history), dict(self.counts)
        new.config = copy.copy(self.config)
        # Persistent interpreters are forked: the copy continues from this state, and neither sees the other's
        # later changes. A fork that fails becomes that copy's error at its next call, never a fresh interpreter.
        new._interps = {}
        if self._interps:
            from arpo_env.tools.interpreter_fork import fork_or_failure

            new._interps = {name: fork_or_failure(i) for name, i in self._interps.items()}
        return new

    def fork(self) -> ToolSession:
        """The same as :meth:`clone` (the name other RL libraries' tree searches look for)."""
        return self.clone()

    def close(self) -> None:
        """End this conversation's persistent interpreters (a no-op for stateless tools)."""
        # The first close() (from __init__'s reset) runs before any interpreter exists, hence the getattr.
        interps: dict[str, Any] = getattr(self, "_interps", {})
        self._interps: dict[str, Any] = {}
        for interp in interps.values():
            interp.close()

    def step(self, action: str) -> SessionStep:
        """Apply one turn's text; see :class:`SessionStep`. Policy output never raises."""
        if self._done:
            raise ArpoError("step() after the conversation ended", hint="call reset() or start a new session")
        parsed = self.protocol.parse(action)
        self.counts["turns"] += 1
        # Lone surrogates cannot be encoded; keep the rest of the text (as "?") so rewards still see the response.
        self.history.append(action.encode("utf-8", "replace").decode("utf-8") if isinstance(action, str) else "")
        st = SessionStep(
            "",
            False,
            "tool" if parsed.kind == "tool_call" else parsed.kind,
            parsed.kind,
            tool=parsed.tool,
            args=dict(parsed.args),
            parse_status=parsed.status,
            problem=parsed.problem,
        )
        cfg = self.config
        if parsed.kind in ("answer", "text"):
            return self._end(st)
        if parsed.kind == "invalid":
            self.counts["invalid_actions"] += 1
            if cfg["on_invalid_call"] == "end":
                return self._end(st)
            return self._continue(st, self.protocol.format_result(f"Error: {parsed.problem}."))
        if self.counts["tool_calls"] >= cfg["max_tool_calls"]:
            self.counts["limit_hits"] += 1
            st.kind = "limit"
            if cfg["on_tool_limit"] == "end_with_eos":
                st.append_eos = True
                return self._end(st)
            n = cfg["max_tool_calls"]
            return self._continue(
                st,
                self.protocol.format_result(
                    f"Error: the tool call limit ({n}) is reached; no more tool calls, give the final answer."
                ),
            )
        if self.counts["turns"] >= cfg["max_turns"]:
            st.kind = "turn_limit"
            return self._end(st)
        return self._continue(st, self._run_tool(parsed, st))

    def _run_tool(self, parsed: Any, st: SessionStep) -> str:
        self.counts["tool_calls"] += 1
        from arpo_env.tools.sandbox import SandboxError, ToolCancelled

        tool = self.tools[parsed.tool]
        if getattr(tool, "persistent", False):  # this conversation's own interpreter, started by its first call
            if parsed.tool not in self._interps:
                self._interps[parsed.tool] = tool.open_interpreter(seed=self.tool_seed)
            tool = self._interps[parsed.tool]
        try:
            result = tool(**parsed.args)
        except (SandboxError, ToolCancelled):  # not the model's code failing: never an observation it is scored on
            raise
        except Exception as e:  # tools must not raise; if one does, the policy still gets an observation
            from arpo_env.tools.base import ToolResult

            result = ToolResult(text=f"Error: Tool({parsed.tool}) execution failed with message: {e}", error=True)
        text = result.text if result.text != "" else f"Tool({parsed.tool}) returned empty output."
        if result.error:
            self.counts["tool_errors"] += 1
        st.latency_s, st.cache_hit, st.tool_error = result.latency_s, result.cache_hit, result.error
        st.tool_output, st.tool_meta = text, dict(result.meta)
        return self.protocol.format_result(self._truncate(text))

    def _truncate(self, text: str) -> str:
        limit = self.config["max_result_chars"]
        hard = TEXT_MAX_CHARS - 200  # leave room for the template and the marker
        limit = hard if limit is None else min(limit, hard)
        if len(text) <= limit:
            return text
        return f"{text[:limit]}\n[... truncated {len(text) - limit} characters]"

    def _continue(self, st: SessionStep, obs: str) -> SessionStep:
        if self.counts["turns"] >= self.config["max_turns"]:
            st.kind = "turn_limit"
            return self._end(st)
        self.history.append(obs)
        st.observation = obs
        st.counts = dict(self.counts)
        return st

    def _end(self, st: SessionStep) -> SessionStep:
        self.close()  # the trajectory ended: so do its interpreters
        self._done = True
        st.done = True
        st.counts = dict(self.counts)
        return st
