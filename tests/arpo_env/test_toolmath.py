"""ToolMath: determinism, disjoint splits, and demonstrations that score 1.0 through the env."""

from __future__ import annotations

import pytest

from arpo_base.errors import ConfigError
from arpo_env.core import ToolTextEnv
from arpo_env.demonstrations import toolmath_demonstrations
from arpo_env.tasks.toolmath import ToolMathTasks, split_of


def test_deterministic_and_levels():
    a, b = ToolMathTasks("train", (1, 2, 3, 4), 40), ToolMathTasks("train", (1, 2, 3, 4), 40)
    assert [a[i] for i in range(40)] == [b[i] for i in range(40)]
    assert {a[i]["level"] for i in range(40)} == {1, 2, 3, 4}
    assert all(len(a.problem(i).steps) >= 2 for i in range(40) if a[i]["level"] >= 3)
    assert all(len(a[i]["question"]) < 200 for i in range(40))
    with pytest.raises(ConfigError, match="levels"):
        ToolMathTasks("train", (7,))


def test_splits_are_disjoint():
    train = {ToolMathTasks("train", (1, 2, 3), 3000)[i]["question"] for i in range(3000)}
    test = {ToolMathTasks("test", (1, 2, 3), 300)[i]["question"] for i in range(300)}
    assert len(test) > 250 and not train & test
    assert all(split_of(q) == "test" for q in test)


def test_env_seeding_is_deterministic():
    e1, e2 = ToolTextEnv(task="toolmath"), ToolTextEnv(task="toolmath")
    assert [e1.reset(seed=s)[0] for s in range(5)] == [e2.reset(seed=s)[0] for s in range(5)]


def test_demonstrations_replay_to_reward_one():
    demos = toolmath_demonstrations(6, seed=1, levels=(1, 2, 3, 4))
    assert len(demos) == 6
    env = ToolTextEnv(task="toolmath", levels=[1, 2, 3, 4])
    for demo in demos:
        segs = demo["segments"]
        assert segs[0][1] and segs[-1][1] and all(not t for _s, t in segs[1::2])
        text = "".join(s for s, _ in segs)
        assert text.endswith(f"<answer>\\boxed{{{demo['answer']}}}</answer>")
        assert len(text) < 700  # short enough for a small model
        _q, info = env.reset(options={"task_index": demo["task"]["index"]})
        assert info["messages"] == demo["messages"]
        for action, obs in zip(segs[0::2], segs[1::2]):  # replay action by action: same observations
            got, *_ = env.step(action[0])
            assert got == obs[0]
        _o, reward, terminated, _t, _i = env.step(segs[-1][0])
        assert terminated and reward == 1.0
        if demo["task"]["level"] >= 3:
            assert sum(1 for _s, t in segs if not t) >= 2


def test_wrong_answer_scores_zero():
    env = ToolTextEnv(task="toolmath")
    _q, info = env.reset(options={"task_index": 0})
    wrong = str(int(float(env.tasks[info["task"]["index"]]["ground_truth"])) + 1)
    assert env.step(f"<answer>\\boxed{{{wrong}}}</answer>")[1] == 0.0
