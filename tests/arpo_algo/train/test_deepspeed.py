"""The ``deepspeed`` learner backend on CPU: ZeRO-2 and ZeRO-3 over 2 real Ray actors (gloo), against the
single-process learner, and a killed ``arpo train`` with it that resumes.

These need the ``deepspeed`` extra; without it they skip, except with ARPO_REQUIRE_DEEPSPEED=1 (set by scripts/test in
CI, which installs the extra), where they fail. The first test builds DeepSpeed's CPU extension into the virtual
environment's cache (once per environment).

Tolerance: as in test_ddp (1e-5 absolute after two steps whose AdamW updates move weights by about 1e-3). ZeRO
sums the ranks' gradients in another order than one process and steps AdamW on flat shards, so the weights agree
to rounding, not bitwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.backends import build_backend
from arpo_algo.train.learner import LearnerConfig
from arpo_base.errors import ConfigError
from tests.arpo_algo.run.test_train_cli import write_experiment
from tests.arpo_algo.train import test_ddp
from tests.arpo_algo.train.test_ddp import CONFIGS, PACKING, REPO, TOL, _max_diff, _params

ray = pytest.importorskip("ray")
groups = test_ddp.groups  # the fixture: three groups of different token counts, the third without signal
#: Per ZeRO stage, the configurations of the default suite (each has a rank with more micro-batches than the other
#: and a step where one rank has no group); the others run with ``-m slow``.
DEFAULT = {2: ("token_mean", "mini_batches"), 3: ("token_mean", "hard_dr_grpo")}
CASES = [
    pytest.param(stage, name, id=f"zero{stage}-{name}", marks=() if name in DEFAULT[stage] else pytest.mark.slow)
    for stage in (2, 3)
    for name in CONFIGS
]


@pytest.fixture(scope="module")
def deepspeed_cpu():
    """DeepSpeed importable and its CPU extension built (into the environment's cache, reused after)."""
    if importlib.util.find_spec("deepspeed") is None:
        if os.environ.get("ARPO_REQUIRE_DEEPSPEED") == "1":
            pytest.fail(
                "ARPO_REQUIRE_DEEPSPEED=1 (CI) but deepspeed is not installed: scripts/test installs the "
                "deepspeed extra"
            )
        pytest.skip("deepspeed is not installed (pip install 'arpo[deepspeed]')")
    from arpo_algo.train.deepspeed_learner import extensions_dir

    if not (extensions_dir() / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file():  # scripts/test builds it
        subprocess.run(
            [sys.executable, "-m", "arpo_algo.train.deepspeed_learner"],
            check=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
        )


@pytest.mark.parametrize("stage, name", CASES)
def test_zero_step_equals_single_process_step(deepspeed_cpu, ray_session, tiny_model_dir, groups, stage, name):
    cfg = CONFIGS[name]
    local = build_backend(tiny_model_dir, cfg, seed=0)
    start = _params(local.model.state_dict())
    # a rank waiting in a collective its peer never joins fails within a minute instead of hanging the suite
    ds = build_backend(
        tiny_model_dir,
        cfg,
        BackendConfig(learner_backend="deepspeed", learner_workers=2, deepspeed_stage=stage, collective_timeout_s=60),
        seed=0,
    )
    try:
        # step 1: three groups over two ranks (token_mean: one rank packs two micro-batches, the other one);
        # step 2: one group, so rank 1 has none and still joins every forward, backward and reduction
        for step, batch in enumerate((groups, groups[:1]), start=1):
            want, got = local.update(batch), ds.update(batch)
            assert got["skipped_no_signal"] == 0 and got["skipped_nan"] == 0 and got["step"] == want["step"] >= step
            for key, value in want.items():
                if key in PACKING or (stage == 3 and key == "param_change_norm"):  # ZeRO-3 does not measure it
                    continue
                assert got[key] == pytest.approx(value, rel=1e-4, abs=TOL), (step, key)
        assert ds.last_rank_metrics[1]["tokens"] == 0  # the empty rank of step 2
        mine = _params(local.model.state_dict())
        rank0, rank1 = ds.replica_weights(0), ds.replica_weights(1)
        assert _max_diff(mine, start) > 100 * TOL  # the steps moved the weights well beyond the tolerance
        assert _max_diff(rank0, mine) < TOL
        assert _max_diff(rank0, rank1) == 0  # every rank holds (or gathers) the same weights
        assert _max_diff(ds.rollout_weights(), rank0) == 0
    finally:
        ds.close()


def test_deepspeed_settings_are_refused_before_any_rank_starts(ray_session):
    ds = BackendConfig(learner_backend="deepspeed", learner_workers=2)
    with pytest.raises(ConfigError, match="deepspeed_stage"):
        BackendConfig.from_dict({"learner_backend": "deepspeed", "deepspeed_stage": 1})
    with pytest.raises(ConfigError, match="offloading to it would move nothing"):
        build_backend("no-model-is-loaded", LearnerConfig(), replace(ds, deepspeed_offload="optimizer"))
    with pytest.raises(ConfigError, match="needs deepspeed_stage=3"):
        BackendConfig.from_dict({"learner_backend": "deepspeed", "deepspeed_offload": "optimizer_and_parameters"})
    with pytest.raises(ConfigError, match="only the deepspeed backend offloads"):
        BackendConfig.from_dict({"learner_backend": "ddp", "deepspeed_offload": "optimizer"})
    # the model path names nothing: a rank that started would fail on it, so these errors come before any rank
    with pytest.raises(ConfigError, match=r"= 0 GPU\(s\), 3 CPU\(s\); the Ray cluster has 0 GPU\(s\), 2 CPU\(s\)"):
        build_backend("no-model-is-loaded", LearnerConfig(), replace(ds, learner_workers=3))


def test_deepspeed_train_resumes_after_kill_9(deepspeed_cpu, tiny_model_dir, tmp_path):
    """``arpo train`` with two ZeRO-2 ranks, killed with SIGKILL (driver, ranks and Ray together) once a checkpoint is
    written, wherever it then is; resumed for one more iteration: the ranks' optimizer shards and the step count come
    back from the newest complete checkpoint."""
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=100)
    out = tmp_path / "run"
    sets = [
        "--set",
        "backend.learner_backend='deepspeed'",
        "--set",
        "backend.learner_workers=2",
        "--set",
        "backend.learner_cpus_per_worker=0.5",
        "--set",
        "evaluation.every=0",
        "--set",
        "experiment.keep_checkpoints=100",
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "arpo_algo.cli.main", "train", str(exp)]
    proc = subprocess.Popen(
        [*cmd, "--output", str(out), *sets],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "iter_000001").is_dir():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of iteration 1 within 600 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray processes (the ranks too), with no clean-up
        proc.wait(30)
    done = sorted(int(p.name.removeprefix("iter_")) for p in (out / "checkpoints").glob("iter_*"))
    assert done and done[-1] < 100  # killed mid-run
    last = done[-1] + 1
    resumed = subprocess.run(
        [*cmd, "--resume", str(out), "--set", f"experiment.iterations={last}", *sets],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    assert rows[-1]["iteration"] == last and rows[-1]["learner/learner_workers"] == 2
    assert rows[-1]["learner/step"] == last  # one optimizer step per iteration, counted on from the checkpoint
    assert (out / "checkpoints" / f"iter_{last:06d}" / "policy").is_dir()
