"""The ``ddp`` learner backend on CPU: 2 real Ray actors over gloo, against the single-process learner.

Tolerance: weights, AdamW moments and metrics agree within 1e-5 (absolute, fp32) after two steps at lr 1e-3, where
one AdamW step moves a weight by about 1e-3; the only difference allowed is the float summation order of the
gradients across ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from arpo_algo.rollout.types import Group
from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.backends import LocalLearner, build_backend
from arpo_algo.train.ddp import DDPBackend, combine_metrics, split_groups
from arpo_algo.train.learner import LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_base.errors import ConfigError
from tests.arpo_algo.train.test_tree_forward import make_groups

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5
#: Metrics of how the step was packed (micro-batch count, padded tokens), which depend on the split by design.
PACKING = ("micro_batches", "unique_tokens")
DDP2 = BackendConfig(learner_backend="ddp", learner_workers=2)
CONFIGS = {
    # token mean over the whole step, prefix-deduplicated packing, AEPO's per-group entropy shaping, one group per
    # micro-batch (so a rank with two groups accumulates two micro-batches), clipping on the global norm
    "token_mean": LearnerConfig(lr=1e-3, grad_clip=0.5, micro_batch_tokens=64, **ALARM_OFF, entropy_advantage=True),
    # per-sequence mean, padded batches, all groups of a rank in one micro-batch (soft attribution: hard attribution
    # has no per-sequence mean)
    "seq_mean": LearnerConfig(
        lr=1e-3,
        grad_clip=0.0,
        **ALARM_OFF,
        loss_agg="seq_mean",
        dedup_prefix=False,
        advantage="grpo",
        micro_batch_tokens=100_000,
    ),
    # hard attribution over the groups' branch prefixes, Dr. GRPO's constant normaliser (the longest response over
    # all ranks), the sampler's old log-probs and the k3 KL term to the frozen reference
    "hard_dr_grpo": LearnerConfig(
        lr=1e-3,
        grad_clip=0.0,
        **ALARM_OFF,
        advantage="hard",
        loss_agg="dr_grpo",
        old_logprobs="rollout",
        kl_coef=0.1,
        micro_batch_tokens=100_000,
    ),
    # one optimizer step per group (the flat group's step is skipped): the ranks share each of the single-process
    # learner's mini-batches, not mini-batches of their own groups
    "mini_batches": LearnerConfig(lr=1e-3, grad_clip=0.5, micro_batch_tokens=100_000, **ALARM_OFF, mini_batches=3),
}


@pytest.fixture(scope="module")
def groups(tiny_model_dir) -> list[Group]:
    """Three groups of different token counts; the third has equal rewards (no signal of its own)."""
    g0, g1 = make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))
    flat = Group(
        prompt_index=2,
        prompt_ids=g1.prompt_ids[:-3],
        trajectories=[replace(t, reward=1.0) for t in g0.trajectories[:3]],
    )
    return [g0, g1, flat]


def _params(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_ddp_needs_ray_running():
    """In a process of its own, without Ray: the module's Ray session (``ray_session``) stays up for the other tests,
    in whatever order they run."""
    code = (
        "import ray\n"
        "from arpo_algo.train.backend_config import BackendConfig\n"
        "from arpo_algo.train.ddp import DDPBackend\n"
        "from arpo_algo.train.learner import LearnerConfig\n"
        "from arpo_base.errors import ConfigError\n"
        "assert not ray.is_initialized()\n"
        "try:\n"
        "    DDPBackend('unused', LearnerConfig(), BackendConfig(learner_backend='ddp', learner_workers=2))\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "needs a running Ray cluster" in out.stdout, out.stdout


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ddp_step_equals_single_process_step(ray_session, tiny_model_dir, groups, name):
    cfg = CONFIGS[name]
    local = build_backend(tiny_model_dir, cfg, seed=0)
    assert isinstance(local, LocalLearner)
    start = _params(local.model.state_dict())
    ddp = build_backend(tiny_model_dir, cfg, DDP2, seed=0)
    try:
        assert isinstance(ddp, DDPBackend) and ddp.num_workers == 2
        # step 1: three groups over two ranks; step 2: one group, so rank 1 has nothing and still joins in
        for step, batch in enumerate((groups, groups[:1]), start=1):
            want, got = local.update(batch), ddp.update(batch)
            assert got["skipped_no_signal"] == 0 and got["skipped_nan"] == 0 and got["step"] == want["step"] >= step
            for key, value in want.items():
                if key in PACKING:
                    continue
                assert got[key] == pytest.approx(value, rel=1e-4, abs=TOL), (step, key)
        assert sorted(len(m) for m in [ddp.last_rank_metrics]) == [2]
        assert ddp.last_rank_metrics[1]["tokens"] == 0  # the empty rank of step 2
        mine = _params(local.model.state_dict())
        rank0, rank1 = ddp.replica_weights(0), ddp.replica_weights(1)
        assert _max_diff(mine, start) > 100 * TOL  # the steps moved the weights well beyond the tolerance
        assert _max_diff(rank0, mine) < TOL
        assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # the replicas stay bit-identical
        assert _max_diff(ddp.rollout_weights(), rank0) == 0
        ours, theirs = local.get_state()["optimizer"]["state"], ddp.get_state()["optimizer"]["state"]
        assert ours.keys() == theirs.keys()
        for i in ours:
            for k in ("exp_avg", "exp_avg_sq"):
                assert float((ours[i][k] - theirs[i][k]).abs().max()) < TOL, (i, k)
    finally:
        ddp.close()


def test_a_step_without_signal_is_skipped_on_every_rank(ray_session, tiny_model_dir, groups):
    flat = [groups[2], replace(groups[2], prompt_index=3, prompt_ids=groups[0].prompt_ids)]
    ddp = build_backend(tiny_model_dir, CONFIGS["token_mean"], DDP2, seed=0)
    try:
        before = [ddp.replica_weights(r) for r in range(2)]
        m = ddp.update(flat)
        assert m["skipped_no_signal"] == 1 and m["step"] == 0 and m["grad_norm"] == 0
        assert [r["skipped_no_signal"] for r in ddp.last_rank_metrics] == [1.0, 1.0]
        assert [r["tokens"] > 0 for r in ddp.last_rank_metrics] == [True, True]  # each rank had a group
        for r in range(2):
            assert _max_diff(ddp.replica_weights(r), before[r]) == 0
        # one rank without signal, the other with: both step (the decision is global)
        m = ddp.update([groups[2], groups[1]])
        assert m["skipped_no_signal"] == 0 and m["step"] == 1
        assert {r["step"] for r in ddp.last_rank_metrics} == {1.0}
    finally:
        ddp.close()


def test_asking_for_more_gpus_than_the_cluster_has_fails_before_any_actor(ray_session):
    gpus = int(ray.cluster_resources().get("GPU", 0))
    want = BackendConfig(learner_backend="ddp", learner_workers=gpus + 2)
    with pytest.raises(ConfigError) as err:
        DDPBackend("no-such-model-is-loaded", LearnerConfig(), want, device="cuda")
    msg = err.value.message
    assert f"{gpus + 2} learner worker(s)" in msg and f"= {gpus + 2:g} GPU(s)" in msg
    assert f"the Ray cluster has {gpus:g} GPU(s), 2 CPU(s)" in msg
    with pytest.raises(ConfigError, match=r"= 0 GPU\(s\), 3 CPU\(s\); the Ray cluster has"):
        DDPBackend("unused", LearnerConfig(), replace(DDP2, learner_workers=3), device="cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(learner_workers=2), "learner_workers is set but learner_backend='local'"),
        (dict(learner_backend="ddpp"), "did you mean 'ddp'"),
        (dict(learner_backend="ddp", learner_workers=0), "learner_workers must be >= 1"),
        (dict(learner_backend="ddp", learner_placement="shared"), "learner_placement"),
        (dict(learner_backend="deepspeed", deepspeed_stage=1), "deepspeed_stage"),
    ],
)
def test_backend_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BackendConfig.from_dict(kwargs)


@pytest.mark.parametrize(
    "kwargs, device, match",
    [
        (dict(learner_gpus_per_worker=0.5), "cpu", "needs rollouts.device='cuda'|GPU shares"),
        (dict(learner_gpus_per_worker=0.5), "cuda", "exactly one GPU of its own"),
        (dict(learner_gpus_per_worker=1.0, learner_placement="colocated"), "cuda", "leaves no share"),
    ],
)
def test_gpu_shares_are_checked_against_the_placement(kwargs, device, match):
    cfg = BackendConfig(learner_backend="ddp", learner_workers=2, **kwargs)
    with pytest.raises(ConfigError, match=match):
        cfg.worker_bundles(device)
    assert (
        BackendConfig(
            learner_backend="ddp", learner_workers=2, learner_placement="colocated", learner_gpus_per_worker=0.5
        ).worker_bundles("cuda")
        == [{"CPU": 1.0, "GPU": 0.5}] * 2
    )


def test_split_balances_tokens_and_keeps_order():
    # largest first onto the least-loaded rank: 10 | 9, 1 | 10 (tie -> rank 0) -> loads 11 / 10
    assert split_groups([10, 1, 1, 9], 2) == [[0, 2], [1, 3]]
    assert split_groups([5], 3) == [[0], [], []]
    assert split_groups([2, 3, 7, 3], 2) == [[2], [0, 1, 3]]  # loads 7 / 8, each rank's groups in their order


def test_combined_advantage_statistics_are_the_pooled_ones():
    a, b = [1.0, 2.0, 3.0], [10.0]
    stats = []
    for xs in (a, b):
        mean = sum(xs) / len(xs)
        sd = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
        stats.append(
            {
                "adv_mean": mean,
                "adv_sd": sd,
                "trained_tokens": float(len(xs)),
                "grad_norm": 2.0,
                "loss/policy": 0.25,
                "traj_with_grad_frac": 1.0 if xs is a else 0.0,
                "_num_seqs": 3.0 if xs is a else 1.0,
            }
        )
    out = combine_metrics(stats)
    allx = a + b
    mean = sum(allx) / 4
    assert out["adv_mean"] == pytest.approx(mean)
    assert out["adv_sd"] == pytest.approx((sum((x - mean) ** 2 for x in allx) / 4) ** 0.5)
    assert out["trained_tokens"] == 4 and out["grad_norm"] == 2.0 and out["loss/policy"] == 0.5
    assert out["traj_with_grad_frac"] == pytest.approx(0.75)
