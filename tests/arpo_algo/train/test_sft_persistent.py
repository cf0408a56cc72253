"""SFT demonstrations for a persistent Python interpreter: ``persistent_python`` replays ToolMath's stateful level
through a persistent interpreter, in the form that relies on it; refused for data it cannot change."""

from __future__ import annotations

import os
import shutil

import pytest

from arpo_algo.train.sft import SFTConfig
from arpo_algo.train.sft_data import load_examples
from arpo_base.errors import ConfigError


def test_persistent_demonstrations_reuse_what_earlier_calls_defined():
    if shutil.which("bwrap") is None and os.environ.get("ARPO_REQUIRE_BWRAP") != "1":
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    calls = {}
    for flag in (False, True):
        cfg = SFTConfig.from_dict({"levels": [5], "num_examples": 2, "persistent_python": flag})
        calls[flag] = [t for ex in load_examples(cfg) for t, trained in ex.segments if trained and "<python>" in t]
    assert all("L[::" not in c for c in calls[False]) and sum("L[::" in c for c in calls[True]) == 2


def test_persistent_python_is_refused_for_file_data():
    with pytest.raises(ConfigError, match="persistent_python") as exc:
        SFTConfig.from_dict({"data": "demos.jsonl", "persistent_python": True})
    assert exc.value.hint
