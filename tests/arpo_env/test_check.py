"""`arpo env check` / `arpo env list` logic on every registered id (real tools, real data)."""

from __future__ import annotations

import pytest

import arpo_env
from arpo_algo.cli import main as cli
from arpo_base.errors import ArpoError
from arpo_env.check import GARBAGE_ACTIONS, check_all, check_env_id, run_garbage
from arpo_env.core import ToolTextEnv


def test_every_registered_id_passes(shared_data):
    results = check_all()
    assert [r.env_id for r in results] == list(arpo_env.ENV_IDS)
    for r in results:
        assert r.status == "ok", (r.env_id, r.detail)
        assert r.steps["check_env"] == "ok" and r.steps["determinism"] == "ok"


def test_missing_data_is_reported_as_skipped(tmp_path):
    r = check_env_id("arpo/Reasoning-v0", {"data_dir": str(tmp_path)})
    assert r.status == "skipped" and "arpo data pull" in r.detail


def test_garbage_actions_never_raise_with_both_protocols():
    for protocol in ("arpo", "json"):
        counts = run_garbage(ToolTextEnv(task="toolmath", protocol=protocol))
        assert sum(counts.values()) == len(GARBAGE_ACTIONS)
        assert counts.get("ok", 0) < len(GARBAGE_ACTIONS)


def test_unknown_id_and_cli(capsys, shared_data):
    with pytest.raises(ArpoError, match="unknown env id"):
        check_all(["arpo/Nope-v0"])
    assert cli.main(["env", "list"]) == 0
    out = capsys.readouterr().out
    assert "arpo/ToolMath-v0" in out and "arpo/DeepSearch-v0" in out
    assert cli.main(["env", "check", "arpo/ToolMath-v0"]) == 0
    assert "arpo/ToolMath-v0" in capsys.readouterr().out and True
    assert cli.main(["data", "pull", "--from", "/nonexistent-folder"]) == 2
