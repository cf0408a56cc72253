"""The mismatch alarm sees a local fault: tail statistics beside the token mean, and a warning when it grows.

The groups are tool-using trees whose sampler log-probs are the tiny model's own (benchmarks.alarm_detection); the
faults are planted on them: what an engine bug would leave in the recorded log-probs."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_algo.rollout.synthetic import clean_groups, plant_kv_reuse, plant_tool_first_token
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import MISMATCH_LEVELS, TAIL_LEVELS
from arpo_base.errors import ArpoError, ConfigError

CONFIG = LearnerConfig(lr=1e-3, micro_batch_tokens=100_000)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def clean(model):
    return clean_groups(model, seed=0)


def _alarm_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "disagree" in r.getMessage()]


def test_clean_groups_raise_no_alarm(tiny_model_dir, clean, caplog):
    caplog.set_level(logging.WARNING, "arpo_algo.train.learner")
    m = Learner(tiny_model_dir, CONFIG, seed=0).update(clean)
    assert m["logprob_tail_frac"] == 0.0 and m["kl_rollout_traj_max"] < 1e-9 and m["kl_rollout"] < 1e-9
    assert m["optimizer_steps"] == 1 and not _alarm_warnings(caplog)


def test_a_1_nat_error_on_1_percent_of_tokens_stops_the_run(tiny_model_dir, clean):
    """The first token after each tool result is 1% of the sampled tokens; a 1-nat error there gives a token-mean
    KL of about 0.007, under the fp32 stop level: the tail fraction stops the run."""
    planted = plant_tool_first_token(clean, 1.0)
    learner = Learner(tiny_model_dir, CONFIG, seed=0)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    with pytest.raises(
        ArpoError,
        match=r"0\.01 of the tokens differ by more than 0\.5 nats.*above "
        r"training\.tail_frac_stop = 0\.005",
    ) as e:
        learner.update(planted)
    assert "kl_rollout_stop" not in str(e.value)  # the token mean alone would have let it train
    assert learner.step == 0 and all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())


def test_a_bf16_learner_on_a_cpu_stops_the_same_fault_at_its_measured_levels(tiny_model_dir, clean):
    """The quickstart's learner on a CPU with bf16 in hardware: bf16 autocast scoring an fp32 sampler's tokens. Its
    clean batches stay far under the bf16_cpu levels, and the planted 1%-token fault still stops the update (at the
    looser GPU bf16 levels it would only warn)."""
    cfg = replace(CONFIG, precision="bf16").for_sampler("float32", "cpu")
    assert cfg.mismatch_levels("bf16") == MISMATCH_LEVELS["bf16_cpu"]
    assert cfg.tail_levels("bf16") == TAIL_LEVELS["bf16_cpu"]
    flat = [replace(g, trajectories=[replace(t, reward=0.0) for t in g.trajectories]) for g in clean]  # no step
    m = Learner(tiny_model_dir, cfg, seed=0).update(flat)
    assert 0 < m["kl_rollout"] < MISMATCH_LEVELS["bf16_cpu"][0] / 100  # bf16 rounding, far under the warn level
    assert m["logprob_tail_frac"] == 0.0 and m["kl_rollout_traj_max"] < TAIL_LEVELS["bf16_cpu"]["traj"][0] / 100
    learner = Learner(tiny_model_dir, cfg, seed=0)
    with pytest.raises(ArpoError, match=r"above training\.tail_frac_stop = 0\.005"):
        learner.update(plant_tool_first_token(clean, 1.0))
    assert learner.step == 0
    # the GPU's bf16 levels (a bf16 learner anywhere else) let the same fault train with a warning
    assert TAIL_LEVELS["bf16"]["frac"][1] > 0.01 and TAIL_LEVELS["bf16"]["traj"][1] > 0.0072


def test_a_bad_kv_reuse_at_one_branch_point_fires(tiny_model_dir, clean, model, caplog):
    """One branch continued on another prompt's cached prefix: the worst trajectory's KL sees it although the token
    mean over the batch stays under its warning level."""
    caplog.set_level(logging.WARNING, "arpo_algo.train.learner")
    m = Learner(tiny_model_dir, CONFIG, seed=0).update(plant_kv_reuse(clean, model))
    assert m["kl_rollout"] < MISMATCH_LEVELS["fp32"][0] < m["kl_rollout_traj_max"]
    assert m["kl_rollout_traj_max"] > TAIL_LEVELS["fp32"]["traj"][0]
    warnings = _alarm_warnings(caplog)
    assert len(warnings) == 1 and "training.traj_kl_warn" in warnings[0] and "kl_rollout_warn" not in warnings[0]


def test_a_growing_kl_rollout_warns_before_it_reaches_a_level(tiny_model_dir, clean, caplog):
    """Every sampled log-prob off by a growing amount: kl_rollout rises 1.3e-5, 2.6e-5, 4.5e-5, 6.5e-5, under its
    warning level all along; the fourth update warns that it grew (each of the last 3 above the one before and the
    last more than 3x the first). A fall breaks the run of rises."""
    caplog.set_level(logging.WARNING, "arpo_algo.train.learner")
    flat = [replace(g, trajectories=[replace(t, reward=0.0) for t in g.trajectories]) for g in clean]  # no step

    def shifted(d):
        return [
            replace(
                g,
                trajectories=[
                    replace(t, old_logprobs=[x - d if m else x for x, m in zip(t.old_logprobs, t.trained_mask)])
                    for t in g.trajectories
                ],
            )
            for g in flat
        ]

    learner = Learner(tiny_model_dir, CONFIG, seed=0)
    seen = [learner.update(shifted(d)) for d in (0.005, 0.007, 0.0095, 0.0114, 0.004, 0.005)]
    assert all(m["skipped_no_signal"] == 1 and m["kl_rollout"] < MISMATCH_LEVELS["fp32"][0] for m in seen)
    assert [m["kl_rollout_growing"] for m in seen] == [0, 0, 0, 1, 0, 0]
    grew = [r.getMessage() for r in caplog.records if "rose over each of the last 3 updates" in r.getMessage()]
    assert len(grew) == 1 and not _alarm_warnings(caplog)


def test_tail_levels_are_settings(tiny_model_dir, clean):

    with pytest.raises(ConfigError, match="tail_frac_warn=0.1 is above tail_frac_stop=0.01"):
        replace(CONFIG, tail_frac_warn=0.1, tail_frac_stop=0.01).validate()
    with pytest.raises(ConfigError, match="tail_logprob_diff must be > 0"):
        replace(CONFIG, tail_logprob_diff=0.0).validate()
    # a looser threshold no longer counts the 1-nat tokens; the worst trajectory's KL still stops the run
    loose = Learner(tiny_model_dir, replace(CONFIG, tail_logprob_diff=1.5), seed=0)
    with pytest.raises(
        ArpoError,
        match=r"0 of the tokens differ by more than 1\.5 nats.*above "
        r"training\.traj_kl_stop = 0\.001, stopping",
    ):
        loose.update(plant_tool_first_token(clean, 1.0))
