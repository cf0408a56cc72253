"""The benchmark scripts run end to end, and the engine benchmark's model.generate baseline is a fair one."""

from __future__ import annotations

import pytest
import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine
from benchmarks import bench_engine


def test_generate_baseline_returns_what_the_engine_returns(tiny_model_dir):
    eng = HFEngine(tiny_model_dir)
    base = bench_engine.GenerateEngine(eng.model, eng.tokenizer, batch=2, eos=eng.eos_ids)
    reqs = [
        GenRequest(
            i, eng.tokenizer.encode("q" * (3 + i)), SamplingParams(max_new_tokens=6 + 4 * i, seed=i, stop=("zz",))
        )
        for i in range(3)
    ]
    gens = base.generate(reqs)
    assert [g.request_id for g in gens] == [0, 1, 2]
    for req, gen in zip(reqs, gens):
        assert 0 < len(gen.token_ids) <= req.params.max_new_tokens  # cut to its own budget, not the batch's
        assert gen.finish_reason in ("eos", "stop", "length")
        with torch.no_grad():  # logprobs and entropies from raw logits, as the engine computes them
            logits = eng.model(torch.tensor([req.token_ids + gen.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(req.token_ids) - 1 : -1], -1)
        expect = logp[torch.arange(len(gen.token_ids)), torch.tensor(gen.token_ids)]
        assert torch.allclose(expect, torch.tensor(gen.logprobs), atol=1e-4)
        assert torch.allclose(-(logp.exp() * logp).sum(-1), torch.tensor(gen.entropies), atol=1e-4)
    stats = base.stats()
    assert stats["generated_tokens"] == sum(len(g.token_ids) for g in gens) and stats["seconds"] > 0


@pytest.mark.timeout(300)
def test_bench_engine_runs_all_scenarios(tiny_model_dir, tmp_path):
    out = tmp_path / "engine.json"
    result = bench_engine.main(
        [
            "--model",
            str(tiny_model_dir),
            "--requests",
            "4",
            "--batch",
            "2",
            "--threads",
            str(torch.get_num_threads()),  # main() sets it process-wide
            "--rollout-model",
            str(tiny_model_dir),
            "--rollout-prompts",
            "1",
            "--out",
            str(out),
        ]
    )
    assert set(result["scenarios"]) == {"refill", "tool_continuation", "rollout"}
    for row in result["scenarios"].values():
        assert row["engine_tokens"] > 0 and row["generate_tokens"] > 0 and row["ratio"] > 0
    assert out.is_file()


def test_bench_dedup_runs_through_the_public_learner_api(tiny_model_dir, tmp_path):
    """bench_dedup times the learner's own micro-batches (Learner.prepare_batches, no private members)."""
    from benchmarks import bench_dedup

    result = bench_dedup.main(
        [
            "--model",
            str(tiny_model_dir),
            "--groups",
            "1",
            "--repeats",
            "1",
            "--threads",
            str(torch.get_num_threads()),
            "--out",
            str(tmp_path / "d.json"),
        ]
    )
    assert (tmp_path / "d.json").exists() and result


def test_bench_dedup_reports_mfu_against_a_ceiling_of_the_same_run(tmp_path):
    """--shape builds a random model (no download); --precision reaches the learner; MFU = model rate / ceiling."""
    from benchmarks import bench_dedup

    result = bench_dedup.main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--precision",
            "bf16",
            "--tree-attention",
            "dense",
            "--groups",
            "1",
            "--repeats",
            "1",
            "--ceiling-size",
            "256",
            "--threads",
            str(torch.get_num_threads()),
        ]
    )
    assert result["precision"] == "bf16" and result["tree_attention"] == "dense"
    assert result["matmul_ceiling"]["dtype"] == "bfloat16" and result["matmul_ceiling"]["tflops"] > 0
    for path in ("duplicated", "deduplicated"):
        assert result["mfu"][path] == pytest.approx(result["model_tflops"][path] / result["matmul_ceiling"]["tflops"])
        expect = 6 * result["parameters"] * result["tokens_per_group"][path] / result["seconds_per_group_median"][path]
        assert result["model_tflops"][path] == pytest.approx(expect / 1e12)
    assert result["tokens_per_group"]["deduplicated"] < result["tokens_per_group"]["duplicated"]


def test_bench_engine_decode_modes_side_by_side(tiny_model_dir, tmp_path, capsys):
    """The decode-mode comparison (item 4 of bench_engine): every mode runs, static reports its floor and its
    profile."""
    result = bench_engine.main(
        [
            "--model",
            str(tiny_model_dir),
            "--decode",
            "dynamic",
            "static",
            "--decode-batches",
            "2",
            "--new-tokens",
            "6",
            "--static-cache-tokens",
            "2048",
            "--threads",
            str(torch.get_num_threads()),
            "--profile",
            "2",
            "--dtype",
            "float32",
            "bfloat16",
            "--out",
            str(tmp_path / "d.json"),
        ]
    )
    printed = capsys.readouterr().out
    # one profile, of the fixed-shape mode only, naming the step's matrix products
    assert printed.count("Profile of 2 bare steps") == 2 and "decode=static, batch 2" in printed  # one per dtype
    assert "aten::mm" in printed or "aten::addmm" in printed
    # both dtypes in one run, each with its own probe and its own dynamic reference
    assert set(result["machine"]) == {"float32", "bfloat16"}
    assert [(r["dtype"], r["decode"]) for r in result["decode"]] == [
        ("float32", "dynamic"),
        ("float32", "static"),
        ("bfloat16", "dynamic"),
        ("bfloat16", "static"),
    ]
    assert result["decode"][2]["vs_dynamic"] == 1.0
    rows = {r["decode"]: r for r in result["decode"] if r["dtype"] == "float32"}
    assert set(rows) == {"dynamic", "static"} and rows["dynamic"]["vs_dynamic"] == 1.0
    assert rows["static"]["tok_s"] > 0 and rows["static"]["floor_tok_s"] > 0 and "floor_tok_s" not in rows["dynamic"]
    # the fixed-shape path splits its time into prefills and steps (the rest is host work between them)
    static = rows["static"]
    assert 0 < static["prefill_share"] < 1 and 0 < static["step_share"] < 1
    assert static["prefill_share"] + static["step_share"] <= 1 and rows["dynamic"]["prefill_share"] is None
    for row in rows.values():  # the machine's floor from the GEMM and streaming probes, for every mode
        assert row["hw_floor_tok_s"] > 0 and row["of_hw_floor"] == row["tok_s"] / row["hw_floor_tok_s"]
        assert row["hw_limit"] in ("weight streaming", "FLOPs")
    assert (tmp_path / "d.json").is_file()


def test_bench_engine_decode_modes_on_the_rollout_scenario(tiny_model_dir, capsys):
    """--decode-rollout: every mode runs the same real ARPO sampling step (Python tool, tree) and gets its row."""
    result = bench_engine.main(
        [
            "--model",
            str(tiny_model_dir),
            "--decode",
            "dynamic",
            "static",
            "--decode-batches",
            "4",
            "--new-tokens",
            "4",
            "--static-cache-tokens",
            "4096",
            "--threads",
            str(torch.get_num_threads()),
            "--decode-rollout",
            "1",
        ]
    )
    rollout = {r["decode"]: r for r in result["decode"] if r["batch"] == "rollout"}
    assert set(rollout) == {"dynamic", "static"} and rollout["dynamic"]["vs_dynamic"] == 1.0
    assert all(r["tok_s"] > 0 and r["slots"] == 4 and r["of_hw_floor"] > 0 for r in rollout.values())
    assert "| rollout (1 tasks, 4 slots) | static |" in capsys.readouterr().out


@pytest.mark.vllm
def test_bench_engine_push_only_times_vllm_weight_pushes(tmp_path):
    """--vllm --push-only: engine start and weight pushes of the model's own weights, greedy output unchanged."""
    from arpo_algo.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", num_layers=2, hidden_size=256, seed=0)  # 64-dim heads for vLLM
    result = bench_engine.main(
        [
            "--model",
            str(model),
            "--vllm",
            "--push-only",
            "--push-repeats",
            "2",
            "--kv-cache-gib",
            "0.25",
            "--threads",
            str(torch.get_num_threads()),
        ]
    )
    assert result["dtype"] == "float32" and len(result["weight_push_s"]) == 2
    assert all(s > 0 for s in result["weight_push_s"]) and result["greedy_unchanged"] is True
    assert result["pushed_mib"] == pytest.approx(result["params"] * 4 / 2**20, rel=0.2)  # + the tied head's copy


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_bench_engine_vllm_side_runs_both_engines_in_the_chosen_dtype(tmp_path):
    """--vllm --vllm-dtype bfloat16: every scenario on the HF engine, arpo's vLLM engine and plain vLLM, the HF engine
    in bfloat16 too (it pushes its own weights, so the push is half the float32 size)."""
    from arpo_algo.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", num_layers=2, hidden_size=256, seed=0)  # 64-dim heads for vLLM
    result = bench_engine.main(
        [
            "--model",
            str(model),
            "--vllm",
            "--vllm-batches",
            "2",
            "--vllm-dtype",
            "bfloat16",
            "--threads",
            str(torch.get_num_threads()),
        ]
    )
    assert result["dtype"] == "bfloat16"
    assert set(result["rows"]) == {"refill@2", "tool_continuation@2", "rollout@2"}
    for row in result["rows"].values():
        assert set(row) == {"hf", "arpo_vllm", "plain_vllm"} and all(tokens > 0 for tokens, _ in row.values())
    params = sum(p.numel() for p in HFEngine(model).model.parameters())
    assert result["weight_push_mib"] == pytest.approx(params * 2 / 2**20, rel=0.2)  # bfloat16 weights pushed


@pytest.mark.timeout(300)
def test_bench_async_times_both_modes_with_a_rollout_actor(tiny_model_dir, tmp_path):
    from benchmarks import bench_async

    result = bench_async.main(
        [
            "--model",
            str(tiny_model_dir),
            "--prompts",
            "1",
            "--budget",
            "2",
            "--max-response-tokens",
            "8",
            "--warmup",
            "1",
            "--iterations",
            "1",
            "--threads",
            str(torch.get_num_threads()),  # main() sets it process-wide
            "--out",
            str(tmp_path / "a.json"),
        ]
    )
    assert result["ratio_sync_over_async"] > 0 and (tmp_path / "a.json").is_file()
    (sync,), (asyn,) = result["runs"]["sync"], result["runs"]["async"]
    assert sync["iterations"][0]["staleness_max"] == 0.0 and asyn["iterations"][0]["staleness_max"] == 1.0


def test_machine_floor_times_a_linear_layer_by_every_route(capsys):
    from benchmarks import machine_floor

    [row] = machine_floor.main(["--linear", "4x64x96", "--threads", "1"])
    assert row["shape"] == [4, 64, 96] and all(row[r] > 0 for r in machine_floor.ROUTES)
    assert "| 4 x 64 x 96 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="ROWSxINxOUT"):
        machine_floor.main(["--linear", "4x64"])


def test_machine_floor_times_a_models_step_parts(tiny_model_dir, tmp_path, capsys):
    """--step: the timed products are every linear layer of the model (its head included) at the step's rows, the
    timed read covers the attended columns of buffers shaped like the slot buffers (also for bf16, read as 4-byte
    words); bad input is refused before any work, with the reason."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks import machine_floor

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 7 * cfg.num_hidden_layers + 1
    products, kv_read, info = machine_floor.step_parts(model, rows=4, columns=16, context=40)
    outs = products()
    assert [tuple(o.shape) for o in outs] == [(4, m.out_features) for m in linears]  # every layer, in module order
    assert info["linear_layers"] == len(linears) and info["weight_bytes"] == sum(m.weight.numel() * 4 for m in linears)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_buffer = 4 * cfg.num_key_value_heads * 16 * head_dim  # the first 16 of 41 columns, no more
    assert [s.item() for s in kv_read()] == [per_buffer] * (2 * cfg.num_hidden_layers)
    assert info["kv_bytes"] == 2 * cfg.num_hidden_layers * per_buffer * 4
    _, kv16, info16 = machine_floor.step_parts(model.to(torch.bfloat16), rows=4, columns=16, context=40)
    word = torch.ones(2, dtype=torch.bfloat16).view(torch.float32).item()  # two bf16 ones read as one word
    assert [s.item() for s in kv16()] == [pytest.approx(per_buffer / 2 * word)] * (2 * cfg.num_hidden_layers)
    assert info16["kv_bytes"] == info["kv_bytes"] // 2

    [row] = machine_floor.main(
        ["--step", str(tiny_model_dir), "--rows", "4", "--columns", "16", "--context", "40", "--threads", "1"]
    )
    assert row["linear_layers"] == len(linears) and row["kv_bytes"] == info["kv_bytes"]
    assert row["floor_tok_s"] == pytest.approx(4 / (row["products"] + row["kv_read"]))
    assert "| both (everything else free) |" in capsys.readouterr().out
    for argv, message in (
        (["--linear", "4x64"], "ROWSxINxOUT"),
        (["--rows", "0"], None),
        (["--columns", "64", "--context", "32"], None),
        (["--threads", "0"], None),
    ):
        with pytest.raises(SystemExit) as err:
            machine_floor.main(["--step", str(tiny_model_dir), *argv])
        if message is None:  # argparse's refusal: usage and the reason on stderr, exit code 2
            assert err.value.code == 2
        else:
            assert message in str(err.value)
    assert "must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown model 'no-such-model'"):
        machine_floor.main(["--step", "no-such-model"])
    empty = tmp_path / "config_only"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(SystemExit, match="cannot load"):
        machine_floor.main(["--step", str(empty)])
    lora_like = type("LoRALinear", (torch.nn.Linear,), {})  # a Linear subclass runs its own product: not timed
    model.model.layers[0].mlp.up_proj = lora_like(cfg.hidden_size, cfg.intermediate_size, bias=False)
    assert machine_floor._untimed_products(model) == ["LoRALinear"]
    with pytest.raises(ValueError, match="LoRALinear"):  # refused where the timed layers are chosen
        machine_floor.step_parts(model, rows=4, columns=16, context=40)


@pytest.mark.timeout(600)
def test_bench_quickstart_runs_each_decode_mode_through_both_stages(tiny_model_dir, tmp_path, capsys):
    """bench_quickstart: each variant's quickstart run trains and evaluates with its decode path (the evaluation's
    engines record the path they took: the quickstart's evaluation honours [rollouts.hf]) and its learner precision
    (recorded in the run's summary), from one SFT folder; --only keeps the named variants of the grid."""
    import json

    from benchmarks import bench_quickstart

    sft = tmp_path / "sft_run"
    sft.mkdir()
    from arpo_algo.run.quickstart import stage_inputs

    for name in bench_quickstart.STAGE_MARKERS:  # an SFT stage "done" whose checkpoint is the tiny model
        stage = name.removeprefix(".stage_").removesuffix(".json")
        (sft / name).write_text(
            json.dumps({"path": str(tiny_model_dir), "stage_time_s": 0.0, "inputs": stage_inputs(stage)})
        )
    result = bench_quickstart.main(
        [
            "--sft",
            str(sft),
            "--modes",
            "dynamic",
            "static",
            "--learner-precisions",
            "fp32",
            "native",
            "--only",
            "dynamic fp32",
            "static native",
            "--threads",
            "1",
            "--output",
            str(tmp_path / "runs"),
            "--set",
            "experiment.iterations=1",
            "--set",
            "evaluation.num_prompts=2",
            "--set",
            "rollouts.max_response_tokens=16",
            "--set",
            "training.prompts_per_step=1",
        ]
    )
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"dynamic fp32", "static native"} == set(result["variants"])
    for label, r in runs.items():
        mode, precision = label.split()
        assert r["eval_decode"] == [mode, mode] and r["decode"] == mode
        summary = json.loads((tmp_path / "runs" / f"{mode}_{precision}_r1" / "summary.json").read_text())
        assert summary["precision"]["setting"] == {"sft": "fp32", "learner": precision}
        assert r["arpo_s"] > 0 and r["generate_s"] > 0 and r["tokens_sampled"] > 0 and r["eval_tokens"] > 0
    out = capsys.readouterr().out
    assert "| dynamic fp32 |" in out and "| static native |" in out and "1.00x" in out
    for r in runs.values():  # stages run here have a CPU time; pull and SFT come from the folder, which has none
        assert r["stages"]["arpo"]["cpu_s"] > 0 and r["stages"]["evaluate"]["cpu_s"] > 0
        assert r["stages"]["pull"] == {"wall_s": 0.0, "cpu_s": None}
    assert "| dynamic fp32 | arpo |" in out and "| static native | pull | 0.0 | - | - | 0% |" in out


def test_bench_quickstart_stage_table_gives_wall_cpu_cores_and_share():
    from benchmarks import bench_quickstart

    def run(mode, arpo_wall, arpo_cpu):
        stages = {"sft": {"wall_s": 10.0, "cpu_s": None}, "arpo": {"wall_s": arpo_wall, "cpu_s": arpo_cpu}}
        return {"mode": mode, "stages": stages}

    runs = [
        run("dynamic", 30.0, 45.0),
        run("dynamic", 50.0, 55.0),
        run("dynamic", 40.0, 50.0),
        run("static", 10.0, 5.0),
    ]
    lines = bench_quickstart.stage_table(runs, ["dynamic", "static"])
    assert lines[2:] == [  # medians over rounds: arpo 40 s wall, 50 s CPU
        "| dynamic | sft | 10.0 | - | - | 20% |",
        "| dynamic | arpo | 40.0 | 50.0 | 1.25 | 80% |",
        "| static | sft | 10.0 | - | - | 50% |",
        "| static | arpo | 10.0 | 5.0 | 0.50 | 50% |",
    ]


def test_bench_quickstart_refuses_a_folder_without_a_finished_sft_stage(tmp_path):
    from benchmarks import bench_quickstart

    with pytest.raises(SystemExit, match="no .stage_pull.json, .stage_sft.json"):
        bench_quickstart.main(["--sft", str(tmp_path)])
    for name in bench_quickstart.STAGE_MARKERS:
        (tmp_path / name).write_text("{}")
    with pytest.raises(
        SystemExit, match="--only 'static': not a variant of this grid; its variants are 'dynamic fp32'"
    ):
        bench_quickstart.main(
            ["--sft", str(tmp_path), "--modes", "dynamic", "--learner-precisions", "fp32", "native", "--only", "static"]
        )


def test_ab_decode_runs_the_same_workload_in_each_tree_dtype_and_mode(tiny_model_dir, tmp_path, capsys):
    """The checkout comparison runs each (tree, dtype, decode) side in its own process, importing arpo from that
    tree, and reports each side's median against the first; a folder that is not a checkout is refused."""
    import json
    import shutil
    from pathlib import Path

    from benchmarks import ab_decode

    repo = Path(ab_decode.__file__).resolve().parents[1]
    other = tmp_path / "copy"  # a second checkout: the packages copied, so its runs must import them from there
    for pkg in ("arpo_algo", "arpo_base", "arpo_env"):
        shutil.copytree(repo / pkg, other / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    args = ["--model", str(tiny_model_dir), "--batch", "2", "--new-tokens", "4", "--rounds", "1", "--threads", "1"]
    out = ab_decode.main(
        [
            "--trees",
            str(other),
            str(repo),
            "--dtype",
            "float32",
            "bfloat16",
            "--decode",
            "static",
            "dynamic",
            *args,
            "--static-cache-tokens",
            "2048",
            "--out",
            str(tmp_path / "ab.json"),
        ]
    )
    labels = [f"{other} float32 static", f"{repo} bfloat16 dynamic"]
    assert list(out["summary"]) == labels and out["summary"][labels[0]]["vs_first"] == 1.0
    for label, tree in zip(labels, (other, repo)):
        [run] = out["runs"][label]
        assert run["tokens"] > 0 and run["seconds"] > 0 and Path(run["package"]).parent == tree / "arpo_algo"
        assert run["stats"]["prefill_tokens"] > 0
    # each side ran its own mode: only the fixed-shape path counts decode steps and times its prefills
    fixed, dynamic = (out["runs"][label][0]["stats"] for label in labels)
    assert fixed["decode_steps"] > 0 and "prefill_seconds" in fixed and "decode_steps" not in dynamic
    assert json.loads((tmp_path / "ab.json").read_text())["summary"] == out["summary"]
    assert "| tree, dtype, decode | median tok/s | vs first |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ab_decode.main(["--trees", str(tmp_path)])
    assert "not an arpo checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_decode.main(["--trees", str(repo), str(repo), "--dtype", "float32", "float32"])  # one side twice
    with pytest.raises(SystemExit):
        ab_decode.main(["--trees", str(repo), "--decode", "static", "dynamic"])  # more modes than trees
    assert "--decode takes one mode or one per tree" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="requests failed"):  # prompts longer than the static cache
        ab_decode.main(["--trees", str(repo), *args, "--static-cache-tokens", "128"])


def test_bench_sandbox_times_the_backends_side_by_side(tmp_path, capsys):
    """bench_sandbox: every backend asked for answers each call correctly; the first is the ratios' reference."""
    import os
    import shutil

    from arpo_env.tools.sandbox_docker import docker_backend_problem
    from benchmarks import bench_sandbox

    if shutil.which("bwrap") is None:
        if os.environ.get("ARPO_REQUIRE_BWRAP") == "1":
            pytest.fail("ARPO_REQUIRE_BWRAP=1 (CI) but bubblewrap is not installed")
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    backends = ["bwrap"] + ([] if docker_backend_problem() else ["docker"])
    result = bench_sandbox.main(["--backends", *backends, "--calls", "2", "--out", str(tmp_path / "b.json")])
    assert set(result["backends"]) == set(backends) and result["backends"]["bwrap"]["ratio_to_bwrap"] == 1.0
    assert all(r["median_ms"] > 0 and r["level"] == "filesystem" for r in result["backends"].values())
    assert "| bwrap | filesystem |" in capsys.readouterr().out


def test_bench_record_serve_serves_both_sides_and_continues_the_episodes(tiny_model_dir, tmp_path):
    from benchmarks import bench_record_serve

    res = bench_record_serve.main(
        ["--model", str(tiny_model_dir), "--clients", "2", "--turns", "2", "--pairs", "1", "--warmup", "0"]
        + ["--max-tokens", "4", "--threads", "1", "--out", str(tmp_path / "r.json")]
    )
    assert res["tokens_on"] > 0 and res["tokens_off"] > 0 and res["ratio_on_off"] > 0
    assert (res["turns_recorded"], res["turns_continued"]) == (4, 2)  # every later turn continued its episode
    assert 0 < res["recorder_share_on"] < 1


def test_bench_record_trees_times_both_sides_in_one_run(tiny_model_dir, tmp_path):
    from benchmarks import bench_record_trees

    res = bench_record_trees.main(
        [
            "--model",
            str(tiny_model_dir),
            "--prompts",
            "1",
            "--budget",
            "2",
            "--pairs",
            "1",
            "--warmup",
            "0",
            "--max-response-tokens",
            "8",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert len(res["iterations"]["on"]) == len(res["iterations"]["off"]) == 1
    assert res["record_s"][0] > 0 and res["chunk_bytes_median"] > 0 and 0 < res["record_share"] < 1


@pytest.mark.timeout(300)
def test_bench_lora_compares_both_variants(tiny_model_dir, tmp_path):
    import json

    from benchmarks import bench_lora

    out = tmp_path / "lora.json"
    assert (
        bench_lora.main(
            [
                "--model",
                str(tiny_model_dir),
                "--rank",
                "4",
                "--rounds",
                "1",
                "--steps",
                "1",
                "--prompts",
                "2",
                "--budget",
                "2",
                "--tokens",
                "8",
                "--prompt-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())["summary"]
    trainable, copy = summary["trainable"], summary["copy_bytes"]
    assert 0 < trainable["lora"] < trainable["full"]
    assert copy["lora"] == 4 * trainable["lora"] < copy["full"]  # an fp32 copy of the adapter only
    assert summary["policy_bytes"]["lora"] < summary["policy_bytes"]["full"]
    assert summary["trainer_state_bytes"]["lora"] < summary["trainer_state_bytes"]["full"]


@pytest.mark.timeout(300)
def test_bench_serve_compares_with_and_without_the_checks(tmp_path, monkeypatch):
    """bench_serve --compare-checks: the side with the checks has the proxy's gate and the key (it strips a client's
    x-request-id, refuses a request without the key), the side without has neither; both serve every request."""
    import json

    import ray
    import ray._private.ray_constants as ray_constants

    from benchmarks import bench_serve
    from serve.cli.serve import RAY_LOOPBACK_ENV

    # The benchmark starts Ray on loopback as `arpo serve` does, which sets the variable and Ray's constant in this
    # process: both are put back afterwards (setenv first, so that the undo knows the variable was unset), or every
    # multi-node test after this one would start nodes that refuse to form a cluster.
    monkeypatch.setenv(RAY_LOOPBACK_ENV, "1")
    monkeypatch.delenv(RAY_LOOPBACK_ENV)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "serve.json"
    res = bench_serve.main(
        [
            "--model",
            "tiny",
            "--compare-checks",
            "--check-rounds",
            "1",
            "--clients",
            "1,2",
            "--requests-per-client",
            "1",
            "--max-tokens",
            "2",
            "--no-in-process",
            "--out",
            str(out),
        ]
    )
    assert res["checks"]["sides"] == {"with": {"status": 401, "gate": True}, "without": {"status": 200, "gate": False}}
    for c in (1, 2):
        side = res["checks"][c]
        assert side["requests_each"] == c and side["p50_s_with"] > 0 and side["p50_s_without"] > 0, side
    work = res["checks"]["in_process"]
    assert work["us_with"] > work["us_without"] > 0 and work["us_checks"] == work["us_with"] - work["us_without"]
    assert json.loads(out.read_text())["checks"]["1"]["p50_ratio"] > 0


@pytest.mark.timeout(300)
def test_bench_multi_lora_runs_both_variants_per_agent_count(tmp_path):
    import json

    from benchmarks import bench_multi_lora

    out = tmp_path / "multi.json"
    assert (
        bench_multi_lora.main(
            [
                "--agents",
                "2",
                "--clients",
                "1",
                "2",
                "--seconds",
                "0.5",
                "--tokens",
                "2",
                "--rank",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    shared, separate = [next(r for r in report["rows"] if r["variant"] == v) for v in ("shared", "separate")]
    assert shared["clients"]["2"]["requests"] > 0 and separate["clients"]["1"]["tokens_per_s"] > 0
    assert shared["add_agent_s"] > 0 and "add_agent_s" not in separate
    assert report["ratios"][0]["agents"] == 2 and report["ratios"][0]["memory_shared_over_separate"] > 0


@pytest.mark.timeout(120)
def test_bench_viewer_requests_counts_only_the_page_the_index_and_the_groups_shown(tmp_path):
    """On a tiny folder the page fetches itself, its script and style, the index, and one group per step shown: all
    from the viewer's own origin."""
    from benchmarks import bench_viewer_requests
    from tests.browser import find_browser

    find_browser()
    res = bench_viewer_requests.main(
        ["--prompts", "4", "--trajectories", "4", "--iterations", "3", "--out", str(tmp_path / "r.json")]
    )
    assert (tmp_path / "r.json").is_file() and res["folder_bytes"] > res["index_bytes"] > 0
    first, switch, prompt = res["first_load"], res["switch_iteration"], res["open_prompt"]
    for s in (first, switch, prompt):
        assert s["all_same_origin"] and s["only_allowed_paths"], s["entries"]
    assert {"/", "/viewer.js", "/viewer.css", "/v1/index"} <= set(first["paths"])
    assert first["group_requests"] == ["iteration=3&group=0"]  # the latest iteration's first prompt, nothing ahead
    assert switch["group_requests"] == ["iteration=1&group=0"] and prompt["group_requests"] == ["iteration=1&group=3"]
    # beyond the group shown, a step may only hold the page's two-second index polls
    for s in (switch, prompt):
        assert s["requests"] == 1 + s["index_requests"], s["entries"]
    assert first["requests"] == 4 + first["index_requests"], first["entries"]
