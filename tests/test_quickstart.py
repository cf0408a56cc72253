"""arpo_algo/run/quickstart.py's summary helpers (per-stage peak memory, the multi-seed reference line) and the
extras scripts/quickstart and scripts/test install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_algo.run import quickstart


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM / clear_refs are Linux /proc features")
def test_peak_rss_is_reset_per_stage():
    big = bytearray(300 * 2**20)  # 300 MB resident
    big[::4096] = b"x" * len(big[::4096])
    with_big = quickstart.peak_rss_gb()
    del big
    assert quickstart.reset_peak_rss()
    after_reset = quickstart.peak_rss_gb()
    assert with_big - after_reset > 0.2  # the reset forgot the 300 MB peak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and VmRSS are Linux features")
def test_release_memory_hands_freed_heap_memory_back_to_the_os():
    """4 KB blocks live on glibc's heap (below its mmap threshold); freed under a block that is still in use at the
    top of the heap, they stay resident (glibc trims only a free top) until ``malloc_trim``."""
    import gc

    blocks = [bytes(4000) + bytes([i % 256]) for i in range(100_000)]  # ~400 MB of malloc'd blocks
    pin = bytes(4000) + b"x"  # allocated after them: above them on the heap, alive through the test
    with_blocks = quickstart.rss_gb()
    del blocks
    gc.collect()
    freed = quickstart.rss_gb()
    # Measured from the freed state, not from before the allocation: in a long pytest process some blocks land in
    # holes earlier tests left on the heap (already resident), so the growth alone can be well under 400 MB.
    assert with_blocks - freed < 0.1  # freed, but still resident
    assert quickstart.release_memory() is True
    assert freed - quickstart.rss_gb() > 0.3  # handed back
    assert pin[-1:] == b"x"


def test_quickstart_sft_settings_are_valid_and_only_change_memory():
    """The quickstart's SFT memory settings are accepted by SFTConfig, and its batches stay those of batch 8."""
    from arpo_algo.train.sft import SFTConfig

    cfg = SFTConfig(**quickstart.SFT_SETTINGS)
    cfg.validate()
    assert (cfg.batch_size, cfg.grad_accum, cfg.rows_per_forward, cfg.gradient_checkpointing) == (8, 1, 4, False)


def test_reference_line_reports_the_distribution_and_says_whether_arpo_beats_grpo(tmp_path, monkeypatch):
    ref = {
        "num_seeds": 5,
        "sft_seed": 0,
        "command": "cmd",
        "machine": "m",
        "configurations": {
            "arpo": {"before": 0.25, "after_mean": 0.30, "after_sd": 0.02, "improved": 4, "worse": 1},
            "grpo": {"before": 0.25, "after_mean": 0.31, "after_sd": 0.03, "improved": 5, "worse": 0},
        },
    }
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(ref))
    monkeypatch.setattr(quickstart, "REFERENCE", path)
    line = quickstart.reference_line({"accuracy_after_sft": 0.25, "accuracy_after_arpo": 0.28125})
    assert "this seed: 0.250 -> 0.281" in line and "measured in fp32 over 5 RL seeds" in line
    assert "arpo: before 0.250, after 0.300 ± 0.020 (sd), improved on 4 of 5 seeds, worse on 1" in line
    assert "ARPO does not beat GRPO at this size" in line
    ref["configurations"]["arpo"]["after_mean"] = 0.50
    path.write_text(json.dumps(ref))
    assert "ARPO beats GRPO" in quickstart.reference_line({"accuracy_after_sft": 0.25, "accuracy_after_arpo": 0.5})
    monkeypatch.setattr(quickstart, "REFERENCE", tmp_path / "missing.json")
    assert "none recorded" in quickstart.reference_line({"accuracy_after_sft": 0.0, "accuracy_after_arpo": 0.0})


def test_a_stage_is_reused_only_for_the_arguments_that_made_it(tmp_path):
    """Bug: a second quickstart with another --seed (or a real run after a smoke run) in the same folder reused the
    earlier stages' results and labelled them with the new seed."""
    from arpo_base.errors import ConfigError

    runs = []

    def stage():
        runs.append(1)
        return {"value": len(runs)}

    first = quickstart.run_stage(tmp_path, "rl", stage, {"seed": 0})
    again = quickstart.run_stage(tmp_path, "rl", stage, {"seed": 0})
    assert first["value"] == again["value"] == 1 and len(runs) == 1  # same arguments: done once, reused
    with pytest.raises(ConfigError, match="done with {'seed': 0}; this run asks for {'seed': 1}") as err:
        quickstart.run_stage(tmp_path, "rl", stage, {"seed": 1})
    assert "--output" in err.value.hint and len(runs) == 1


def test_a_stage_records_its_wall_and_cpu_time_children_included(tmp_path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"

    def busy_child():
        subprocess.run([sys.executable, "-c", burn], check=True)
        return {}

    def idle():
        import time

        time.sleep(1.5)
        return {}

    busy = quickstart.run_stage(tmp_path, "busy", busy_child)
    assert busy["stage_cpu_s"] >= 0.4  # the child's CPU time counts once it has been waited for
    rest = quickstart.run_stage(tmp_path, "idle", idle)
    # sleeping is wall time, not CPU time (the stage's own gc and heap trim cost both, about equally)
    assert rest["stage_time_s"] - rest["stage_cpu_s"] >= 1.2
    assert json.loads((tmp_path / ".stage_busy.json").read_text())["stage_cpu_s"] == busy["stage_cpu_s"]


REPO = Path(__file__).resolve().parents[1]


def test_the_quickstart_installs_no_extra_and_the_tests_add_dev_to_its_environment(tmp_path):
    """The two scripts of the README against one environment whose python, pip included, only logs what it is
    asked (nothing is installed): the quickstart installs arpo without extras, scripts/test then adds dev once, and
    neither installs again while pyproject.toml is unchanged."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "arpo"):
        exe = venv / "bin" / tool
        exe.write_text(f'#!/usr/bin/env bash\necho "{tool} $*" >> "{log}"\n')
        exe.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV="{venv}" PATH="{venv}/bin:$PATH"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ARPO_EXTRAS", "VIRTUAL_ENV")}
    env["ARPO_VENV"] = str(venv)

    def run(script: str, **extra: str) -> list[str]:
        log.write_text("")
        done = subprocess.run(
            [str(REPO / "scripts" / script)],
            env={**env, **extra},
            check=True,
            timeout=60,
            capture_output=True,
            text=True,
        )
        # a first run has no install stamp yet: that is not an error, and a newcomer sees none
        assert "No such file" not in done.stderr, done.stderr
        return [line for line in log.read_text().splitlines() if " -e " in line]  # the arpo install, if any

    assert run("quickstart") == [f"python -m pip install -q --disable-pip-version-check -e {REPO}"]
    assert run("test") == [f"python -m pip install -q --disable-pip-version-check -e {REPO}[dev]"]
    assert run("quickstart") == [] and run("test") == []  # dev stays; nothing reinstalls
    assert run("test", ARPO_EXTRAS="docker") == [
        f"python -m pip install -q --disable-pip-version-check -e {REPO}[dev,docker]"
    ]
    assert run("quickstart") == []


def test_the_quickstart_runs_sft_in_fp32_and_the_learner_natively_unless_told_and_keys_stages_by_both(tiny_model_dir):
    """--sft-precision defaults to fp32 (a bf16 SFT measured to leave RL nothing to learn) and --precision, the
    learner's, to native (measured to learn as fp32 does); the learner's reaches the RL experiment unless a --set says
    otherwise, and a stage done at one precision is not reused for another."""
    import argparse

    from arpo_algo.train.device_setup import PRECISIONS, cpu_capability

    assert set(quickstart.PRECISION_CHOICES) == set(PRECISIONS)
    parser = argparse.ArgumentParser()
    quickstart.add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.sft_precision, defaults.precision) == ("fp32", "native")
    asked = parser.parse_args(["--precision", "fp32", "--sft-precision", "native"])
    assert (asked.sft_precision, asked.precision) == ("native", "fp32")
    for flag in ("--precision", "--sft-precision"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "half"])
    assert quickstart.stage_inputs("sft", 0, "native") != quickstart.stage_inputs("sft", 0, "fp32")
    native = quickstart.load_rl_experiment(str(tiny_model_dir), 0, ['training.precision="native"'])
    assert native.config.settings.training.precision == "native"
    pinned = quickstart.load_rl_experiment(
        str(tiny_model_dir), 0, ['training.precision="native"', 'training.precision="fp32"']
    )
    assert pinned.config.settings.training.precision == "fp32"  # the user's --set comes last and wins
    summary = quickstart.precision_summary({"sft": "fp32", "learner": "native"}, {"precision": "fp32"}, native)
    expected = "bf16" if cpu_capability()["native_bf16_matmul"] else "fp32"
    assert summary["arpo"] == expected and summary["evaluation"] == "fp32"
    assert summary["cpu"] == cpu_capability()
    line = quickstart.precision_line(summary)
    assert line.startswith(
        f"precision: SFT fp32 (asked fp32), ARPO learner {expected} (asked native), evaluation fp32 (CPU flags: "
    )


def test_a_stage_done_before_precision_was_recorded_counts_as_fp32(tmp_path):
    """Bug: stages finished by a version without --precision recorded no precision, so every re-run of the quickstart
    in the same folder was refused instead of skipping the work it had done (all of it was fp32)."""
    from arpo_base.errors import ConfigError

    inputs = quickstart.stage_inputs("sft", 0, "fp32")
    old = {k: v for k, v in inputs.items() if k != "precision"}
    (tmp_path / ".stage_sft.json").write_text(json.dumps({"path": "sft", "inputs": old}))
    ran = []
    assert quickstart.run_stage(tmp_path, "sft", lambda: ran.append(1) or {}, inputs)["path"] == "sft"
    assert not ran  # reused
    with pytest.raises(ConfigError, match="'precision': 'native'"):
        quickstart.run_stage(tmp_path, "sft", lambda: ran.append(1) or {}, quickstart.stage_inputs("sft", 0, "native"))
    assert not ran


def test_an_rl_stage_done_when_one_flag_set_both_precisions_is_reused_for_the_same_learner(tmp_path):
    """Before --sft-precision, one --precision set SFT and the learner: a stage it finished records only
    ``precision``, and is reused when this run asks the same of both, refused when the learner's differs."""
    from arpo_base.errors import ConfigError

    sft = quickstart.stage_inputs("sft", 0, "fp32")
    old = {**sft, "seed": 0, "set": []}
    (tmp_path / ".stage_arpo.json").write_text(json.dumps({"policy": "p", "inputs": old}))
    ran = []
    same = {**sft, "learner_precision": "fp32", "seed": 0, "set": []}
    assert quickstart.run_stage(tmp_path, "arpo", lambda: ran.append(1) or {}, same)["policy"] == "p"
    with pytest.raises(ConfigError, match="'learner_precision': 'native'"):
        quickstart.run_stage(tmp_path, "arpo", lambda: ran.append(1) or {}, {**same, "learner_precision": "native"})
    assert not ran
