"""``arpo tune --resume`` / ``--report`` treat a sweep folder as data until it is proven this user's: every entry Tune
would deserialize (any name: pickles, ``experiment_state-*.json``, trial JSON) and every folder above it is checked
before anything of it is read. No Ray here: the check runs before Tune."""

from __future__ import annotations

import json
import os

import pytest

from arpo_algo.run.sweep_run import check_own_tune_state
from arpo_base.errors import ArpoError


def _sweep(root):
    alg = root / "sweep" / "arpo"
    trial = alg / "arpo_0001"
    trial.mkdir(parents=True)
    (alg / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps({"trial_data": []}))
    (alg / "tuner.pkl").write_bytes(b"\x80\x04N.")
    (trial / "params.json").write_text("{}")
    (trial / "result.json").write_text("")
    return alg


def test_an_own_sweep_passes(tmp_path):
    check_own_tune_state(_sweep(tmp_path))


def test_a_json_state_file_others_may_write_is_refused(tmp_path):
    alg = _sweep(tmp_path)
    state = next(alg.glob("experiment_state-*.json"))
    state.chmod(0o666)
    with pytest.raises(ArpoError, match="experiment_state.*writable by other users"):
        check_own_tune_state(alg)
    state.chmod(0o644)
    (alg / "arpo_0001" / "params.json").chmod(0o646)  # a trial's JSON: any name counts
    with pytest.raises(ArpoError, match="params.json is writable by other users"):
        check_own_tune_state(alg)


def test_a_planted_link_is_refused(tmp_path):
    alg = _sweep(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (alg / "arpo_0001" / "params.json").unlink()
    os.symlink(elsewhere, alg / "arpo_0001" / "params.json")
    with pytest.raises(ArpoError, match="params.json is a link"):
        check_own_tune_state(alg)
    (alg / "arpo_0001" / "params.json").unlink()
    os.symlink(tmp_path, alg / "arpo_0002")  # a linked folder too
    with pytest.raises(ArpoError, match="arpo_0002 is a link"):
        check_own_tune_state(alg)


def test_a_folder_above_that_others_may_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    alg = _sweep(shared)
    shared.chmod(0o777)
    try:
        with pytest.raises(ArpoError, match="folder above the sweep that other users may write"):
            check_own_tune_state(alg)
        shared.chmod(0o1777)  # sticky, as /tmp: others may add entries but not replace this user's
        check_own_tune_state(alg)
    finally:
        shared.chmod(0o755)
