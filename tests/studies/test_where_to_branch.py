"""The where-to-branch study (studies/where_to_branch.py): its arms, its blind pilot, its analysis, against hand
computations; no training."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

import studies.where_to_branch as W
from arpo_base.errors import ConfigError
from studies.compare import wilcoxon

RATE = {"date": "2026-12-07", "random_rate": 0.42, "reason": "test"}


def _rec(arm: str, block: int, acc4: float, acc6: float, bpg: float = 2.0, arms=("entropy", "grpo", "random")) -> dict:
    return {
        "arm": arm,
        "seed": block,
        "sft": f"sft{block}",
        "code": "c0de",
        "curve": [[0, 0.0, 0, 0.25], [2, 10.0, 100, 0.3], [4, 20.0, 200, acc4], [6, 30.0, 300, acc6]],
        "branches_per_group": bpg,
        "block": {"id": block, "sft_seed": block, "arms": sorted(arms), "seeds": [block]},
    }


def test_the_plans_arms_have_one_budget_and_one_optimizer(monkeypatch):
    monkeypatch.setattr(W, "DEVIATIONS", ({**RATE, "appo_threshold": 0.3},))
    specs = {arm: W.arm_spec(arm) for arm in (*W.PLAN["arms"], *W.PLAN["secondary_arms"])}
    exps = W.check_arms(specs)
    trees = {arm: e.config.settings.tree for arm, e in exps.items()}
    assert {a: t.policy_name for a, t in trees.items()} == {
        "entropy": "paper",
        "random": "random",
        "grpo": "never",
        "appo": "appo",
    }
    assert trees["random"].random_rate == 0.42 and trees["random"].random_lookahead
    assert {t.budget for t in trees.values()} == {8}
    ev = exps["entropy"].config.settings.evaluation
    assert (ev.every, ev.num_prompts, ev.split) == (W.PLAN["eval_every"], W.PLAN["eval_tasks"], "test")
    assert exps["grpo"].config.settings.training.precision == "fp32"
    # an arm with another budget, or another optimizer setting, is refused by name
    with pytest.raises(ConfigError, match="tree.budget"):
        W.check_arms({**specs, "grpo": (W.FILE, [*specs["grpo"][1], "tree.budget=4", "tree.initial=4"])})
    with pytest.raises(ConfigError, match=r"arm random differs .* \[training\] lr"):
        W.check_arms({"entropy": specs["entropy"], "random": (W.FILE, [*specs["random"][1], "training.lr=1e-5"])})


def test_the_random_arm_refuses_to_run_before_its_rate_is_recorded(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(W, "DEVIATIONS", ())
    with pytest.raises(ConfigError, match="no random_rate recorded"):
        W.arm_spec("random")
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "model.safetensors").write_bytes(b"weights")
    args = ["run", "--block", "1", "--sft-seed", "1", "--sft", str(sft), "--records", str(tmp_path / "r.jsonl")]
    assert W.main([*args, "--dry-run"]) == 2
    assert "DEVIATIONS" in capsys.readouterr().err
    later = {"date": "2026-12-08", "random_rate": 0.4, "reason": "remeasured"}
    monkeypatch.setattr(W, "DEVIATIONS", (RATE, later))  # the last entry that sets the rate is in force
    assert "tree.random_rate=0.4" in W.arm_spec("random")[1]


def test_run_dry_run_lists_the_blocks_runs_and_skips_the_recorded_ones(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(W, "DEVIATIONS", (RATE,))
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "model.safetensors").write_bytes(b"weights")
    records = tmp_path / "r.jsonl"
    args = ["run", "--block", "3", "--sft-seed", "7", "--sft", str(sft), "--records", str(records), "--dry-run"]
    assert W.main([*args, "--output", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert out.count("would run") == 3 and "would run random seed 3" in out and "tree.random_rate=0.42" in out
    assert str(tmp_path / "runs" / "block_3" / "grpo") in out and not records.exists()

    from studies.study import code_hash, file_hash, machine

    done = _rec("entropy", 3, 0.5, 0.5)
    done.update(
        code=code_hash(True, W.CODE_PATHS)[0],
        sft=file_hash(sft),
        cpu_flags=W.cpu_flags(),
        torch=machine()["torch"],
        block={"id": 3, "sft_seed": 7, "arms": ["entropy", "grpo", "random"], "seeds": [3]},
    )
    records.write_text(json.dumps(done) + "\n")
    assert W.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("would run") == 2 and "would run entropy" not in out
    records.write_text(json.dumps({**done, "cpu_flags": ["amx_tile"]}) + "\n")  # the block began on another CPU
    assert W.main(args) == 2
    assert "cpu_flags" in capsys.readouterr().err


def test_the_endpoint_is_the_mean_of_the_last_two_evaluations():
    assert W.endpoint(_rec("grpo", 1, 0.5, 0.75)) == pytest.approx(0.625)
    short = _rec("grpo", 1, 0.5, 0.75)
    short["curve"] = short["curve"][:2] + short["curve"][3:]
    with pytest.raises(ConfigError, match=r"no evaluation after iteration\(s\) \[4\]"):
        W.endpoint(short)


def _pilot_records() -> list[dict]:
    values = [(0.5, 0.6, 0.7), (0.2, 0.3, 0.4), (0.4, 0.5, 0.6), (0.6, 0.7, 0.8), (0.55, 0.65, 0.75)]
    return [_rec(arm, b, y, y) for b, ys in enumerate(values, 1) for arm, y in zip(("entropy", "random", "grpo"), ys)]


def test_the_blind_pilot_equals_a_hand_computation_and_reads_no_arm(tmp_path, capsys):
    recs = _pilot_records()
    # each block: deviations -0.1, 0, +0.1 from its mean, ss = 0.02 on 2 df; pooled variance 0.1 / 10 = 0.01, and a
    # paired difference of two arms has twice that: sd = sqrt(0.02)
    blocks = {b: [r for r in recs if r["block"]["id"] == b] for b in range(1, 6)}
    assert W.blinded_sd(blocks) == pytest.approx(math.sqrt(0.02))
    unlabelled = {b: [{k: v for k, v in r.items() if k != "arm"} for r in rs] for b, rs in blocks.items()}
    assert W.blinded_sd(unlabelled) == pytest.approx(math.sqrt(0.02))

    def pilot(records):
        path = tmp_path / "pilot.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert W.main(["pilot", "--records", str(path)]) == 0
        return capsys.readouterr().out

    out = pilot(recs)
    n = W.blocks_for_power(math.sqrt(0.02), 0.10, 0.05 / 3, 0.8)
    assert f"= {math.sqrt(0.02):.4f}" in out and f"n = {max(7, n)} blocks" in out
    rng = random.Random(1)
    shuffled = []
    for b in range(1, 6):  # the arm labels permuted within each block
        names = ["entropy", "random", "grpo"]
        rng.shuffle(names)
        shuffled += [{**r, "arm": name} for r, name in zip(blocks[b], names)]
    assert pilot(shuffled) == out


@pytest.mark.parametrize("n", [7, 9, 12])
def test_the_power_search_applies_the_exact_wilcoxon_test(n):
    rng = random.Random(n)
    alpha = 0.05 / 3
    crit = W.critical(n, alpha)
    for _ in range(200):
        d = [rng.gauss(0.3, 1.0) for _ in range(n)]
        assert W.rejects(d, crit) == (wilcoxon(d)[0] < alpha)
    assert W.critical(6, alpha) == -1  # 2 / 2^6 > alpha / 3: six pairs can never reject at Holm's first step


def test_holm_on_known_p_values():
    got = W.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> monotone 0.03, 0.06, 0.06
    assert got == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert W.holm({"a": 0.5, "b": 0.6}) == pytest.approx({"a": 1.0, "b": 1.0})


def test_report_pairs_by_block_with_holm_and_the_random_match(monkeypatch):
    recs = []
    for b in range(1, 8):
        recs += [
            _rec("entropy", b, 0.5 + 0.01 * b, 0.5 + 0.01 * b, bpg=2.0),
            _rec("random", b, 0.45, 0.45, bpg=1.9),
            _rec("grpo", b, 0.45 + 0.001 * (-1) ** b * b, 0.45 + 0.001 * (-1) ** b * b, bpg=0.0),
        ]
    text = W.report(recs)
    row = next(line for line in text.splitlines() if line.startswith("| entropy - random (primary)"))
    # entropy - random = 0.05 + 0.01 b > 0 in all 7 blocks: exact p = 2 / 2^7; Holm multiplies the smallest by 3
    assert "1:+0.060" in row and "7:+0.120" in row and "+0.0900" in row
    assert f"| {2 / 128:.4f} | {3 * 2 / 128:.4f} |" in row
    assert "branches per group 1.900 against 2.000, 5.0% apart: matched" in text
    far = [{**r, "branches_per_group": 1.5} if r["arm"] == "random" else r for r in recs]
    assert "25.0% apart: NOT matched" in W.report(far)
    never = [{**r, "branches_per_group": 0.0} if r["arm"] == "entropy" else r for r in recs]
    assert "the entropy arm never branched: no match to judge" in W.report(never)
    with pytest.raises(ConfigError, match="block 7 is partial") as e:
        W.report(recs[:-1])
    assert "python -m studies.where_to_branch run --arms entropy grpo random --block 7 --sft-seed 7" in e.value.hint
    # a recorded n: the first n blocks are the analysis; appo's rows are exploratory, outside Holm's family
    monkeypatch.setattr(W, "DEVIATIONS", ({"date": "2026-12-08", "blocks": 6, "reason": "test"},))
    arms4 = ("appo", "entropy", "grpo", "random")
    with_appo = [{**r, "block": {**r["block"], "arms": sorted(arms4)}} for r in recs] + [
        _rec("appo", b, 0.4, 0.4, arms=arms4) for b in range(1, 8)
    ]
    text = W.report(with_appo)
    assert "planned n = 6" in text and "7:+" not in text
    row = next(line for line in text.splitlines() if line.startswith("| appo - entropy (exploratory)"))
    assert row.endswith(f"| {2 / 64:.4f} | - |")
    row = next(line for line in text.splitlines() if line.startswith("| entropy - random (primary)"))
    assert f"| {2 / 64:.4f} | {3 * 2 / 64:.4f} |" in row


def test_the_plan_document_states_the_plans_numbers():
    text = (W.ROOT / "studies" / "where_to_branch_plan.md").read_text()
    table = dict(
        line.strip("|").split("|")[:2]
        for line in text.split("## Fixed numbers")[1].splitlines()
        if line.count("|") == 3
    )
    table = {k.strip(): v.strip() for k, v in table.items() if k.strip() not in ("key", "---")}

    def shown(v):
        if isinstance(v, bool):
            return "yes" if v else "no"
        if v == W.PLAN["primary"]:
            return " - ".join(v)
        return ", ".join(map(str, v)) if isinstance(v, tuple) else str(v)

    expected = {k: shown(v) for k, v in W.PLAN.items() if k not in ("setting", "contrasts")}
    assert table == expected
    assert W.PLAN["date"] in text.split("\n\n")[1] and W.PLAN["setting"] in text
    out = W.plan_text()
    assert "258" in out and "iterations 4 and 6" in out and "entropy - random (primary" not in out
    assert "primary: entropy - random" in out


def test_the_evaluated_test_tasks_hold_256_distinct_level_3_questions():
    from arpo_env.tasks.toolmath import ToolMathTasks

    tasks = ToolMathTasks("test", levels=[3])
    assert len(tasks) >= W.PLAN["eval_tasks"]
    first = [tasks[i] for i in range(W.PLAN["eval_tasks"])]
    assert {t["level"] for t in first} == {3} and W.PLAN["distinct_tasks"] >= 256
    assert len({t["question"] for t in first}) == W.PLAN["distinct_tasks"]
    assert len({t["question"] for t in first[:-1]}) < W.PLAN["distinct_tasks"]  # no fewer tasks hold that many


def test_records_default_beside_the_module():
    assert W.RECORDS.parent == Path(W.__file__).resolve().parent


def test_sft_reuses_a_finished_stage_for_its_own_seed_only(tmp_path, capsys):
    from arpo_algo.run.quickstart import stage_inputs

    out = tmp_path / "sft_3"
    out.mkdir()
    done = {"path": str(out / "sft"), "inputs": stage_inputs("sft", 3)}
    (out / ".stage_pull.json").write_text(json.dumps({"path": "model", "inputs": stage_inputs("pull")}))
    (out / ".stage_sft.json").write_text(json.dumps(done))
    assert W.main(["sft", "--sft-seed", "3", "--output", str(out), "--no-progress"]) == 0
    assert f"SFT seed 3: {out / 'sft'}" in capsys.readouterr().out
    assert W.main(["sft", "--sft-seed", "4", "--output", str(out), "--no-progress"]) == 2  # another seed's folder
    assert "give this run its own --output folder" in capsys.readouterr().err
