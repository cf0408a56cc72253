"""studies/branch_rate.py: each policy's branches per candidate and per group in one setting, and a random arm
matched to an entropy arm's measured rate, on the tiny model taught to call the tool at every turn."""

from __future__ import annotations

import json

import pytest

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout import metrics as MK
from studies.branch_rate import arm_config, base_tree, main, rates, report
from tests.arpo_algo.rollout import teach

env_creator, caller_dir = teach.env_creator, teach.caller_dir  # the module-scoped fixtures, shared


def test_the_rates_are_ratios_of_sums_over_steps():
    steps = [
        {MK.BRANCH_CANDIDATES: 4.0, MK.BRANCH_OPPORTUNITIES: 8.0, MK.BRANCHES: 2.0},
        {MK.BRANCH_CANDIDATES: 2.0, MK.BRANCH_OPPORTUNITIES: 2.0, MK.BRANCHES: 2.0},
    ]
    r = rates(steps, groups=4)
    assert (r["candidates"], r["opportunities"], r["branches"]) == (6.0, 10.0, 4.0)
    # not the mean of the steps' ratios (0.5 and 1.0 per candidate): the sums' ratio
    assert (r["branches_per_candidate"], r["branches_per_opportunity"], r["branches_per_group"]) == (4 / 6, 0.4, 1.0)
    assert rates([{}], groups=1)["branches_per_candidate"] == 0.0  # no candidate: nothing branched


def test_the_report_gives_the_equal_count_gap_relative_to_the_matched_arm():
    row = {"candidates": 4.0, "opportunities": 8.0, "branches": 4.0, "branches_per_candidate": 1.0}
    arms = {
        "paper": {**row, "branches_per_opportunity": 0.5, "branches_per_group": 2.0},
        "random": {**row, "branches_per_opportunity": 0.55, "branches_per_group": 2.2},
    }
    assert "per group differ by 10.0% of paper's" in report(arms, ("paper", 0.5))
    arms["paper"]["branches_per_group"] = 0.0
    assert "per group are 0.000 (paper) and 2.200 (random)" in report(arms, ("paper", 0.0))
    assert "random ran at" not in report(arms, None)


def test_each_arm_selects_its_policy_through_the_one_setting_that_may():
    base = base_tree(["tree.budget=6", "tree.initial=2", "tree.branch_factor=2"])
    assert (base.budget, base.initial, base.branch_factor) == (6, 2, 2)
    assert arm_config(base, "reference").decision_rule == "reference"
    assert arm_config(base, "reference").branch_policy is None
    assert arm_config(base, "aepo_paper").mode == "aepo"
    assert arm_config(base, "never") == TreeConfig.grpo(6)
    for name in ("paper", "reference", "aepo_reference", "random", "appo"):
        assert arm_config(base, name).policy_name == name


def test_bad_arms_and_settings_are_refused_before_anything_runs(capsys):
    assert main(["--model", "unused", "--policies", "papr"]) == 2
    assert "not a registered branch policy" in capsys.readouterr().err
    assert main(["--model", "unused", "--set", "tree.random_lookahead=2"]) == 2
    assert "random_lookahead" in capsys.readouterr().err
    assert main(["--model", "unused", "--policies", "paper", "--match-random", "paper"]) == 2
    assert "needs both 'random' and that arm" in capsys.readouterr().err


def test_a_small_run_measures_each_policy_and_matches_the_random_arm(caller_dir, tmp_path, capsys):
    out = tmp_path / "br"
    argv = ["--model", str(caller_dir), "--policies", "random", "paper", "--match-random", "paper"]
    argv += ["--prompts", "2", "--max-response-tokens", "96", "--output", str(out), "--seed", "1"]
    argv += ["--set", "tree.budget=4", "--set", "tree.initial=2", "--set", "tree.random_lookahead=true"]
    assert main(argv) == 0
    res = json.loads((out / "branch_rate.json").read_text())
    paper, random_ = res["arms"]["paper"], res["arms"]["random"]
    assert list(res["arms"]) == ["paper", "random"]  # the matched arm is measured first
    assert paper["candidates"] > 0 and paper["groups"] == random_["groups"] == 2
    assert random_["tree"]["random_rate"] == pytest.approx(paper["branches_per_opportunity"])
    assert random_["tree"]["random_lookahead"] is True
    for arm in (paper, random_):
        assert arm["branches_per_group"] == arm["branches"] / 2
    assert "per candidate" in (out / "branch_rate.md").read_text() and "random ran at p =" in capsys.readouterr().out


def test_each_arm_keeps_only_its_own_policys_knobs_from_the_shared_overrides():
    from studies.branch_rate import arm_config, base_tree

    base = base_tree(["tree.random_lookahead=true", "tree.appo_threshold=0.3"])
    assert arm_config(base, "paper").random_lookahead is False and arm_config(base, "paper").appo_threshold == 0.25
    assert arm_config(base, "random").random_lookahead is True and arm_config(base, "appo").appo_threshold == 0.3
