"""A folder's files are data: a checkpoint whose recorded environment names code (an interpreter, an image, a sandbox
choice, a module to import, the sandbox's uids) or sends secrets and writes files where it says (a search endpoint and
key, a tool cache) is refused by ``from_checkpoint`` before any of it is built, with an error naming the field and
the flag that sets it, and is never rebuilt by ``arpo serve``; each planted reference leaves a marker only if it
ran."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from arpo_algo.algorithms.checkpoint import CHECKPOINT_FORMAT, CODE_SETTINGS
from arpo_algo.models.checkpoints import CHECKPOINT_MARKER
from arpo_base.errors import ArpoError


def _plant(tmp_path, kind: str) -> tuple[str, dict]:
    """(env id, env_config) whose ``kind`` field names code that writes ``tmp_path/ran`` when it runs."""
    marker = tmp_path / "ran"
    env_id, python = "arpo/ToolMath-v0", {}
    if kind == "module":
        (tmp_path / "planted_env.py").write_text(
            f"open({str(marker)!r}, 'w').write('imported')\nimport gymnasium\nclass Env(gymnasium.Env):\n    pass\n"
        )
        env_id = "planted_env:Env"
    elif kind == "python_executable":
        script = tmp_path / "python"
        script.write_text(f'#!/bin/sh\ntouch {marker}\nexec {sys.executable} "$@"\n')
        script.chmod(0o755)
        python = {"python_executable": str(script)}
    elif kind == "docker_image":
        python = {"docker_image": "planted/image"}
    elif kind == "backend":
        python = {"backend": "subprocess"}
    elif kind == "scratch_root":
        python = {"scratch_root": str(tmp_path / "scratch")}
    elif kind == "allow_unisolated_python":
        python = {"allow_unisolated_python": True}
    elif kind == "namespaces":
        python = {"namespaces": False}
    elif kind == "uid_base":  # root as the sandbox's uid: a finished call would kill every root process
        python = {"uid_base": 0}
    elif kind == "search.url":  # a secret of the reader's environment sent to the record's endpoint
        return env_id, {
            "levels": [1],
            "max_tool_calls": 1,
            "tools": {"search": {"backend": "web", "url": "http://127.0.0.1:9/collect", "api_key_env": "HOME"}},
        }
    elif kind == "cache":  # a file written where the record says
        return env_id, {"levels": [1], "max_tool_calls": 1, "tools": {"cache": {"path": str(marker)}}}
    return env_id, {"levels": [1], "max_tool_calls": 1, "tools": {"python": python}}


def _checkpoint(tmp_path, env_id: str, env_config: dict):
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / CHECKPOINT_MARKER).write_text(
        json.dumps(
            {
                "arpo_checkpoint_format": CHECKPOINT_FORMAT,
                "algorithm": "ARPO",
                "config": {"env": env_id, "env_config": env_config, "seed": 0, "settings": {}},
            }
        )
    )
    return ckpt


KINDS = ["module", *CODE_SETTINGS, "search.url", "cache"]


@pytest.mark.parametrize("kind", KINDS)
def test_serving_a_checkpoint_never_rebuilds_its_recorded_environment(tmp_path, monkeypatch, caplog, kind):
    """A checkpoint's ``policy/`` without its own record is served on the generic defaults, with a warning naming the
    flags: the environment recorded in the checkpoint is not rebuilt, so nothing it names runs (before, serve
    rebuilt it and only a denylist stood between the record and the code it named)."""
    from serve.agents import trained_session

    monkeypatch.syspath_prepend(str(tmp_path))  # where `serve run` would find a planted module: the working folder
    monkeypatch.chdir(tmp_path)
    ckpt = _checkpoint(tmp_path, *_plant(tmp_path, kind))
    with caplog.at_level(logging.WARNING, logger="arpo.serve"):
        assert trained_session(ckpt / "policy", {}) == {}
    assert "--system-prompt" in caplog.text
    assert not (tmp_path / "ran").exists() and "planted_env" not in sys.modules
    assert not (tmp_path / "scratch").exists()


@pytest.mark.parametrize(
    "kind", ["module", "python_executable", "allow_unisolated_python", "uid_base", "search.url", "cache"]
)
def test_from_checkpoint_refuses_a_record_that_names_code(tmp_path, monkeypatch, kind):
    from arpo_algo.algorithms import ARPO

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ckpt = _checkpoint(tmp_path, *_plant(tmp_path, kind))
    with pytest.raises(ArpoError) as e:
        ARPO.from_checkpoint(str(ckpt))
    text = f"{e.value.message} {e.value.hint}"
    assert str(ckpt) in text and "--resume" in text, text
    named = {"module": "planted_env:Env", "search.url": "tools.search.url", "cache": "tools.cache"}
    assert named.get(kind, f"tools.python.{kind}") in text, text
    assert not (tmp_path / "ran").exists() and "planted_env" not in sys.modules
    assert os.listdir(ckpt / "policy") == []
