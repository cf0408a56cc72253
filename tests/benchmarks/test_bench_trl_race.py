"""The TRL race benchmark (``python -m benchmarks.bench_trl_race``): its refusals and its TRL-side adapter, checked
without TRL."""

from __future__ import annotations

import sys

import pytest


def test_trl_race_exits_with_a_clear_message_without_trl(monkeypatch):
    from benchmarks import bench_trl_race

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError, whether or not TRL is installed
    with pytest.raises(SystemExit) as exit_info:
        bench_trl_race.main(["--prompts", "1", "--generations", "2"])
    assert "TRL is not installed" in str(exit_info.value) and ".[bench]" in str(exit_info.value)


@pytest.mark.parametrize("bad", [["--generations", "3"], ["--prompts", "0"], ["--kl-coef", "-1"]])
def test_trl_race_rejects_bad_arguments(bad, capsys):
    from benchmarks import bench_trl_race

    with pytest.raises(SystemExit) as exit_info:
        bench_trl_race.parse_args(bad)
    assert exit_info.value.code == 2 and "must be" in capsys.readouterr().err


def test_trl_adapter_runs_tools_and_scores_through_the_gymnasium_env():
    """ToolMathForTRL (TRL's environment_factory side of the race) needs no TRL: the tool call goes through env.step
    (the sandboxed Python tool), and the reward is the env's own on the final assistant message."""
    from benchmarks.bench_trl_race import ToolMathForTRL, toolmath_reward

    ToolMathForTRL.config = {"levels": [1], "max_tool_calls": 2, "protocol": "json"}
    env = ToolMathForTRL()
    env.reset(task_index=3, prompt=[{"role": "user", "content": "ignored"}])
    task = env.env._task
    assert env.python("print(6 * 7)") == "42" and env.tool_calls == 1
    right = [
        {"role": "assistant", "content": "<tool_call>...</tool_call>"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": f"<answer>\\boxed{{{task['ground_truth']}}}</answer>"},
    ]
    assert toolmath_reward([None], [right], [env]) == [1.0]
    env.reset(task_index=3)
    assert toolmath_reward([None], [[{"role": "assistant", "content": "<answer>\\boxed{-1}</answer>"}]], [env]) == [0.0]
    env.reset(task_index=3)
    assert [env.python("print(1)"), env.python("print(2)")] == ["1", "2"]
    assert "limit" in env.python("print(3)")  # one call past max_tool_calls: the env ends the episode, reward 0
    assert env.reward == 0.0 and toolmath_reward([None], [right], [env]) == [0.0]  # a late answer does not count
    with pytest.raises(RuntimeError, match="episode has ended"):
        env.python("print(4)")
