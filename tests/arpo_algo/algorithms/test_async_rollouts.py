"""Asynchronous rollouts on a tiny real model with a real Ray rollout actor: staleness 0 is the synchronous update,
staleness 1 trains each batch one version behind (recorded on every trajectory and tree node) without a false
mismatch alarm, and a checkpoint records the data position before the batch in flight."""

from __future__ import annotations

import json

import torch

from arpo_algo.algorithms.components import PromptIterator
from arpo_algo.eval.trees import TreeReader
from arpo_algo.train.learner_config import MISMATCH_LEVELS
from tests.arpo_algo.algorithms.test_algorithm import tiny_config


def _config(model_dir, **rollouts):
    # the entropy bonus always has a gradient, so every update changes the weights (the random model never scores)
    return (
        tiny_config(model_dir)
        .training(entropy_coef=0.01, lr=1e-2)
        .llm_rollouts(num_rollout_actors=1, num_cpus_per_rollout_actor=1, **rollouts)
    )


def _run(cfg, iterations: int):
    algo = cfg.build_algo()
    try:
        results = [algo.train() for _ in range(iterations)]
        weights = {k: v.detach().clone() for k, v in algo.learner.model.state_dict().items()}
        state = algo.get_state()
    finally:
        algo.stop()
    return results, weights, state


def test_staleness_0_is_the_synchronous_update(tiny_model_dir, ray_session):
    sync, w_sync, _ = _run(_config(tiny_model_dir), 2)
    asyn, w_async, _ = _run(_config(tiny_model_dir, asynchronous=True, max_staleness=0), 2)
    assert all(torch.equal(w_sync[k], w_async[k]) for k in w_sync)
    assert all(r["learner"]["param_change_norm"] > 0 for r in sync)
    for s, a in zip(sync, asyn):
        assert s["learner"] == a["learner"]
        for key in ("reward_mean", "tokens_sampled", "response_len"):
            assert s[key] == a[key]
        for r in (s, a):
            assert r["rollout"]["staleness_max"] == 0.0 and r["rollout"]["staleness_mean"] == 0.0
        assert s["rollout"]["policy_version"] == a["rollout"]["policy_version"] == s["training_iteration"] - 1


def test_staleness_1_trains_each_batch_one_version_behind(tiny_model_dir, ray_session, tmp_path):
    trees = tmp_path / "trees"
    cfg = _config(tiny_model_dir, asynchronous=True, max_staleness=1, record_path=str(trees))
    results, _, state = _run(cfg, 3)
    warn, _ = MISMATCH_LEVELS["fp32"]
    # iteration k trains on the batch sampled under version k - 1 (iteration 0: sampled before anything was in flight)
    assert [r["rollout"]["policy_version"] for r in results] == [0.0, 0.0, 1.0]
    assert [r["rollout"]["staleness_max"] for r in results] == [0.0, 1.0, 1.0]
    assert [r["rollout"]["staleness_mean"] for r in results] == [0.0, 1.0, 1.0]
    # scored under the weights that sampled it: no false alarm, although every update really moved the weights
    assert all(r["learner"]["kl_rollout"] < warn and r["learner"]["param_change_norm"] > 0 for r in results)
    reader = TreeReader(trees)
    assert reader.refresh() == [1, 2, 3]  # the trained batches; the one in flight at the stop was never trained on
    groups = [reader.group(it, 0) for it in (1, 2, 3)]
    assert [g["metrics"]["step"] for g in groups] == [0.0, 1.0, 2.0]
    for g in groups:
        k = int(g["metrics"]["step"])  # the iteration that trains on it
        assert g["policy_version"] == max(k - 1, 0)  # version k or k - 1, here exactly as the pipeline orders it
        assert {t["policy_version"] for t in g["trajectories"]} == {g["policy_version"]}
        assert {n["policy_version"] for n in g["nodes"]} == {g["policy_version"]}  # a tree is one version
    # the checkpoint's data position is after the three trained batches, not the one in flight
    it = PromptIterator(state["prompts"]["num_tasks"], cfg.seed)
    for _ in range(3):
        it.next(1)
    assert state["prompts"] == it.get_state()


def test_evaluation_waits_for_the_batch_in_flight_and_a_restore_drops_it(tiny_model_dir, ray_session, tmp_path):
    trees = tmp_path / "trees"
    cfg = _config(tiny_model_dir, asynchronous=True, max_staleness=1, record_path=str(trees))
    algo = cfg.evaluation(num_prompts=1).build_algo()
    try:
        algo.train()
        algo.train()  # started batch 2 under version 1
        assert algo.rollout_pipeline.in_flight
        assert algo.evaluate()["num_tasks"] == 1.0
        assert algo.rollout_pipeline.in_flight  # finished under version 1 and kept: the evaluation did not change it
        path = algo.save_to_path(str(tmp_path / "ckpt"))  # after 2 iterations, batch 2 in flight
        trained = algo.train()  # batch 2, one version behind
        algo.restore_from_path(path)  # back to 2 iterations: batch 3, drawn after the save, is dropped
        assert not algo.rollout_pipeline.in_flight
        resumed = algo.train()  # batch 2 again, sampled now under version 2
    finally:
        algo.stop()
    assert trained["training_iteration"] == resumed["training_iteration"] == 3
    assert (trained["rollout"]["policy_version"], trained["rollout"]["staleness_max"]) == (1.0, 1.0)
    assert (resumed["rollout"]["policy_version"], resumed["rollout"]["staleness_max"]) == (2.0, 0.0)
    third = [
        json.loads(line)["groups"][0]
        for line in (trees / "index.jsonl").read_text().splitlines()
        if json.loads(line)["iteration"] == 3
    ]
    # iteration 3 recorded twice: the batch in flight at the save, and the one the resumed run sampled; the same
    # prompt, two versions
    assert [(g["prompt_index"], g["policy_version"]) for g in third] == [
        (third[0]["prompt_index"], 1),
        (third[0]["prompt_index"], 2),
    ]
