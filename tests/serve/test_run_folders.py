"""A folder's files are data: a checkpoint whose recorded environment names code (an interpreter, an image, a sandbox
choice, the uids the code runs as, a module to import) is refused by ``arpo serve`` and ``from_checkpoint`` before any
of it is built, with an error naming the field and the flag that sets it; each planted reference leaves a marker only
if it ran."""

from __future__ import annotations

import json
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
            f"open({str(marker)!r}, 'w').write('imported')\nimport gymnasium\nclass Env(gymnasium.Env):\n    pass\n")
        env_id = "planted_env:Env"
    elif kind == "python_executable":
        script = tmp_path / "python"
        script.write_text(f"#!/bin/sh\ntouch {marker}\nexec {sys.executable} \"$@\"\n")
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
    elif kind == "uid_base":  # the first human account's uid: the code would run as that user
        python = {"uid_base": 1000}
    return env_id, {"levels": [1], "max_tool_calls": 1, "tools": {"python": python}}


def _checkpoint(tmp_path, env_id: str, env_config: dict):
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / CHECKPOINT_MARKER).write_text(json.dumps({
        "arpo_checkpoint_format": CHECKPOINT_FORMAT, "algorithm": "ARPO",
        "config": {"env": env_id, "env_config": env_config, "seed": 0, "settings": {}}}))
    return ckpt


KINDS = ["module", *CODE_SETTINGS]


@pytest.mark.parametrize("kind", KINDS)
def test_serving_a_checkpoint_that_names_code_is_refused_and_nothing_runs(tmp_path, monkeypatch, kind):
    from serve.agents import trained_session

    monkeypatch.syspath_prepend(str(tmp_path))  # where `serve run` would find a planted module: the working folder
    monkeypatch.chdir(tmp_path)
    ckpt = _checkpoint(tmp_path, *_plant(tmp_path, kind))
    with pytest.raises(ArpoError) as e:
        trained_session(ckpt / "policy", {})
    text = f"{e.value.message} {e.value.hint}"
    if kind == "module":
        assert "planted_env:Env" in text and "--system-prompt" in text, text
    else:
        assert f"tools.python.{kind}" in text and ("--tools" in text or "--allow-unisolated-python" in text), text
    assert not (tmp_path / "ran").exists() and "planted_env" not in sys.modules
    assert not (tmp_path / "scratch").exists()
    # the flags the message names serve it without rebuilding the recorded environment
    given = {"system_prompt": "S", "max_tool_calls": 1, "protocol": "arpo"}
    assert trained_session(ckpt / "policy", given) == {}
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("kind", ["module", "python_executable", "allow_unisolated_python", "uid_base"])
def test_from_checkpoint_refuses_a_record_that_names_code(tmp_path, monkeypatch, kind):
    from arpo_algo.algorithms import ARPO

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ckpt = _checkpoint(tmp_path, *_plant(tmp_path, kind))
    with pytest.raises(ArpoError) as e:
        ARPO.from_checkpoint(str(ckpt))
    text = f"{e.value.message} {e.value.hint}"
    assert str(ckpt) in text and "--resume" in text, text
    assert ("planted_env:Env" if kind == "module" else f"tools.python.{kind}") in text, text
    assert not (tmp_path / "ran").exists() and "planted_env" not in sys.modules
    assert os.listdir(ckpt / "policy") == []
