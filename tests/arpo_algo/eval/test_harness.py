"""``arpo eval`` end to end with tiny models: ToolMath and `valid` items, resume, two models' paired table, the
protocol check, and the one ARPOConfig -> evaluation-settings mapping."""

from __future__ import annotations

import inspect
import json

import pytest

from arpo_algo.cli.main import main
from arpo_algo.rollout.metrics import is_correct

FAST = ["--k", "2", "--max-response-tokens", "12", "--no-progress", "--no-charts"]


def _rows(out):
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


@pytest.fixture(scope="module")
def second_tiny_model(tmp_path_factory):
    from arpo_algo.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny2") / "model", num_layers=2, hidden_size=64, seed=1)


def test_toolmath_and_resume(tiny_model_dir, tmp_path, capsys):
    """A run cut after item 1 and resumed gives exactly the rows of one uninterrupted run; finished items are not
    rerun; a torn last line (crash mid-write) is dropped."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    base = ["eval", f"tiny={tiny_model_dir}", "--data", "toolmath", *FAST]
    assert main([*base, "--limit", "2", "--output", str(whole), "--items-per-call", "2"]) == 0
    assert main([*base, "--limit", "1", "--output", str(parts)]) == 0
    first = (parts / "samples.jsonl").read_text()
    with (parts / "samples.jsonl").open("a") as f:
        f.write('{"model": "tiny", "item_id": "torn')  # a crash in the middle of a write
    capsys.readouterr()
    assert main([*base, "--limit", "2", "--output", str(parts)]) == 0
    assert "1 items already done (resume), 1 to run" in capsys.readouterr().out
    assert (parts / "samples.jsonl").read_text().startswith(first)
    assert _strip(_rows(parts)) == _strip(_rows(whole))  # same seeds per item, however the run was cut
    rows = _rows(whole)
    assert [(r["index"], r["run"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["generated_tokens"] <= 12 and r["source"].startswith("toolmath/") for r in rows)
    s = json.loads((whole / "summary.json").read_text())
    stats = s["models"]["tiny"]["all"]
    assert (
        stats["items"] == 2
        and stats["k"] == 2
        and set(stats) >= {"pass@1", "pass@1_ci95", "pass@2", "maj@2", "tokens_per_run", "tool_calls_per_correct"}
    )
    assert stats["tokens_per_run"] == pytest.approx(sum(r["generated_tokens"] for r in rows) / 4)
    # a different protocol in the same folder is refused
    assert main([*base, "--limit", "2", "--output", str(parts), "--temperature", "0.3"]) == 2
    assert "different protocol (temperature differ)" in capsys.readouterr().err


def test_valid_items_two_models_paired_table(tiny_model_dir, second_tiny_model, shared_data, tmp_path):
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                f"a={tiny_model_dir}",
                f"b={second_tiny_model}",
                "--data",
                "valid",
                "--limit",
                "2",
                *FAST[:-1],
                "--output",
                str(out),
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert list(s["models"]) == ["a", "b"]
    pair = next(p for p in s["paired"] if p["source"] == "all")
    assert pair["a"] == "a" and pair["b"] == "b" and pair["n"] == 2
    assert pair["diff"] == pytest.approx(s["models"]["b"]["all"]["pass@1"] - s["models"]["a"]["all"]["pass@1"])
    md = (out / "summary.md").read_text()
    assert "## Paired difference" in md and "| a | b | all | 2 |" in md
    assert (out / "pass_at_k.png").stat().st_size > 1000 and (out / "accuracy_vs_tools.png").stat().st_size > 1000
    rows = _rows(out)
    assert {r["model"] for r in rows} == {"a", "b"} and len(rows) == 8
    assert all(r["source"].startswith("DR_grpo_mix/") for r in rows)
    # paired: the same items and seeds for both models
    assert sorted((r["item_id"], r["run"]) for r in rows if r["model"] == "a") == sorted(
        (r["item_id"], r["run"]) for r in rows if r["model"] == "b"
    )


def test_cli_bad_inputs(tiny_model_dir, tmp_path, capsys):
    assert main(["eval", str(tiny_model_dir), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["eval", "--data", "toolmath"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "no-model"), "--data", "toolmath", "--limit", "1"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["eval", str(tiny_model_dir), "--data", "toolmath", "--k", "0"]) == 2


def test_one_mapping_from_config_to_eval_settings():
    """Every evaluation argument comes from the config through eval_settings (the quickstart once dropped top_p,
    tool_workers and prompt_overflow), and the quickstart uses that mapping."""
    import arpo_algo.run.quickstart as qs
    from arpo_algo.algorithms import ARPOConfig
    from arpo_algo.eval.evaluation import eval_settings, sample_held_out

    cfg = ARPOConfig().llm_rollouts(tool_workers=3, prompt_overflow="left_truncate", max_response_tokens=99)
    cfg = cfg.evaluation(top_p=0.7)
    s = eval_settings(cfg).as_kwargs()
    params = set(inspect.signature(sample_held_out).parameters) - {"engine", "env_creator"}
    assert set(s) == params
    got = (s["top_p"], s["tool_workers"], s["prompt_overflow"], s["max_response_tokens"])
    assert got == (0.7, 3, "left_truncate", 99)
    assert "eval_settings(cfg)" in inspect.getsource(qs.stage_evaluate)


def test_eval_runs_are_training_trajectories(tmp_path):
    """run_engine (eval) and a GRPO TreeSampler step (training) with the same seed: the same responses, tool calls,
    finish reasons and rewards per run (a scripted engine writes real python calls; the ToolMath reward scores)."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.eval.data import load_eval_data, make_eval_env
    from arpo_algo.eval.evaluation import EvalSettings
    from arpo_algo.eval.runner import run_engine
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.sampler import TreeSampler
    from tests.arpo_algo.rollout.test_sampler import ScriptedEngine

    data = load_eval_data("toolmath", limit=3)
    creator = lambda: make_eval_env(data.env_id, data.env_config, data.items)  # noqa: E731
    settings = EvalSettings(num_prompts=None, samples=3, temperature=1.0, max_response_tokens=400, seed=5)
    out = tmp_path / "samples.jsonl"
    run_engine(ScriptedEngine(), creator, data.items, settings, model="m", out_file=out, skip=set(), items_per_call=2)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    engine = ScriptedEngine()
    sampler = TreeSampler(
        engine, creator, TreeConfig.grpo(3), SamplingParams(temperature=1.0), max_response_tokens=400, seed=5
    )
    groups, _ = sampler.sample([0, 1, 2], step=0)
    sampler.close()
    trajs = [(g.prompt_index, i, t) for g in groups for i, t in enumerate(g.trajectories)]
    assert len(trajs) == 9  # 3 prompts x 3 runs: the comparisons below are not between two empty lists
    assert [(r["index"], r["run"]) for r in rows] == [(i, r) for i, r, _ in trajs]
    for r, (_, _, t) in zip(rows, trajs):
        assert r["response"] == engine.tokenizer.decode(t.response_ids, skip_special_tokens=True)
        assert r["generated_tokens"] == sum(t.trained_mask) and r["finish_reason"] == t.finish_reason
        assert r["reward"] == t.reward and r["correct"] == is_correct(t)
        assert [c["tool"] for c in r["tool_calls"]] == [c["tool"] for c in t.tool_calls]
    assert sum(r["num_tool_calls"] for r in rows) > 0 and {r["finish_reason"] for r in rows} >= {"answer"}


def test_resume_after_a_crash_mid_item(tiny_model_dir, tmp_path, capsys):
    """A crash in the middle of an item's write leaves its first runs and a torn line: the resume cuts the torn tail,
    runs only the missing run and gives exactly the rows of one uninterrupted evaluation (no (item, run) twice, no
    record glued onto the torn line)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    base = ["eval", f"tiny={tiny_model_dir}", "--data", "toolmath", "--limit", "2", *FAST]
    assert main([*base, "--output", str(whole)]) == 0
    lines = (whole / "samples.jsonl").read_text().splitlines(keepends=True)
    assert [(r["index"], r["run"]) for r in _rows(whole)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    cut.mkdir()
    (cut / "eval_config.json").write_text((whole / "eval_config.json").read_text())
    (cut / "samples.jsonl").write_text("".join(lines[:3]) + lines[3][:40])  # killed while writing item 1's run 1
    capsys.readouterr()
    assert main([*base, "--output", str(cut)]) == 0
    assert "1 items already done (resume), 1 to run" in capsys.readouterr().out
    assert _strip(_rows(cut)) == _strip(_rows(whole))


def test_a_run_recorded_twice_is_counted_once(tiny_model_dir, tmp_path, capsys):
    """A (model, item, run) recorded twice in samples.jsonl is counted once, its first record, and the resume says
    so: the summary is the one of the file without the copy. A damaged line inside the file is named."""
    out = tmp_path / "out"
    base = ["eval", f"tiny={tiny_model_dir}", "--data", "toolmath", "--limit", "2", *FAST, "--output", str(out)]
    assert main(base) == 0
    summary = json.loads((out / "summary.json").read_text())["models"]["tiny"]["all"]
    first = _rows(out)[0]
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    copy = json.dumps(dict(first, correct=not first["correct"], response="a later copy")) + "\n"
    (out / "samples.jsonl").write_text("".join(lines[:2]) + '{"model": "ti\n' + "".join(lines[2:]) + copy)
    capsys.readouterr()
    assert main(base) == 0
    log = capsys.readouterr().out
    assert "records 1 run(s) twice" in log and "samples.jsonl line 3 is not JSON" in log
    again = json.loads((out / "summary.json").read_text())["models"]["tiny"]["all"]
    keys = ("runs", "pass@1", "pass@2", "maj@2", "correct_runs", "tokens_per_run")
    assert {k: again[k] for k in keys} == {k: summary[k] for k in keys}


def test_eval_runs_draw_the_random_numbers_their_training_trajectories_draw(tmp_path):
    """With persistent interpreters, an eval run's ``random`` and numpy draws are the ones training's trajectory of
    that (seed, prompt, run) draws: the tool outputs agree, differ between runs, and repeat in a second evaluation."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.eval.data import load_eval_data, make_eval_env
    from arpo_algo.eval.evaluation import EvalSettings
    from arpo_algo.eval.runner import run_engine
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.sampler import TreeSampler
    from tests.arpo_algo.rollout.test_sampler import DRAW, ScriptedEngine

    def drawing_engine():
        return ScriptedEngine(calls=(1, 3), call=DRAW)

    data = load_eval_data("toolmath", limit=2)
    config = {**data.env_config, "tools": {"python": {"persistent": True}}}
    creator = lambda: make_eval_env(data.env_id, config, data.items)  # noqa: E731
    settings = EvalSettings(num_prompts=None, samples=2, temperature=1.0, max_response_tokens=400, seed=5)

    def evaluate(name):
        out = tmp_path / f"{name}.jsonl"
        run_engine(drawing_engine(), creator, data.items, settings, model="m", out_file=out, skip=set())
        return [[c["output"] for c in json.loads(x)["tool_calls"]] for x in out.read_text().splitlines()]

    first = evaluate("first")
    sampler = TreeSampler(
        drawing_engine(), creator, TreeConfig.grpo(2), SamplingParams(temperature=1.0), max_response_tokens=400, seed=5
    )
    try:
        groups, _ = sampler.sample([0, 1], step=0)
    finally:
        sampler.close()
    trained = [[c["output"] for c in t.tool_calls] for g in groups for t in g.trajectories]
    assert all(first) and len(first) == 4  # every run drew at least once
    assert first == trained
    assert len({o[0] for o in first}) == 4  # runs and items draw differently
    assert evaluate("second") == first
