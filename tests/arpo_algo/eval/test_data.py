"""``--data`` loading: ToolMath, the reference sets, JSONL/parquet files, and each bad input a clear error."""

from __future__ import annotations

import json

import pytest

from arpo_algo.eval.data import load_eval_data, make_eval_env
from arpo_base.errors import ConfigError, MissingDataError


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_toolmath_split_and_limit():
    d = load_eval_data("toolmath", split="test", limit=3, env_config={"levels": [3]})
    assert len(d.items) == 3 and d.env_id == "arpo/ToolMath-v0" and d.env_config == {"split": "test", "levels": [3]}
    assert all(it["id"].startswith("toolmath-test-") and it["source"] == "toolmath/level3" for it in d.items)
    env = make_eval_env(d.env_id, d.env_config, d.items)  # the env runs exactly these items, in this order
    question, info = env.reset(options={"task_index": 2})
    assert question == d.items[2]["question"] and info["task"]["id"] == d.items[2]["id"]
    assert env.stop_sequences == ("</python>",)


def test_reference_valid_set(shared_data):
    d = load_eval_data("valid", limit=4)
    assert len(d.items) == 4 and d.env_id == "arpo/Reasoning-v0"
    assert {it["source"].split("/")[0] for it in d.items} == {"DR_grpo_mix"}
    assert all(it["ground_truth"] for it in d.items)


def test_a_reference_set_is_never_replaced_by_an_experiments_data_files(shared_data):
    """Bug: the experiment's ``data_files`` (copied for the same environment) replaced the named reference file, so
    ``--data valid`` scored the experiment's own files under the set's name."""
    from arpo_algo.cli.eval import data_env_config

    exp_env = {
        "data_files": {"train": ["mine.parquet"], "test": ["mine_test.parquet"]},
        "split": "train",
        "max_tool_calls": 2,
    }
    cfg = data_env_config("valid", None, exp_env, "arpo/Reasoning-v0", {})
    assert cfg == {"max_tool_calls": 2}  # the experiment's env settings apply; its files and split do not
    assert data_env_config("toolmath", None, {"levels": [3], "split": "train"}, "arpo/ToolMath-v0", {}) == {
        "levels": [3]
    }
    d = load_eval_data("valid", limit=2, env_config=cfg)
    assert d.env_config["data_files"] == {"test": ["valid.parquet"]} and d.env_config["max_tool_calls"] == 2
    with pytest.raises(ConfigError, match="would replace it"):
        load_eval_data("valid", env_config={"data_files": {"test": ["mine.parquet"]}})


def test_a_data_file_runs_with_the_experiments_env_settings_whatever_names_the_env():
    """Bug: a file (default env arpo/Reasoning-v0) or ``--env reasoning`` (an alias) did not match the experiment's
    env id, so the experiment's protocol, reward and tool limit were dropped and the file ran with the defaults."""
    from arpo_algo.cli.eval import data_env_config

    exp_env = {"protocol": "json", "max_tool_calls": 5, "split": "train"}
    want = {"protocol": "json", "max_tool_calls": 5}
    for env in (None, "reasoning", "arpo/Reasoning-v0"):
        assert data_env_config("my.jsonl", env, exp_env, "arpo/Reasoning-v0", {}) == want, env
    assert data_env_config("my.jsonl", "toolmath", exp_env, "arpo/Reasoning-v0", {}) == {}  # another env: not its
    assert data_env_config("valid", "reasoning", exp_env, "arpo/Reasoning-v0", {"max_tool_calls": 2}) == {
        "protocol": "json",
        "max_tool_calls": 2,
    }  # --env-set wins


def test_jsonl_columns_reported_and_items_without_truth_skipped(tmp_path):
    path = _jsonl(
        tmp_path / "qa.jsonl",
        [
            {"problem": "2+2?", "solution": 4, "difficulty": "easy"},
            {"problem": "3+3?", "solution": None, "difficulty": "easy"},
            {"problem": "4+4?", "solution": "8", "extra": 1},
        ],
    )
    d = load_eval_data(str(path), env="arpo/ToolMath-v0")
    assert [it["ground_truth"] for it in d.items] == ["4", "8"] and d.skipped == 1
    assert d.columns == {"question": "problem", "answer": "solution", "ignored": ["difficulty", "extra"]}
    assert "question=problem" in d.description and "ignored difficulty, extra" in d.description


def test_verl_style_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "mine",
            "prompt": [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q1"}],
            "reward_model": {"ground_truth": "A1", "style": "rule"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
    d = load_eval_data(str(tmp_path / "v.parquet"), env="arpo/ToolMath-v0")
    assert d.items[0]["question"] == "Q1" and d.items[0]["system"] == "SYS" and d.items[0]["ground_truth"] == "A1"
    assert d.items[0]["source"] == "mine" and d.columns["answer"] == "reward_model"
    env = make_eval_env(d.env_id, d.env_config, d.items)
    _, info = env.reset(options={"task_index": 0})
    assert info["messages"][0]["content"] == "SYS"


def test_bad_inputs(tmp_path):
    with pytest.raises(MissingDataError, match="no such file"):
        load_eval_data(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{"question": oops}\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_eval_data(str(bad))
    with pytest.raises(ConfigError, match="no question column .*found answer, text"):
        load_eval_data(str(_jsonl(tmp_path / "cols.jsonl", [{"text": "q", "answer": "a"}])))
    with pytest.raises(ConfigError, match="none of the 2 items has a ground truth"):
        load_eval_data(
            str(_jsonl(tmp_path / "nogt.jsonl", [{"question": "q", "answer": ""}, {"question": "r", "answer": None}]))
        )
    with pytest.raises(ConfigError, match="unsupported file type"):
        load_eval_data(str(_jsonl(tmp_path / "x.csv", [{"a": 1}])))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet"):
        load_eval_data(str(tmp_path / "broken.parquet"))
    with pytest.raises(ConfigError, match="unknown key 'levles'"):
        load_eval_data("toolmath", env_config={"levles": [3]})
