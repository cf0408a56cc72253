"""A reusable env keeps the answer out of ``info`` (a caller feeding ``info`` into a prompt or a log must not give the
answer away); ``expose_answer=True`` opts in; arpo's own readers take it from the task list."""

from __future__ import annotations

import gymnasium as gym
import pytest

import arpo_env
from arpo_base.errors import ConfigError
from arpo_env.core import ToolTextEnv
from arpo_env.demonstrations import toolmath_demonstrations


def _reference_file(folder) -> dict:
    """A two-row verl-style parquet file, so the data-backed tasks build without the reference data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "prompt": [{"role": "system", "content": "Answer."}, {"role": "user", "content": f"Question {i}?"}],
            "reward_model": {"ground_truth": f"answer {i}", "style": "rule"},
            "extra_info": {"index": i, "split": "train"},
            "ability": "qa",
            "data_source": "tiny",
        }
        for i in range(2)
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "tiny.parquet")
    return {"data_dir": str(folder), "data_files": {"train": ["tiny.parquet"]}, "tools": {"python": {}}}


@pytest.mark.parametrize("env_id", list(arpo_env.ENV_IDS))
def test_every_registered_env_withholds_the_answer_unless_asked(env_id, tmp_path):
    config = _reference_file(tmp_path) if env_id in arpo_env.DATA_BACKED else {}
    env = gym.make(env_id, **config).unwrapped
    question, info = env.reset(options={"task_index": 1})
    truth = env.tasks[1]["ground_truth"]
    assert "ground_truth" not in info["task"] and info["task"]["question"] == question
    assert str(truth) not in repr({k: v for k, v in info.items() if k != "messages"})
    assert env.task_record(1)["ground_truth"] == truth  # arpo's own readers: from the task list
    opted = gym.make(env_id, expose_answer=True, **config).unwrapped
    _q, info = opted.reset(options={"task_index": 1})
    assert info["task"]["ground_truth"] == truth and info["task"] == env.task_record(1)
    env.close()
    opted.close()


def test_expose_answer_must_be_a_bool():
    with pytest.raises(ConfigError, match="expose_answer must be true or false"):
        ToolTextEnv(task="toolmath", expose_answer="yes")
    with pytest.raises(ConfigError, match="task index must be in"):
        ToolTextEnv(task="toolmath").task_record(10**9)


def test_demonstrations_record_the_answer_from_the_task_list():
    demos = toolmath_demonstrations(2, split="train", seed=0)
    env = ToolTextEnv(task="toolmath", split="train")
    for demo in demos:
        assert demo["task"]["ground_truth"] == env.tasks[demo["task"]["index"]]["ground_truth"]
