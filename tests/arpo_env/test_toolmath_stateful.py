"""ToolMath level 5, the stateful variant: the second call needs the list the first call built. A persistent
interpreter keeps it; a stateless tool reaches the same reward by rebuilding it, at more tokens. Real sandboxes."""

from __future__ import annotations

import os
import shutil

import pytest

from arpo_env.core import ToolTextEnv
from arpo_env.demonstrations import toolmath_demonstrations
from arpo_env.tasks.toolmath import DEFAULT_LEVELS, ToolMathTasks
from arpo_env.tools.interpreter import live_interpreters

PERSISTENT = {"tools": {"python": {"backend": "bwrap", "persistent": True}}}


@pytest.fixture(autouse=True)
def _bwrap():
    if shutil.which("bwrap") is None:
        if os.environ.get("ARPO_REQUIRE_BWRAP") == "1":
            pytest.fail("ARPO_REQUIRE_BWRAP=1 (CI) but bubblewrap is not installed")
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")


def _trained_chars(demo: dict) -> int:
    return sum(len(text) for text, trained in demo["segments"] if trained)


def test_both_tools_reach_the_reward_and_the_persistent_one_writes_less():
    """toolmath_demonstrations replays each demo through the real env and raises unless it scores 1.0."""
    stateless = toolmath_demonstrations(3, seed=0, levels=(5,))
    persistent = toolmath_demonstrations(3, seed=0, levels=(5,), env_config=PERSISTENT)
    assert live_interpreters() == 0  # the demonstrations' env closed its interpreters
    for s, p in zip(stateless, persistent):
        assert s["answer"] == p["answer"] and s["task"]["id"] == p["task"]["id"]
        assert "L[::" in p["segments"][2][0] and "for i in range" in s["segments"][2][0]
        assert _trained_chars(p) < _trained_chars(s)


def test_the_persistent_demonstration_needs_the_state():
    """Its second call names the list the first one built: a stateless tool answers NameError, a persistent one the
    value the task's answer is made of."""
    demo = toolmath_demonstrations(1, seed=2, levels=(5,), env_config=PERSISTENT)[0]
    calls = [text for text, trained in demo["segments"] if trained and "<python>" in text]
    env = ToolTextEnv(task="toolmath", levels=[5])
    env.reset(options={"task_index": demo["task"]["index"]})
    env.step(calls[0])
    _obs, _r, _t, _tr, info = env.step(calls[1])
    assert info["tool_error"] and "NameError" in info["tool_output"]


def test_the_stateful_level_is_opt_in():
    assert 5 not in DEFAULT_LEVELS
    task = ToolMathTasks("test", (5,), 2)[0]
    assert task["level"] == 5 and task["kind"] == "list_reuse" and task["ground_truth"].isdigit()
