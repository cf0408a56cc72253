"""Protocol parsing: the ARPO tag protocol and the JSON tool-call protocol, including malformed input."""

from __future__ import annotations

import pytest

from arpo_base.errors import ConfigError
from arpo_env.protocol import JsonToolProtocol, ToolProtocol, apply_boxed_bug, build_protocol, fix_boxed_bug

P = ToolProtocol()


def test_defaults_match_reference():
    assert P.stop_sequences == ("</python>", "</search>")
    assert P.format_result("x") == " <result>\nx\n</result>"
    assert ToolProtocol(result_format="eval").format_result("x") == "<result>x</result>"
    assert P.format_result("{braces} {result}") == " <result>\n{braces} {result}\n</result>"


def test_argument_is_between_last_open_and_last_close_stripped():
    a = P.parse("<think>hm <python> not this</think> <python>\n  print(1)\n </python>")
    assert (a.kind, a.tool, a.args) == ("tool_call", "python", {"code": "print(1)"})
    s = P.parse("<think>q</think><search>  capital of France </search>  \n")
    assert (s.kind, s.tool, s.args) == ("tool_call", "search", {"query": "capital of France"})


@pytest.mark.parametrize(
    ("action", "status"),
    [
        ("<think>x</think><python>   </python>", "empty_argument"),
        ("<python>print(1)</python><python>print(2)</python>", "multiple_calls"),
        ("<python>print(1)</python> trailing words", "text_after_call"),
        ("<python>print(1)", "unclosed_tag"),
        ("print(1)</python>", "unclosed_tag"),
        ("<python><search>x</python>", "nested_tags"),
        ("<python>" + "1" * 20_000 + "</python>", "argument_too_long"),
        ("x" * 40_000, "action_too_long"),
        ("\udc80<python>print(1)</python>", "invalid_unicode"),
        (None, "not_text"),
    ],
)
def test_malformed_calls_are_invalid_not_exceptions(action, status):
    a = P.parse(action)
    assert a.kind == "invalid" and a.status == status and a.problem


def test_answer_and_plain_text():
    assert P.parse("<think>x</think> <answer>\\boxed{4}</answer>").kind == "answer"
    assert P.parse("just words, then EOS").kind == "text"
    assert P.parse("<calculator>1+1</calculator>").kind == "text"  # unknown tags are plain text in this protocol
    # an answer written after a call the engine failed to stop at still counts as the answer
    assert P.parse("<python>1</python><answer>\\boxed{1}</answer>").kind == "answer"


def test_only_configured_tags_are_tools():
    p = ToolProtocol({"python": "code"})
    assert p.stop_sequences == ("</python>",)
    assert p.parse("<search>x</search>").kind == "text"


def test_boxed_bug_round_trip():
    bugged = "within \x08oxed{} with latex"
    assert fix_boxed_bug(bugged) == "within \\boxed{} with latex"
    assert apply_boxed_bug(fix_boxed_bug(bugged)) == bugged


SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "run code",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
]


def test_json_protocol_parses_calls_and_lists_tools():
    j = JsonToolProtocol(SCHEMAS)
    assert j.stop_sequences == ("</tool_call>",)
    a = j.parse('<think>x</think><tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>')
    assert (a.kind, a.tool, a.args) == ("tool_call", "python", {"code": "print(2)"})
    double = j.parse('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>')
    assert double.args == {"query": "q"}
    prompt = j.system_prompt()
    assert "<tools>" in prompt and '"name": "python"' in prompt and '"name": "search"' in prompt
    assert j.format_result("r") == "\n<tool_response>\nr\n</tool_response>\n"


@pytest.mark.parametrize(
    ("action", "status"),
    [
        ("<tool_call>{not json}</tool_call>", "bad_json"),
        ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', "unknown_tool"),
        ('<tool_call>{"name": "python", "arguments": {}}</tool_call>', "bad_arguments"),
        ('<tool_call>{"name": "python", "arguments": {"code": "1", "x": 2}}</tool_call>', "bad_arguments"),
        ('<tool_call>{"name": "python", "arguments": {"code": " "}}</tool_call>', "empty_argument"),
        ('<tool_call>{"name": "python"', "unclosed_tag"),
        ("<tool_call></tool_call><tool_call></tool_call>", "multiple_calls"),
    ],
)
def test_json_protocol_malformed(action, status):
    a = JsonToolProtocol(SCHEMAS).parse(action)
    assert a.kind == "invalid" and a.status == status


def test_build_protocol_validates():
    with pytest.raises(ConfigError, match="protocol"):
        build_protocol("xml", {})
    with pytest.raises(ConfigError, match="result_format"):
        ToolProtocol(result_format="fancy")


def test_doctests():
    import doctest

    from arpo_env import core, protocol

    assert doctest.testmod(protocol).failed == 0
    assert doctest.testmod(core).failed == 0
