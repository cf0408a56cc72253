"""ARPO/AEPO/GRPO as RLlib Algorithms on a tiny real model: iterations, metrics, evaluation, resources."""

from __future__ import annotations

import os

import pytest

from arpo_algo.algorithms import ARPO, ARPOConfig, GRPOConfig
from arpo_algo.algorithms.components import PromptIterator, check_resources_feasible, resource_bundles
from arpo_algo.eval.trees import TreeReader
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.types import Group, Trajectory
from arpo_base.errors import ConfigError


def tiny_config(model_dir, cls: type[ARPOConfig] = ARPOConfig) -> ARPOConfig:
    cfg = (
        cls()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        .training(model_path=str(model_dir), prompts_per_step=1, lr=1e-4)
        .llm_rollouts(max_response_tokens=16, hf={"max_batch_size": 4})
    )
    return cfg.tree(budget=2, initial=2) if cls is GRPOConfig else cfg.tree(budget=2, initial=1)


def test_two_arpo_iterations_on_a_tiny_model(tiny_model_dir):
    import ray

    # The random tiny model never scores, so every group's rewards are equal; the entropy bonus is a loss term that
    # always has a gradient, so every update must really change the weights (a check that passes when nothing was
    # learned would prove nothing).
    cfg = tiny_config(tiny_model_dir).evaluation(every=2, num_prompts=2).training(entropy_coef=0.01)
    algo = cfg.build_algo()
    try:
        before = {k: v.detach().clone() for k, v in algo.learner.model.named_parameters()}
        r1 = algo.train()
        r2 = algo.train()
    finally:
        algo.stop()
    assert not ray.is_initialized()  # in-process: no Ray cluster
    assert (r1["training_iteration"], r2["training_iteration"]) == (1, 2)
    for key in ("reward_mean", "accuracy", "tool_calls_per_traj", "pass_at_k"):
        assert key in r2
    assert "tokens_per_s" in r2 and {"branches", "tokens_generated"} <= set(r2["rollout"])
    assert r2["num_trajectories"] == 2.0
    assert {"grad_norm", "clip_frac", "kl"} <= set(r2["learner"]["loss"]) | set(r2["learner"])
    assert "entropy_after_tool" in r2["rollout"]
    assert {"sync_time", "rollout_time", "update_time"} <= set(r2["timers"])
    assert "evaluation" not in r1 and r2["evaluation"]["num_tasks"] == 2.0
    assert r2["evaluation"]["accuracy"] in (0.0, 0.5, 1.0) and "tool_calls_per_traj" in r2["evaluation"]  # of 2
    # the engine shares the learner's module, so the update is what the next rollout samples from
    assert algo.engine.model is algo.learner.model
    delta = sum(float((p.detach() - before[k]).pow(2).sum()) for k, p in algo.learner.model.named_parameters())
    assert delta > 0 and r1["learner"]["grad_norm"] > 0 and r1["learner"]["skipped_no_signal"] == 0
    assert r1["learner"]["param_change_norm"] > 0 and r2["learner"]["param_change_norm"] > 0
    assert algo.learner.step == 2


def test_rollouts_sample_from_the_updated_weights(tiny_model_dir):
    # Regression: the in-process HF engine shares the learner's module and decoded through transposed copies of its
    # linear weights, refreshed when autograd's version counters changed; the fused AdamW step does not bump them, so
    # every rollout after the first update sampled from the starting weights (learner/kl_rollout 0.05-0.39 on the
    # quickstart). The rollout's log-probs must be those of the weights the learner holds at update time.
    cfg = tiny_config(tiny_model_dir).training(entropy_coef=0.01, lr=1e-3)
    algo = cfg.build_algo()
    try:
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    assert all(r["learner"]["param_change_norm"] > 0 for r in results)
    assert all(abs(r["learner"]["kl_rollout"]) < 1e-6 for r in results), [r["learner"]["kl_rollout"] for r in results]
    # the alarm's tail statistics are logged beside the token mean, far under their warning levels
    assert all(r["learner"]["logprob_tail_frac"] == 0 and r["learner"]["kl_rollout_traj_max"] < 1e-6 for r in results)


def test_grpo_is_the_same_path_without_branches(tiny_model_dir, tmp_path):
    trees = tmp_path / "trees"
    algo = tiny_config(tiny_model_dir, GRPOConfig).llm_rollouts(record_path=str(trees)).build_algo()
    try:
        assert type(algo).__name__ == "GRPO"
        groups, _ = algo.sampler.sample([0], step=0)
        before = {k: v.detach().clone() for k, v in algo.learner.model.named_parameters()}
        result = algo.train()
    finally:
        algo.stop()
    # equal rewards (the random model never scores) and no other loss term: no signal, so no optimizer step at all
    assert result["reward_mean"] == 0.0 and result["learner"]["skipped_no_signal"] == 1
    assert all((before[k] == p).all() for k, p in algo.learner.model.named_parameters()) and algo.learner.step == 0
    assert len(groups[0].trajectories) == 2
    assert all(t.kind == "initial" for t in groups[0].trajectories)
    assert result["rollout"]["branches"] == 0.0
    # only what an update trained on is recorded: train()'s one group, not the one sampled by hand
    reader = TreeReader(trees)
    assert reader.refresh() == [1] and len(reader.iterations[1]["groups"]) == 1
    assert reader.group(1, 0)["policy_version"] == 0


def test_infeasible_resources_fail_fast_with_a_message():
    cfg = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0")
        .training(model_path="x")
        .llm_rollouts(num_rollout_actors=(os.cpu_count() or 1) + 1)
    )
    with pytest.raises(ConfigError, match="CPUs") as err:
        ARPO.default_resource_request(cfg)
    assert "num_rollout_actors" in err.value.hint
    with pytest.raises(ConfigError, match="GPU"):
        check_resources_feasible(
            resource_bundles(ARPOConfig().llm_rollouts(device="cuda")) if not _has_gpu() else [{"CPU": 1, "GPU": 99}]
        )


def test_topk_logprobs_above_what_the_engine_returns_fails_before_any_rollout(tiny_model_dir):
    """The HF engine returns at most the whole vocabulary per token; asking the tree for more is refused when the
    sampler is built, not answered with a shorter list or an engine error for every trajectory."""
    import json

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]  # the logits' width
    cfg = tiny_config(tiny_model_dir).tree(entropy_method="topk_sum_lnV", topk_logprobs=vocab + 1)
    cfg.validate()  # the vocabulary is the model's: only the built engine knows it
    with pytest.raises(ConfigError, match=rf"tree.topk_logprobs={vocab + 1} .*at most {vocab} logprobs") as err:
        cfg.build_algo()
    assert f"at most {vocab}" in err.value.hint


def test_a_bf16_sampler_is_judged_at_the_bf16_sampler_alarm_levels(tiny_model_dir):
    """Bug: the mismatch alarm took its levels from the learner's precision only, so a bfloat16 rollout actor against
    the float32 learner was held to the float32 warning level, 1e-4, which bf16 rounding alone passes (about 3e-4 on
    SmolLM2: a warning every iteration). A sampler in bf16 now brings its own levels unless the levels are set."""
    from arpo_algo.train.learner_config import MISMATCH_LEVELS, TAIL_LEVELS

    cfg = (
        tiny_config(tiny_model_dir)
        .training(entropy_coef=0.01)
        .llm_rollouts(dtype="bfloat16", num_rollout_actors=1, num_cpus_per_rollout_actor=0.5)
    )
    algo = cfg.build_algo()
    try:
        assert algo.learner.config.mismatch_levels(algo.learner.precision) == MISMATCH_LEVELS["bf16_sampler"]
        r = algo.train()
    finally:
        algo.stop()
    assert r["learner"]["param_change_norm"] > 0
    print(
        f"bf16 sampler against the fp32 learner: kl_rollout {r['learner']['kl_rollout']:.3g}, "
        f"logprob_diff_max {r['learner']['logprob_diff_max']:.3g}"
    )
    assert 0 < r["learner"]["logprob_diff_max"] and r["learner"]["kl_rollout"] < MISMATCH_LEVELS["bf16_sampler"][0]
    training = cfg.copy(copy_frozen=False).training(kl_rollout_stop=0.005).settings.training
    assert training.for_sampler("bfloat16", "cpu").mismatch_levels("fp32") == (1e-3, 0.005)  # set by hand: kept
    assert training.for_sampler("float32", "cpu") is training
    bf16_learner = cfg.copy(copy_frozen=False).training(precision="bf16").settings.training
    assert bf16_learner.for_sampler("bfloat16", "cpu") is bf16_learner  # its own levels are the looser ones
    # a bf16 learner on a CPU against an fp32 sampler: the levels measured for that pair
    on_cpu = bf16_learner.for_sampler("float32", "cpu")
    assert on_cpu.mismatch_levels("bf16") == MISMATCH_LEVELS["bf16_cpu"]
    assert on_cpu.tail_levels("bf16") == TAIL_LEVELS["bf16_cpu"]
    native = cfg.copy(copy_frozen=False).training(precision="native").settings.training.for_sampler("float32", "cpu")
    from arpo_algo.train.device_setup import cpu_capability

    expected = MISMATCH_LEVELS["bf16_cpu" if cpu_capability()["native_bf16_matmul"] else "fp32"]
    assert native.mismatch_levels("bf16" if cpu_capability()["native_bf16_matmul"] else "fp32") == expected


def test_resource_request_counts_rollout_actors():
    cfg = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0")
        .training(model_path="x")
        .llm_rollouts(num_rollout_actors=1, num_cpus_per_rollout_actor=0.5)
    )
    pgf = ARPO.default_resource_request(cfg)
    assert pgf.bundles == [{"CPU": 1.0}, {"CPU": 0.5}]


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_prompt_iterator_is_a_seeded_permutation_with_resumable_state():
    it = PromptIterator(5, seed=3)
    first_epoch = it.next(5)
    assert sorted(first_epoch) == [0, 1, 2, 3, 4]
    it.next(2)
    state = it.get_state()
    expected = [it.next(3) for _ in range(3)]
    other = PromptIterator(5, seed=3)
    other.set_state(state)
    assert [other.next(3) for _ in range(3)] == expected
    assert PromptIterator(5, seed=4).next(5) != first_epoch or PromptIterator(5, seed=5).next(5) != first_epoch


def test_prompt_iterator_never_repeats_a_task_within_a_step():
    # 3 prompts a step from 5 tasks: every other step crosses an epoch border, where a task of the old epoch's tail
    # can come again at the new epoch's head (the same seeds: a bit-identical group weighted twice)
    for seed in range(10):
        it = PromptIterator(5, seed=seed)
        steps = [it.next(3) for _ in range(10)]
        assert all(len(set(s)) == 3 for s in steps), (seed, steps)
        # none lost: what was drawn plus what is carried is exactly the prefix of the epochs' orders walked so far
        drawn = [i for s in steps for i in s] + it.carry
        walked = [i for e in range(it.epoch + 1) for i in it._order(e)][: it.epoch * 5 + it.position]
        assert sorted(drawn) == sorted(walked), (seed, steps)
        state = it.get_state()
        again = PromptIterator(5, seed=seed)
        again.set_state(state)
        assert again.next(4) == it.next(4)  # the carried tasks are in the checkpoint
    it = PromptIterator(5, seed=0)
    assert set(it.next(2, exclude={0, 1, 2})) == {3, 4}
    with pytest.raises(ConfigError, match="prompts_per_step"):
        it.next(6)


def _traj(i: int, reward: float, info: dict, calls: int = 0, kind: str = "initial") -> Trajectory:
    return Trajectory(
        traj_id=i,
        response_ids=[1, 2],
        trained_mask=[1, 0],
        old_logprobs=[0.0, 0.0],
        entropies=[0.0, 0.0],
        reward=reward,
        reward_info=info,
        tool_calls=[{}] * calls,
        kind=kind,
    )


def test_scores_follow_the_written_protocol():
    right = {"score": 1.0, "format_ok": True}
    wrong = {"score": 0.0, "format_ok": True}
    bonus_but_wrong = {"score": 0.6, "f1": 0.5, "tool_bonus": 0.1, "format_ok": True}
    groups = [
        Group(0, [0], [_traj(0, 1.0, right, 2), _traj(1, 0.0, wrong)]),
        Group(1, [0], [_traj(0, 0.6, bonus_but_wrong), _traj(1, 0.0, wrong, kind="branch")], metrics={"branches": 1.0}),
    ]
    s = MK.summarize(groups)
    assert s["accuracy"] == 0.25 and s["pass_at_k"] == 0.5 and s["tool_calls_per_traj"] == 0.5
    assert s["rollout/branches"] == 1.0 and s["reward_mean"] == pytest.approx(0.4) and s["format_ok"] == 1.0
    assert s["num_trajectories"] == 4.0 and s["num_tasks"] == 2.0 and s["tokens_sampled"] == 4.0
    assert set(MK.quality(s)) == {k for k in s if "/" not in k}  # what eval reports: no rollout/ keys
