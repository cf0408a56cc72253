"""ARPO_SMOKE shrinks only the budget: the same experiment, one iteration of two prompts, said on stderr."""

from __future__ import annotations

import pytest

from arpo_algo.run import smoke
from arpo_algo.run.experiment import load_experiment
from arpo_algo.run.sweep import load_sweep


@pytest.fixture(autouse=True)
def _nothing_announced_yet(monkeypatch):
    """The announcement is said once per process and kind: each test starts as a fresh process would, so what it
    reads on stderr does not depend on which test announced first."""
    monkeypatch.setattr(smoke, "_announced", set())


def test_smoke_shrinks_the_budget_and_nothing_else(monkeypatch, capsys, tiny_model_dir):
    full = load_experiment("toolmath_aepo")
    monkeypatch.setenv("ARPO_SMOKE", "1")
    small = load_experiment("toolmath_aepo")
    assert "ARPO_SMOKE is set" in capsys.readouterr().err
    s, f = small.config.settings, full.config.settings
    assert small.run.iterations == 1 and s.training.prompts_per_step == min(2, f.training.prompts_per_step)
    assert s.training.mini_batch_count <= s.training.prompts_per_step and s.evaluation.num_prompts == 2
    assert s.rollouts.max_response_tokens == min(48, f.rollouts.max_response_tokens)
    assert (s.tree, s.training.lr, small.config.env_config, type(small.config)) == (
        f.tree,
        f.training.lr,
        full.config.env_config,
        type(full.config),
    )
    small.config.validate()
    sweep = load_sweep("tune_quickstart", [f"model.path={str(tiny_model_dir)!r}"])
    assert (sweep.settings.num_samples, sweep.settings.iterations) == (1, 1)
    # tune_lora ranks by held-out accuracy evaluated every 6 iterations: the smoke trial's one iteration evaluates
    sweep = load_sweep("tune_lora", [f"model.path={str(tiny_model_dir)!r}"])
    assert sweep.base_sections["evaluation"]["every"] == 1


def test_an_evaluation_is_shrunk_as_an_experiment_is(monkeypatch):
    """arpo eval without --experiment once kept its 512-token responses under smoke (the docs tier's evaluations of
    the reference set took minutes): its responses are capped like an experiment's."""
    from arpo_algo.cli.eval import resolve_settings
    from arpo_algo.cli.main import build_parser

    args = build_parser().parse_args(["eval", "m", "--data", "valid", "--k", "4"])
    monkeypatch.setenv("ARPO_SMOKE", "1")
    assert resolve_settings(args)[0].max_response_tokens == 48
    monkeypatch.setenv("ARPO_SMOKE", "0")
    assert resolve_settings(args)[0].max_response_tokens == 512


def test_without_the_variable_nothing_changes(monkeypatch):
    monkeypatch.setenv("ARPO_SMOKE", "0")
    assert load_experiment("toolmath_aepo").run.iterations == load_experiment("toolmath_aepo", []).run.iterations > 1


def test_a_value_other_than_0_or_1_is_refused(monkeypatch):
    """ARPO_SMOKE=false once switched the smallest budgets on: a real run shrank without a word of error."""
    from arpo_base.errors import ConfigError

    monkeypatch.setenv("ARPO_SMOKE", "false")
    with pytest.raises(ConfigError, match="ARPO_SMOKE='false' is neither 1"):
        load_experiment("toolmath_aepo")
