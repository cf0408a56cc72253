"""How a policy calls tools in plain text, defined in one place.

Two protocols share one interface (:class:`ToolProtocol`):

* the ARPO tag protocol (default): ``<python>CODE</python>`` / ``<search>QUERY</search>``, results inserted as
  ``" <result>\\n...\\n</result>"`` (reference training format,
  docs/concepts/reference-choices.md#interaction-protocol) or ``"<result>...</result>"``
  (``result_format="eval"``, the reference evaluation format), final answer in ``<answer>...\\boxed{X}...</answer>``;
* :class:`JsonToolProtocol`: chat-native ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen/Hermes
  style), with the tool list written into the system prompt from each tool's ``schema()``.

``parse(action)`` never raises on policy output; problems come back as ``ParsedAction(kind="invalid", problem=...)``.

Example:
    >>> p = ToolProtocol()
    >>> a = p.parse("<think>add</think> <python> print(1+2) </python>")
    >>> (a.kind, a.tool, a.args)
    ('tool_call', 'python', {'code': 'print(1+2)'})
    >>> p.format_result("3")
    ' <result>\\n3\\n</result>'
    >>> p.parse("<answer>\\\\boxed{3}</answer>").kind
    'answer'
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arpo_base.errors import ConfigError
from arpo_env.tools.registry import TOOLS

# The reference "code_search" system prompt (docs/concepts/reference-choices.md#interaction-protocol), with the
# `\x08oxed` data bug fixed. The buggy variant is
# produced by :func:`apply_boxed_bug` for bit-exact parity with the released parquet files.
ARPO_SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool and python interpreter tool. Given a question, you need to first think about the reasoning process "
    "in the mind and then provide the answer. During thinking, you can invoke the wikipedia search tool to search "
    "and python interpreter tool to calculate the math problem for fact information about specific topics if "
    "needed. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags "
    "respectively, and the search query and result are enclosed within <search> </search> and <result> </result> "
    "tags respectively. For example, <think> This is the reasoning process. </think> <search> search query here "
    "</search> <result> search result here </result> <think> This is the reasoning process. </think> <python> "
    "python code here </python> <result> python interpreter result here </result> <think> This is the reasoning "
    "process. </think> <answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of the "
    "answer, the final exact answer is enclosed within \\boxed{} with latex format."
)

RESULT_TEMPLATES = {
    "train": " <result>\n{result}\n</result>",  # reference training insertion (ROLL L422-426)
    "eval": "<result>{result}</result>",  # reference evaluation insertion (sample_processor.py)
}

DEFAULT_MAX_ACTION_CHARS = 32_768
DEFAULT_MAX_ARG_CHARS = 16_384


def fix_boxed_bug(text: str) -> str:
    """Repair the reference data bug where ``\\boxed`` became backspace + ``oxed``."""
    return text.replace("\x08oxed", "\\boxed")


def apply_boxed_bug(text: str) -> str:
    """The inverse of :func:`fix_boxed_bug`: reproduce the released prompts exactly."""
    return text.replace("\\boxed", "\x08oxed")


@dataclass
class ParsedAction:
    """One macro action, classified.

    Attributes:
        kind: ``"tool_call"`` (run ``tool`` with ``args``), ``"answer"`` (contains the final answer: episode ends),
            ``"text"`` (plain end of text without a call: episode ends) or ``"invalid"`` (malformed call).
        tool: the tool name for ``tool_call`` (and for invalid calls whose tool is known).
        args: keyword arguments for the tool.
        problem: a human-readable description for ``invalid`` actions (shown to the policy as the observation).
        status: a short machine-readable code (``ok``, ``empty_argument``, ``unclosed_tag``, ``multiple_calls``,
            ``nested_tags``, ``unknown_tool``, ``argument_too_long``, ``action_too_long``, ``invalid_unicode``,
            ``text_after_call``, ``bad_json``, ``not_text``).
    """

    kind: str
    tool: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    status: str = "ok"


def _invalid(status: str, problem: str, tool: str | None = None) -> ParsedAction:
    return ParsedAction(kind="invalid", tool=tool, problem=problem, status=status)


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class ToolProtocol:
    """The ARPO tag protocol (defaults reproduce the reference).

    Args:
        tag_tools: tag name -> keyword argument of the tool it calls (None: every tool of the tool registry,
            :mod:`arpo_env.tools.registry`, ``<python>`` -> ``code``, ``<search>`` -> ``query``).
        tag_names: tag name -> the name of the tool it calls (None, or a tag not in it: the tag is the name; with
            ``tag_tools=None``: the registry's names).
        result_format: ``"train"`` (reference training format) or ``"eval"`` (reference evaluation format).
        max_action_chars: longer actions are rejected as ``invalid`` (the reference has no limit).
        max_arg_chars: longer tool arguments are rejected as ``invalid`` (the reference has no limit).
    """

    answer_open = "<answer>"
    answer_close = "</answer>"

    def __init__(
        self,
        tag_tools: Mapping[str, str] | None = None,
        result_format: str = "train",
        max_action_chars: int = DEFAULT_MAX_ACTION_CHARS,
        max_arg_chars: int = DEFAULT_MAX_ARG_CHARS,
        tag_names: Mapping[str, str] | None = None,
    ) -> None:
        if result_format not in RESULT_TEMPLATES:
            raise ConfigError(f"result_format must be one of {sorted(RESULT_TEMPLATES)}, got {result_format!r}")
        if tag_tools is None:
            tag_tools = {spec.tag: spec.arg for spec in TOOLS.values()}
            tag_names = {spec.tag: spec.name for spec in TOOLS.values()}
        self.tag_tools = dict(tag_tools)
        self.tag_names = {tag: (tag_names or {}).get(tag, tag) for tag in self.tag_tools}
        if not self.tag_tools:
            raise ConfigError("tag_tools: at least one tool tag is required")
        self.result_format = result_format
        self.result_template = RESULT_TEMPLATES[result_format]
        self.max_action_chars = int(max_action_chars)
        self.max_arg_chars = int(max_arg_chars)
        self.stop_sequences: tuple[str, ...] = tuple(f"</{t}>" for t in self.tag_tools)

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.tag_names.values())

    def format_result(self, text: str) -> str:
        """The exact text appended after a tool-calling action."""
        return self.result_template.replace("{result}", text)

    def system_prompt(self, tools: Mapping[str, Any] | None = None) -> str:
        """The default system prompt (the reference ARPO prompt, ``\\boxed`` fixed)."""
        return ARPO_SYSTEM_PROMPT

    # -------------------------------------------------------------------------------------------------- parsing

    def _precheck(self, action: Any) -> ParsedAction | None:
        if not isinstance(action, str):
            return _invalid("not_text", f"the action must be text, got {type(action).__name__}")
        if len(action) > self.max_action_chars:
            return _invalid(
                "action_too_long", f"the action has {len(action)} characters (limit {self.max_action_chars})"
            )
        if _has_surrogates(action):
            return _invalid("invalid_unicode", "the action contains invalid Unicode (lone surrogates)")
        return None

    def _is_answer(self, action: str) -> bool:
        return self.answer_open in action and self.answer_close in action

    def parse(self, action: str) -> ParsedAction:
        """Classify one macro action (never raises)."""
        bad = self._precheck(action)
        if bad is not None:
            return bad
        closes = [(m.start(), m.group(1)) for m in re.finditer(r"</(\w+)>", action) if m.group(1) in self.tag_tools]
        if not closes:
            if self._is_answer(action):
                return ParsedAction(kind="answer")
            unclosed = [t for t in self.tag_tools if f"<{t}>" in action.rsplit(self.answer_close, 1)[-1]]
            if unclosed and not self._is_answer(action):
                t = unclosed[-1]
                return _invalid("unclosed_tag", f"<{t}> was opened but never closed with </{t}>", self.tag_names[t])
            return ParsedAction(kind="text")
        if len(closes) > 1:
            if self._is_answer(action) and action.rfind(self.answer_close) > closes[-1][0]:
                # A complete answer after earlier calls the engine did not stop at: treat as the final answer.
                return ParsedAction(kind="answer")
            return _invalid("multiple_calls", f"{len(closes)} tool calls in one turn; make one call, then wait")
        pos, tag = closes[0]
        close = f"</{tag}>"
        if action[pos + len(close) :].strip():
            if self._is_answer(action[pos:]):
                return ParsedAction(kind="answer")
            return _invalid(
                "text_after_call", f"text after </{tag}>; end the turn right after the tool call", self.tag_names[tag]
            )
        return self._parse_call(action, tag)

    def _parse_call(self, action: str, tag: str) -> ParsedAction:
        tool = self.tag_names[tag]
        open_ = f"<{tag}>"
        start = action.rfind(open_)
        end = action.rfind(f"</{tag}>")
        if start < 0 or start > end:
            return _invalid("unclosed_tag", f"</{tag}> without a matching <{tag}>", tool)
        # Reference (_extract_content): the text between the LAST <tag> and the last </tag>, stripped.
        arg = action[start + len(open_) : end].strip()
        if any(f"<{t}>" in arg or f"</{t}>" in arg for t in self.tag_tools):
            return _invalid("nested_tags", f"tool tags nested inside <{tag}>", tool)
        if not arg:
            return _invalid("empty_argument", f"empty <{tag}> call", tool)
        if len(arg) > self.max_arg_chars:
            return _invalid(
                "argument_too_long", f"<{tag}> argument has {len(arg)} characters (limit {self.max_arg_chars})", tool
            )
        return ParsedAction(kind="tool_call", tool=tool, args={self.tag_tools[tag]: arg})


JSON_RESULT_TEMPLATE = "\n<tool_response>\n{result}\n</tool_response>\n"


class JsonToolProtocol(ToolProtocol):
    """Chat-native JSON tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Args:
        schemas: OpenAI/Hermes function schemas (``{"type": "function", "function": {"name", "parameters"...}}`` or
            the bare ``{"name", "parameters"}``), usually ``[tool.schema() for tool in tools.values()]``.
        max_action_chars: see :class:`ToolProtocol`.
        max_arg_chars: limit on the JSON text of one call.
    """

    def __init__(
        self,
        schemas: Sequence[Mapping[str, Any]],
        max_action_chars: int = DEFAULT_MAX_ACTION_CHARS,
        max_arg_chars: int = DEFAULT_MAX_ARG_CHARS,
    ) -> None:
        self.schemas = [dict(s.get("function", s)) for s in schemas]
        if not self.schemas:
            raise ConfigError("JsonToolProtocol needs at least one tool schema")
        self.tag_tools = {s["name"]: "" for s in self.schemas}
        self.tag_names = {name: name for name in self.tag_tools}
        self.result_format = "json"
        self.result_template = JSON_RESULT_TEMPLATE
        self.max_action_chars = int(max_action_chars)
        self.max_arg_chars = int(max_arg_chars)
        self.stop_sequences = ("</tool_call>",)

    @classmethod
    def from_tools(cls, tools: Mapping[str, Any], **kwargs: Any) -> JsonToolProtocol:
        """Build the protocol from ``{name: tool}`` using each tool's ``schema()``."""
        return cls([t.schema() for t in tools.values()], **kwargs)

    def system_prompt(self, tools: Mapping[str, Any] | None = None) -> str:
        """A Hermes-style system prompt listing the tools as JSON schemas."""
        listing = "\n".join(json.dumps({"type": "function", "function": s}, ensure_ascii=False) for s in self.schemas)
        return (
            "You are a helpful assistant that solves the given question step by step. Think inside <think> </think>. "
            "You may call functions. Function signatures are inside <tools></tools>:\n<tools>\n"
            f"{listing}\n</tools>\n"
            "To call a function, write a JSON object with the function name and arguments inside "
            '<tool_call></tool_call>, e.g. <tool_call>{"name": "<function-name>", "arguments": {...}}</tool_call>. '
            "The result comes back inside <tool_response></tool_response>. Give the final answer as "
            "<answer> \\boxed{answer} </answer>."
        )

    def parse(self, action: str) -> ParsedAction:
        """Classify one macro action (never raises)."""
        bad = self._precheck(action)
        if bad is not None:
            return bad
        n_close = action.count("</tool_call>")
        if n_close == 0:
            if self._is_answer(action):
                return ParsedAction(kind="answer")
            if "<tool_call>" in action:
                return _invalid("unclosed_tag", "<tool_call> was opened but never closed with </tool_call>")
            return ParsedAction(kind="text")
        if n_close > 1:
            return _invalid("multiple_calls", f"{n_close} tool calls in one turn; make one call, then wait")
        end = action.rfind("</tool_call>")
        if action[end + len("</tool_call>") :].strip():
            return _invalid("text_after_call", "text after </tool_call>; end the turn right after the tool call")
        start = action.rfind("<tool_call>")
        if start < 0:
            return _invalid("unclosed_tag", "</tool_call> without a matching <tool_call>")
        body = action[start + len("<tool_call>") : end].strip()
        if not body:
            return _invalid("empty_argument", "empty <tool_call>")
        if len(body) > self.max_arg_chars:
            return _invalid("argument_too_long", f"tool call has {len(body)} characters (limit {self.max_arg_chars})")
        return self._parse_json(body)

    def _parse_json(self, body: str) -> ParsedAction:
        try:
            call = json.loads(body)
        except ValueError as e:
            return _invalid("bad_json", f"the tool call is not valid JSON ({e})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return _invalid("bad_json", 'the tool call must be {"name": ..., "arguments": {...}}')
        name, args = call["name"], call.get("arguments", {})
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            return _invalid("bad_json", "'arguments' must be a JSON object", name)
        schema = next((s for s in self.schemas if s["name"] == name), None)
        if schema is None:
            return _invalid("unknown_tool", f"unknown tool {name!r}; available: {', '.join(self.tag_tools)}", name)
        params = schema.get("parameters", {})
        missing = [p for p in params.get("required", []) if p not in args]
        unknown = [a for a in args if a not in params.get("properties", {})]
        if missing or unknown:
            what = f"missing {missing}" if missing else f"unknown arguments {unknown}"
            return _invalid("bad_arguments", f"bad arguments for {name}: {what}", name)
        if any(isinstance(v, str) and not v.strip() for v in args.values()) or not args:
            return _invalid("empty_argument", f"empty arguments for {name}", name)
        return ParsedAction(kind="tool_call", tool=name, args=dict(args))


def build_protocol(name: str, tools: Mapping[str, Any], result_format: str = "train", **limits: Any) -> ToolProtocol:
    """Protocol by name: ``"arpo"`` (tag protocol over the given tools, each with the tag and argument of its
    :class:`~arpo_env.tools.registry.ToolSpec`) or ``"json"``."""
    if name == "arpo":
        unknown = [t for t in tools if t not in TOOLS]
        if unknown:
            raise ConfigError(f"tools: the arpo tag protocol has no tag for {unknown}; use protocol='json'")
        specs = [TOOLS[t] for t in tools]
        return ToolProtocol(
            {s.tag: s.arg for s in specs},
            result_format=result_format,
            tag_names={s.tag: s.name for s in specs},
            **limits,
        )
    if name == "json":
        if result_format != "train":
            raise ConfigError("result_format applies to protocol='arpo' only")
        return JsonToolProtocol.from_tools(tools, **limits)
    raise ConfigError(f"protocol must be 'arpo' or 'json', got {name!r}")
