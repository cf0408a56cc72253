"""Environments over the reference parquet files (real data, real replayed search)."""

from __future__ import annotations

import shutil
import time

import gymnasium as gym
import pytest

from arpo_base.errors import ArpoError, MissingDataError
from arpo_env import data as data_mod
from arpo_env.core import ToolTextEnv


def test_reasoning_test_split_and_boxed_fix(shared_data):
    env = ToolTextEnv(task="reasoning", split="test", data_dir=str(shared_data))
    assert env.num_tasks == 180 and env.stop_sequences == ("</python>", "</search>")
    question, info = env.reset(options={"task_index": 0})
    system = info["messages"][0]["content"]
    assert "\\boxed{answer here}" in system and "\x08" not in system
    assert question == "Who is older, William Henry Rodes Green or Eleanor Of Lancaster?"
    bug = ToolTextEnv(task="reasoning", split="test", data_dir=str(shared_data), keep_boxed_bug=True)
    assert "\x08oxed{answer here}" in bug.reset(options={"task_index": 0})[1]["messages"][0]["content"]


def test_reference_episode_with_replayed_search_scores_like_reference(shared_data):
    env = ToolTextEnv(task="reasoning", split="test", data_dir=str(shared_data))
    _q, info = env.reset(options={"task_index": 0})
    gt = env.tasks[0]["ground_truth"]
    obs, *_, step_info = env.step("<think>look it up</think> <search> Amy Smart film debut Campfire Tales </search>")
    assert obs.startswith(" <result>\nPage 1:") and step_info["tool"] == "search"
    env.step("<think>check</think> <python>print(1)</python>")
    _o, reward, terminated, _t, info = env.step(f"<think>so</think> <answer>\\boxed{{{gt}}}</answer>")
    assert terminated and reward == pytest.approx(1.1) and info["reward_info"]["tool_bonus"] == 0.1


def test_deepsearch_splits_and_limit(shared_data):
    train = gym.make("arpo/DeepSearch-v0", data_dir=str(shared_data)).unwrapped
    test = gym.make("arpo/DeepSearch-v0", split="test", data_dir=str(shared_data)).unwrapped
    assert (train.num_tasks, test.num_tasks) == (1071, 203)
    assert train.config["max_tool_calls"] == 6 and train.config["reward"] == "arpo_reference"
    hle = ToolTextEnv(
        task="deepsearch", split="test", data_files={"test": ["hle_test.parquet"]}, data_dir=str(shared_data)
    )
    assert hle.num_tasks == 100


def test_missing_data_names_path_and_command(tmp_path):
    with pytest.raises(MissingDataError) as e:
        ToolTextEnv(task="reasoning", data_dir=str(tmp_path))
    assert str(tmp_path / "train_10k.parquet") in str(e.value) and "arpo data pull" in str(e.value)


def test_pull_from_folder_and_offline(shared_data, tmp_path):
    dest = data_mod.pull(dest=tmp_path / "arpo", from_dir=shared_data)
    assert sorted(p.name for p in dest.iterdir()) == sorted(data_mod.REFERENCE_FILES)
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(shared_data / "valid.parquet", partial)
    with pytest.raises(MissingDataError, match="train_10k.parquet"):
        data_mod.pull(dest=tmp_path / "other", from_dir=partial)
    # Offline: a mirror on a closed loopback port (tests never reach outside this machine).
    t0 = time.perf_counter()
    with pytest.raises(ArpoError, match="cannot reach 127.0.0.1:9"):
        data_mod.pull(dest=tmp_path / "net", timeout=2.0, mirror="http://127.0.0.1:9/arpo")
    assert time.perf_counter() - t0 < 15
    assert not (tmp_path / "net").exists()


def test_pull_downloads_from_a_mirror(shared_data, tmp_path):
    """The download path end to end, against an HTTP server on 127.0.0.1 serving the reference files."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(shared_data))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        dest = data_mod.pull(dest=tmp_path / "mirrored", mirror=f"http://127.0.0.1:{server.server_port}/")
    finally:
        server.shutdown()
    for name in data_mod.REFERENCE_FILES:
        assert (dest / name).read_bytes() == (shared_data / name).read_bytes()


def test_data_files_are_given_per_split_and_never_shared_with_the_test_split(tmp_path):
    """One list of files would be read by every split: the held-out environment would load the training files and
    still call them "test". Files are named per split, and a file in both splits is refused before anything loads."""
    from arpo_base.errors import ConfigError

    with pytest.raises(ConfigError, match="names no split") as err:
        ToolTextEnv(task="reasoning", split="test", data_files=["train_10k.parquet"], data_dir=str(tmp_path))
    assert "test = [" in err.value.hint
    with pytest.raises(ConfigError, match=r"\['valid.parquet'\] would be read by both the train and the test split"):
        ToolTextEnv(task="reasoning", split="test", data_files={"train": ["valid.parquet"]}, data_dir=str(tmp_path))
    # names that differ but read the same file: a path into the folder, a link, a copy of the test file
    (tmp_path / "valid.parquet").write_bytes(b"held-out rows")
    (tmp_path / "link.parquet").symlink_to(tmp_path / "valid.parquet")
    (tmp_path / "copy.parquet").write_bytes(b"held-out rows")
    (tmp_path / "other.parquet").write_bytes(b"training rows")
    for train in ("./valid.parquet", "link.parquet", "copy.parquet"):
        with pytest.raises(ConfigError, match=r"\['valid.parquet'\] would be read by both"):
            ToolTextEnv(task="reasoning", split="test", data_files={"train": [train]}, data_dir=str(tmp_path))
    from arpo_env.tasks.reference import split_files

    assert split_files("reasoning", "test", {"train": ["other.parquet"]}, str(tmp_path)) == ("valid.parquet",)
    with pytest.raises(ConfigError, match="unknown split 'valid'"):
        ToolTextEnv(task="reasoning", data_files={"valid": ["x.parquet"]}, data_dir=str(tmp_path))
    with pytest.raises(MissingDataError, match="mine_test.parquet"):  # the test split reads its own file
        ToolTextEnv(
            task="reasoning",
            split="test",
            data_dir=str(tmp_path),
            data_files={"train": ["mine.parquet"], "test": ["mine_test.parquet"]},
        )
