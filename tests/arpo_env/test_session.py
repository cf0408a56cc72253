"""ToolSession: one conversation's protocol, tools and limits without a task (real python tool)."""

from __future__ import annotations

import pytest

from arpo_base.errors import ArpoError, ConfigError
from arpo_env.core import ToolTextEnv
from arpo_env.session import ToolSession

CALL = "<think>t</think>\n<python>print(6 * 7)</python>"


def test_tool_call_then_answer():
    s = ToolSession()
    st = s.step(CALL)
    assert (st.kind, st.action_kind, st.done, st.tool, st.tool_output.strip()) == (
        "tool",
        "tool_call",
        False,
        "python",
        "42",
    )
    assert st.observation == " <result>\n42\n</result>" and st.counts["tool_calls"] == 1
    end = s.step("<answer>\\boxed{42}</answer>")
    assert end.kind == "answer" and end.done and end.observation == "" and s.done
    assert s.response == CALL + st.observation + "<answer>\\boxed{42}</answer>"
    with pytest.raises(ArpoError, match="ended"):
        s.step("more")


def test_limits_and_invalid_calls():
    s = ToolSession(max_tool_calls=1)
    s.step(CALL)
    st = s.step(CALL)
    assert st.kind == "limit" and st.done and st.append_eos and st.tool_output is None
    s = ToolSession(max_tool_calls=1, on_tool_limit="error_observation")
    s.step(CALL)
    st = s.step(CALL)
    assert st.kind == "limit" and not st.done and "limit (1)" in st.observation
    st = ToolSession(max_turns=1).step(CALL)
    assert st.kind == "turn_limit" and st.done and st.tool_output is None  # the last turn runs no tool
    st = ToolSession().step("<python></python>")
    assert st.kind == "invalid" and not st.done and st.observation.startswith(" <result>\nError")
    assert ToolSession(on_invalid_call="end").step("<python></python>").done


def test_clone_is_independent():
    s = ToolSession()
    s.step(CALL)
    twin = s.clone()
    twin.step(CALL)
    assert twin.counts["tool_calls"] == 2 and s.counts["tool_calls"] == 1 and twin.response != s.response
    assert twin.tools is s.tools


def test_config_errors_and_prompts():
    with pytest.raises(ConfigError) as err:
        ToolSession(max_tool_call=3)
    assert "max_tool_calls" in err.value.hint
    with pytest.raises(ConfigError, match="on_tool_limit"):
        ToolSession(on_tool_limit="ignore")
    with pytest.raises(ConfigError, match="task"):
        ToolSession(task="toolmath")  # a session has no task: that is the env's
    assert ToolSession(system_prompt="hi").system_prompt() == "hi"
    assert "<python>" in ToolSession().system_prompt() and ToolSession().stop_sequences == ("</python>",)
    assert "python" in ToolSession(protocol="json").system_prompt()


def test_env_step_is_the_session_step():
    """The env adds the task and the reward; the turn itself is the session's (same observation and counters)."""
    env = ToolTextEnv(task="toolmath", tools={"python": {}})
    env.reset(options={"task_index": 0})
    s = ToolSession(tools=env.tools, max_tool_calls=env.config["max_tool_calls"])
    for action in (CALL, "<python></python>", "<answer>\\boxed{1}</answer>"):
        obs, reward, term, trunc, info = env.step(action)
        st = s.step(action)
        assert obs == st.observation and term == st.done and info["kind"] == st.action_kind
        assert {k: info[k] for k in st.counts} == st.counts
    assert env.response == s.response and "reward_info" in info
