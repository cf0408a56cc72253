"""The powered comparison's analysis (studies/study.py, study_report.py) against hand computations."""

from __future__ import annotations

import pytest

from arpo_base.errors import ConfigError
from studies.study import parse_seeds
from studies.study_report import report, wilcoxon


@pytest.mark.parametrize(
    ("diffs", "p", "n"),
    [
        ([0.1, 0.2, 0.3, 0.4, 0.5], 2 / 32, 5),  # all positive: only 1 of 32 sign patterns as extreme, two-sided
        ([0.1, -0.2, 0.3, 0.4, 0.5], 6 / 32, 5),  # W- = 2: patterns with rank sum <= 2 are {}, {1}, {2}
        ([0.0, 0.1, 0.2, 0.3], 2 / 8, 3),  # the zero difference is dropped
        ([0.25, 0.25, -0.25], 1.0, 3),  # tied ranks (2, 2, 2): W- = 2 is the centre of the distribution
        ([0.0, 0.0], 1.0, 0),  # nothing but ties with the baseline
    ],
)
def test_wilcoxon_exact(diffs, p, n):
    got, nonzero = wilcoxon(diffs)
    assert got == pytest.approx(p) and nonzero == n


def test_seed_ranges():
    assert parse_seeds(["0-3", "7"]) == [0, 1, 2, 3, 7]
    with pytest.raises(ConfigError, match="ranges like 0-15"):
        parse_seeds(["a-b"])


def _record(arm: str, seed: int, accs: list[float], calls: list[float]) -> dict:
    curve = [[i, c, 100 * c, a] for i, (c, a) in enumerate(zip(calls, accs))]
    return {
        "arm": arm,
        "seed": seed,
        "code": "c0de",
        "commit": "0" * 40,
        "sft": "5f7",
        "cpu": "x86_64 avx2",
        "torch": "2",
        "before": accs[0],
        "after": accs[-1],
        "curve": curve,
        "tool_calls": calls[1:],
        "branches_per_group": 0.5 if arm == "arpo" else 0.0,
        "clip_frac": 0.0,
        "time_s": 10.0,
    }


def test_report_pairs_by_seed_and_counts_tool_calls_to_reach_the_baseline():
    records = [
        _record("grpo", 0, [0.25, 0.5, 0.5], [0, 10, 20]),
        _record("grpo", 1, [0.25, 0.25, 0.5], [0, 10, 20]),
        _record("arpo", 0, [0.25, 0.75, 1.0], [0, 10, 20]),
        _record("arpo", 1, [0.25, 0.25, 0.25], [0, 9, 18]),
    ]
    text = report(records)
    # GRPO's mean final accuracy is 0.5: ARPO seed 0 first reaches it after 10 tool calls, seed 1 never does
    row = [line for line in text.splitlines() if line.startswith("| arpo | 2 | ")][1]  # the paired table
    assert "| 1 / 1 / 0 |" in row and "| 0.500 | 1 of 2 | 1 | 10.000 ± 0.000 |" in row
    assert "0.125 ± 0.530" in row  # differences +0.5 and -0.25
    # an arm with fewer seeds is measured against the baseline's mean over its own seeds: GRPO seed 0 alone
    # ended at 0.5, seed 2 at 1.0 (mean of all three 0.667, which the paired arm's seed 0 would not reach)
    more = records + [_record("grpo", 2, [0.25, 1.0, 1.0], [0, 10, 20])]
    three = [line for line in report(more).splitlines() if line.startswith("| arpo | 2 | ")][1]
    assert "| 0.500 | 1 of 2 |" in three
    own = [line for line in report(more).splitlines() if line.startswith("| grpo | - | ")][0]
    assert "| 0.667 | 1 of 3 | 1 |" in own  # only seed 2 reaches its own arm's mean, at iteration 1
    assert "| arpo | 1 | .250 .250 .250 |" in text


def test_report_pairs_against_the_baseline_it_is_given(tmp_path):
    import json

    from studies.study import main

    records = [
        _record("qs_sync", 0, [0.25, 0.5], [0, 10]),
        _record("qs_sync", 1, [0.25, 0.25], [0, 10]),
        _record("qs_async", 0, [0.25, 0.75], [0, 10]),
        _record("qs_async", 1, [0.25, 0.5], [0, 9]),
    ]
    row = [line for line in report(records, baseline="qs_sync").splitlines() if line.startswith("| qs_async | 2 | ")]
    assert "0.250 ± 0.000" in row[1] and "| 2 / 0 / 0 |" in row[1]  # both seeds +0.25 over the synchronous arm
    assert "Paired by seed" not in report(records)  # no GRPO records: nothing to pair against
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", "--records", str(path), "--baseline", "grpo"]) == 2  # no such arm: refused, not empty


def test_report_keeps_only_the_arms_it_is_given(tmp_path, capsys):
    import json

    from studies.study import main

    records = [
        _record("grpo", 0, [0.25, 0.5], [0, 10]),
        _record("arpo", 0, [0.25, 0.75], [0, 10]),
        _record("quickstart_mb1", 0, [0.25, 1.0], [0, 10]),
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", "--records", str(path), "--arms", "arpo", "grpo", "--figures", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| arpo | 1 |" in out and "| grpo | 1 |" in out and "quickstart_mb1" not in out
    assert (tmp_path / "study_accuracy_vs_tool_calls.png").is_file()
    assert main(["report", "--records", str(path), "--arms", "aepo"]) == 2  # no such arm: refused, not empty
    assert "no record of the arm(s) aepo" in capsys.readouterr().err


def test_a_finished_run_drops_its_checkpoints_and_keeps_its_files(tiny_model_dir, tmp_path):
    """A study of many runs keeps one checkpoint per unfinished run only: each finished run's checkpoints go once its
    record is written, its metrics and config stay."""
    from arpo_algo.algorithms import ARPOConfig
    from arpo_algo.models.checkpoints import list_checkpoints
    from arpo_algo.run.driver import save_checkpoint
    from studies.study import drop_checkpoints

    algo = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        .training(model_path=str(tiny_model_dir), prompts_per_step=2)
        .tree(budget=2, initial=1)
        .llm_rollouts(max_response_tokens=8, hf={"max_batch_size": 4})
        .build_algo()
    )
    try:
        run = tmp_path / "seed_0"
        saved = save_checkpoint(algo, run / "checkpoints", keep=1)
    finally:
        algo.stop()
    (run / "metrics.jsonl").write_text("{}\n")
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    assert list_checkpoints(run / "checkpoints") == [saved] and size > 0
    assert drop_checkpoints(run) == size
    assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").is_file()
    assert drop_checkpoints(run) == 0  # a run whose checkpoints are gone already


@pytest.mark.parametrize(
    ("diffs", "alpha", "want"),
    [
        # Walsh averages of 1..5 are symmetric about 3; at alpha 0.1, c = 0 (P(W+ <= 0) = 1/32): the extremes, 93.75%
        ([1, 2, 3, 4, 5], 0.1, (3, 1, 5, 1 - 2 / 32)),
        ([1, 2, 3, 4, 5, 6], 0.05, (3.5, 1, 6, 1 - 2 / 64)),  # n = 6: c = 0 again, 1/64 <= 0.025 < 2/64
        ([-1, 2, 4], 0.3, (1.75, -1, 4, 0.75)),  # Walsh -1, .5, 1.5, 2, 3, 4; c = 0 (1/8 <= 0.15 < 2/8)
        ([-1, 2, 4], 0.5, (1.75, 0.5, 3, 0.5)),  # c = 1 (2/8 <= 0.25): one Walsh average in from each end
    ],
)
def test_hodges_lehmann_and_its_exact_interval(diffs, alpha, want):
    from studies.study_report import hodges_lehmann

    assert hodges_lehmann(diffs, alpha) == pytest.approx(want)
    lo, hi = hodges_lehmann(diffs[:4], 0.05)[1:3]  # 4 pairs: no sign pattern is rare enough for a 95% interval
    assert (lo, hi) == (-float("inf"), float("inf"))


def test_planned_test_runs_at_the_fixed_n_over_the_first_seeds():
    from studies.study_report import planned_test

    accs = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, -0.9]  # the seventh pair, beyond n = 6, must not count
    records = [
        r
        for s, x in enumerate(accs)
        for r in (_record("grpo", s, [0.0, 0.0], [0, 10]), _record("arpo", s, [0.0, x], [0, 10]))
    ]
    text = planned_test(records, 6, 0.05, 10.0, 0.001, 8, 0, 4, sims=200)
    assert "exact two-sided p = 0.0312 over 6 non-zero pairs: significant" in text  # 2 / 64
    assert "+0.3500; exact 96.9% interval (Walsh averages) +0.1000 .. +0.6000" in text
    assert "1.00 at the planned effect" in text and "1.00 when the 6 observed differences are resampled" in text
    assert "AEPO: 0 of 4 planned seeds run (not run)" in text
    assert "not run: 5 of 6 pairs recorded" in planned_test(records[:10], 6, 0.05, 0.2, 0.25, 8, 0, 4)
    low = planned_test(records, 6, 0.05, 0.0, 0.25, 8, 0, 4, sims=400)  # no effect: power is the size, <= alpha
    assert float(low.split("simulations): ")[1].split(" ")[0]) <= 0.06


def test_blocks_dry_run_two_tiny_blocks_and_a_partial_block_is_refused(tmp_path, capsys):
    """Each block starts from its own SFT checkpoint (seed and weights' hash), runs its whole design in one
    invocation, and enters the report only when complete, as a labelled side analysis."""
    import json

    from studies.study import code_hash, file_hash, machine, main

    sft = {}
    for k in (1, 2):
        (tmp_path / f"sft{k}").mkdir()
        (tmp_path / f"sft{k}" / "model.safetensors").write_bytes(f"weights of SFT seed {k}".encode())
        sft[k] = str(tmp_path / f"sft{k}")
    path = tmp_path / "records.jsonl"
    base = [
        "run",
        "arpo",
        "grpo",
        "--seeds",
        "0-1",
        "--records",
        str(path),
        "--output",
        str(tmp_path / "runs"),
        "--dry-run",
    ]
    assert main([*base, "--block", "1", "--sft-seed", "1", "--sft", sft[1]]) == 0
    out = capsys.readouterr().out
    assert out.count("would run") == 4 and f"from SFT {file_hash(tmp_path / 'sft1')}" in out
    assert "block_1/grpo/seed_1" in out and not path.exists()  # a dry run writes nothing

    here, code = machine(), code_hash(allow_dirty=True)[0]

    def rec(block, seed_sft, arm, seed, after, arms=("arpo", "grpo")):
        r = _record(arm, seed, [0.25, after], [0, 10])
        r.update(
            code=code,
            cpu=here["cpu"],
            torch=here["torch"],
            sft=file_hash(tmp_path / f"sft{seed_sft}"),
            block={"id": block, "sft_seed": seed_sft, "arms": sorted(arms), "seeds": [0, 1]},
        )
        return r

    block1 = [rec(1, 1, arm, s, 0.5 + 0.25 * (arm == "arpo")) for s in (0, 1) for arm in ("arpo", "grpo")]
    path.write_text("".join(json.dumps(r) + "\n" for r in block1))
    assert main([*base, "--block", "1", "--sft-seed", "1", "--sft", sft[1]]) == 0
    assert "0 run(s)" in capsys.readouterr().out  # block 1 is done
    assert main([*base, "--block", "2", "--sft-seed", "2", "--sft", sft[2]]) == 0
    assert capsys.readouterr().out.count("would run") == 4
    # another block's checkpoint or SFT seed, or part of a block's arms: refused before any run
    assert main([*base, "--block", "2", "--sft-seed", "2", "--sft", sft[1]]) == 2
    assert "each block has its own SFT seed" in capsys.readouterr().err
    assert main([*base, "--block", "2", "--sft-seed", "1", "--sft", sft[2]]) == 2
    capsys.readouterr()
    only = ["run", "arpo", "aepo", *base[3:]]
    assert main([*only, "--block", "1", "--sft-seed", "1", "--sft", sft[1]]) == 2
    assert "a partial block is refused" in capsys.readouterr().err
    assert main([*base, "--block", "3", "--sft-seed", "3", "--sft", sft[1]]) == 2  # block 1's checkpoint, new seed
    capsys.readouterr()

    # block 2 with GRPO seed 1 missing: the report refuses it rather than pair what is there
    block2 = [rec(2, 2, arm, s, 0.5) for s in (0, 1) for arm in ("arpo", "grpo")][:3]
    path.write_text("".join(json.dumps(r) + "\n" for r in block1 + block2))
    assert main(["report", "--records", str(path)]) == 2
    assert "block 2 is partial: no record of grpo seed 1" in capsys.readouterr().err
    path.write_text("".join(json.dumps(r) + "\n" for r in block1))
    assert main(["report", "--records", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Side analysis, not the planned test: block 1 (SFT seed 1" in out and "Primary test" not in out
    assert "| arpo | 2 | 0.250 ± 0.000" in out  # paired within the block: +0.25 on both seeds
