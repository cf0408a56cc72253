"""The worked example of adding a tool (``examples/extend/tool.py``): its one registration line makes it a section of
the tools settings (``build_tools``, keys checked against its constructor), a tag of the tag protocol, a tag the
reward's format check reads and a function of the JSON protocol; one real ToolMath episode calls it."""

from __future__ import annotations

import importlib

import gymnasium as gym
import pytest

from arpo_base.errors import ConfigError
from arpo_env.protocol import JsonToolProtocol, ToolProtocol
from arpo_env.rewards import validate_format
from arpo_env.tools import build_tools
from arpo_env.tools.registry import TOOLS, register_tool


@pytest.fixture
def example():
    """The example module with its tool registered; unregistered after, so no other test sees a third tool."""
    module = importlib.import_module("examples.extend.tool")  # imported here: collection must not register it
    register_tool(module.SPEC)  # a no-op on the first import, which registered it
    try:
        yield module
    finally:
        TOOLS.pop("calculator", None)


def test_the_registered_tool_is_built_from_its_settings_section(example):
    tools = build_tools({"calculator": {"digits": 4}, "python": {}})
    assert list(tools) == ["python", "calculator"] and isinstance(tools["calculator"], example.Calculator)
    assert tools["calculator"](expression="2 / 3").text == "0.6667"
    assert tools["calculator"](expression="(3 + 4) * 2**10").text == "7168"
    bad = tools["calculator"](expression="__import__('os').getcwd()")
    assert bad.error and "only numbers" in bad.text
    assert tools["calculator"](expression="9 ** 9 ** 9").error
    with pytest.raises(ConfigError, match="tools.calculator: unknown key 'digit'") as err:
        build_tools({"calculator": {"digit": 3}})
    assert err.value.hint == "did you mean 'digits'?"


def test_the_protocols_and_the_reward_read_its_tag(example):
    protocol = ToolProtocol()
    assert "</calc>" in protocol.stop_sequences
    call = protocol.parse("<think>x</think> <calc>1 + 2</calc>")
    assert (call.kind, call.tool, call.args) == ("tool_call", "calculator", {"expression": "1 + 2"})
    bare = "<think>x</think> <calc>1 + 2</calc> <answer>\\boxed{3}</answer>"
    assert validate_format(bare) == (False, "<calc> call without a following <result>")
    schemas = JsonToolProtocol.from_tools(build_tools({"calculator": {}}))
    assert schemas.parse('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>').tool == (
        "calculator"
    )


def test_one_episode_calls_it_and_is_scored(example):
    env = gym.make("arpo/ToolMath-v0", levels=[1], tools={"calculator": {}}, reward="arpo_reference").unwrapped
    _, info = env.reset(seed=3)
    assert env.stop_sequences == ("</calc>",)
    expression = env.tasks.problem(info["task"]["index"]).steps[0][1]([])  # the scripted model's call
    obs, reward, done, _, step = env.step(f"<think>I compute it.</think> <calc>{expression}</calc>")
    assert not done and step["tool"] == "calculator" and not step["tool_error"]
    assert obs == f" <result>\n{env.task_record(info['task']['index'])['ground_truth']}\n</result>"
    answer = step["tool_output"]
    _, reward, done, _, step = env.step(f"<think>Done.</think> <answer>\\boxed{{{answer}}}</answer>")
    assert done and reward == 1.0 and step["reward_info"]["format_ok"]
    assert "<calc>" in env.response and validate_format(env.response) == (True, "ok")
    env.close()
