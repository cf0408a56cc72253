"""A model source is told apart by what the folder holds: a run folder gives its newest checkpoint's policy, a
checkpoint its policy, a model folder itself; anything else is refused before a model or Ray is touched."""

from __future__ import annotations

import json
import shutil

import pytest

from arpo_algo.cli.main import main
from arpo_algo.eval.harness import resolve_model
from arpo_algo.models import resolve_model_path
from arpo_algo.models.checkpoints import policy_source
from arpo_base.errors import ConfigError
from serve.agents import build_specs, resolve_source
from tests.arpo_algo.run.test_train_cli import write_experiment


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir, tmp_path_factory):
    """A run folder as `arpo train` writes it (two checkpoints kept), with the run's own config.json."""
    tmp = tmp_path_factory.mktemp("sources")
    exp = write_experiment(tmp, tiny_model_dir, iterations=2)
    out = tmp / "myrun"
    assert (
        main(
            [
                "train",
                str(exp),
                "--output",
                str(out),
                "--no-progress",
                "--set",
                "evaluation.every=0",
                "--set",
                "experiment.keep_checkpoints=2",
            ]
        )
        == 0
    )
    assert (out / "config.json").is_file()  # the file that made the server take the run for a model folder
    return out


def test_a_run_folder_is_its_newest_checkpoints_policy_for_every_command(run_folder):
    newest = run_folder / "checkpoints" / "iter_000002" / "policy"
    assert resolve_model_path(run_folder) == newest
    assert resolve_source(f"arpo={run_folder}") == ("arpo", newest)  # arpo serve
    assert resolve_source(str(run_folder)) == ("myrun", newest)
    assert resolve_model(str(run_folder)) == ("myrun", newest)  # arpo eval
    specs = build_specs([f"arpo={run_folder}"], tools="python", allow_unisolated_python=True)
    assert specs[0].model_path == str(newest)


def test_a_checkpoint_is_its_policy_and_a_model_folder_is_itself(run_folder, tiny_model_dir):
    ckpt = run_folder / "checkpoints" / "iter_000001"
    assert policy_source(ckpt).folder == ckpt / "policy" and policy_source(ckpt).name == "myrun"
    assert resolve_source(str(ckpt)) == ("myrun", ckpt / "policy")
    assert policy_source(ckpt / "policy").kind == "model"
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir


def test_an_unrecognised_or_ambiguous_folder_is_refused_naming_what_was_expected(run_folder, tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="is not a model source") as err:
        resolve_source(str(empty))
    assert "arpo_checkpoint.json" in err.value.hint and "model_type" in err.value.hint
    both = tmp_path / "both"
    shutil.copytree(tiny_model_dir, both)
    (both / "arpo_checkpoint.json").write_text("{}")
    with pytest.raises(ConfigError, match="looks like both a checkpoint and a model"):
        resolve_model_path(both)
    fresh = tmp_path / "fresh_run"  # killed before its first checkpoint
    fresh.mkdir()
    shutil.copy(run_folder / "config.json", fresh / "config.json")
    with pytest.raises(ConfigError, match="run folder with no finished checkpoint"):
        resolve_source(str(fresh))
    not_a_model = tmp_path / "other"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text(json.dumps({"lr": 1}))  # some other tool's config
    with pytest.raises(ConfigError, match="is not a model source"):
        resolve_model(str(not_a_model))
