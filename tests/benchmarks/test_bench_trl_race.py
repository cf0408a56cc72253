"""The TRL race benchmark (``python -m benchmarks.bench_trl_race``): its refusals, checked without TRL (the adapter it
uses is tested in ``tests/arpo_env/test_trl_adapter.py``)."""

from __future__ import annotations

import sys

import pytest


def test_trl_race_exits_with_a_clear_message_without_trl(monkeypatch):
    from benchmarks import bench_trl_race

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError, whether or not TRL is installed
    with pytest.raises(SystemExit) as exit_info:
        bench_trl_race.main(["--prompts", "1", "--generations", "2"])
    assert "TRL is not installed" in str(exit_info.value) and ".[bench]" in str(exit_info.value)


@pytest.mark.parametrize("bad", [["--generations", "3"], ["--prompts", "0"], ["--kl-coef", "-1"]])
def test_trl_race_rejects_bad_arguments(bad, capsys):
    from benchmarks import bench_trl_race

    with pytest.raises(SystemExit) as exit_info:
        bench_trl_race.parse_args(bad)
    assert exit_info.value.code == 2 and "must be" in capsys.readouterr().err
