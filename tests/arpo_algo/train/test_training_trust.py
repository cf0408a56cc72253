"""Training you can trust: no step on rounding noise, the limit EOS, the rollout/learner mismatch alarm."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from arpo_algo.algorithms.stabilizers import has_signal
from arpo_algo.rollout.diagnostics import group_diagnostics
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_base.errors import ConfigError
from tests.arpo_algo.train.test_tree_forward import make_groups

# Hand-built behaviour log-probs are not the model's: the rollout/learner mismatch alarm would (rightly) stop.
BASE = LearnerConfig(lr=1e-3, grad_clip=0.0, micro_batch_tokens=100_000, **ALARM_OFF)


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))


def _with_rewards(g, rewards):
    trajs = [
        replace(t, traj_id=i, reward=r)
        for i, (t, r) in enumerate(zip((g.trajectories * len(rewards))[: len(rewards)], rewards))
    ]
    return replace(g, trajectories=trajs)


def test_equal_non_binary_rewards_are_no_signal_everywhere(tiny_model_dir, groups):
    """Six trajectories rewarded 1.1 (answer plus format bonus): their GRPO advantages in float are ~2e-10, not 0.
    The learner must not step on that (AdamW would normalise it into a full-size update), and dynamic sampling and
    the diagnostics must call such a group signal-free by the same rule."""
    flat = _with_rewards(groups[0], [1.1] * 6)
    learner = Learner(tiny_model_dir, BASE, seed=0)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    m = learner.update([flat])
    assert m["skipped_no_signal"] == 1 and learner.step == 0
    assert all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())
    rounded = _with_rewards(groups[0], [1.1, math.nextafter(1.1, 2.0)])  # equal rewards that differ in the last bit
    assert rounded.trajectories[0].reward != rounded.trajectories[1].reward
    assert not has_signal(rounded) and not has_signal(flat)
    assert group_diagnostics([rounded])["diag/zero_variance_group_frac"] == 1.0
    assert has_signal(_with_rewards(groups[0], [1.0, 1.0 + 1e-3])) and has_signal(_with_rewards(groups[0], [0.0, 1.0]))


@pytest.mark.parametrize("key, value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20)])
def test_sampling_the_learner_cannot_score_is_refused(key, value):
    """The learner scores log_softmax(logits) at temperature 1 over the whole vocabulary; training rollouts sampled
    from another distribution would make every ratio, KL and entropy term off-policy without a word."""
    from arpo_algo.algorithms import ARPOConfig

    cfg = ARPOConfig().training(model_path="unused").llm_rollouts(**{key: value})
    with pytest.raises(ConfigError, match=f"rollouts.{key}={value}") as err:
        cfg.settings.validate()
    assert "learner scores log_softmax" in err.value.hint
    ARPOConfig().training(model_path="unused").evaluation(top_p=0.9).settings.validate()  # evaluation may truncate


def _unsampled(g):
    """The group as if no token had been sampled by an engine (the tool-limit EOS's case): every position marked
    unsampled, its log-prob a NaN placeholder."""
    return replace(
        g,
        trajectories=[
            replace(t, old_logprobs=[math.nan] * len(t.old_logprobs), unsampled=list(range(len(t.old_logprobs))))
            for t in g.trajectories
        ],
    )


@pytest.mark.parametrize("dedup", [True, False])
def test_a_token_the_sampler_did_not_sample_is_scored_by_the_learner(tiny_model_dir, groups, dedup):
    """The tool-limit EOS is appended, not sampled (log-prob NaN). With old_logprobs='rollout' it gets the learner's
    own log-prob under the sampling policy version, so its ratio starts at 1 (with the former 0.0 the ratio was
    pi(EOS) and the token was effectively not trained); the mismatch alarm leaves it out. All unknown = recompute."""
    cfg = replace(LearnerConfig(lr=1e-3, grad_clip=0.0, micro_batch_tokens=100_000), dedup_prefix=dedup)
    rollout = Learner(tiny_model_dir, replace(cfg, old_logprobs="rollout"), seed=0)
    recompute = Learner(tiny_model_dir, cfg, seed=0)
    m = rollout.update([_unsampled(g) for g in groups])
    recompute.update([_unsampled(g) for g in groups])
    assert m["skipped_nan"] == 0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["kl_rollout"] == 0.0 and m["logprob_diff_max"] == 0.0
    for (name, p), q in zip(rollout.model.named_parameters(), recompute.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("where", ["everywhere", "one token", "one inf"])
def test_a_non_finite_log_prob_from_an_engine_stops_the_run(tiny_model_dir, groups, where, caplog):
    """Only the explicit mark means "not sampled". A NaN (or inf) log-prob at a sampled position is an engine fault:
    an engine returning NaN everywhere must not read as kl_rollout = 0, nor one NaN be replaced silently."""
    from arpo_base.errors import ArpoError

    def broken(t, first):
        old = list(t.old_logprobs)
        trained = [i for i, m in enumerate(t.trained_mask) if m]
        for i in trained if where == "everywhere" else trained[:1] if first else []:
            old[i] = math.inf if where == "one inf" else math.nan
        return replace(t, old_logprobs=old)

    bad = [
        replace(g, trajectories=[broken(t, gi == 0 and j == 0) for j, t in enumerate(g.trajectories)])
        for gi, g in enumerate(groups)
    ]
    n_bad = sum(not math.isfinite(x) for g in bad for t in g.trajectories for x in t.old_logprobs)
    for recorded in ("rollout", "recompute"):
        learner = Learner(tiny_model_dir, replace(BASE, old_logprobs=recorded), seed=0)
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        with pytest.raises(ArpoError, match=rf"returned {n_bad} non-finite log-prob"):
            learner.update(bad)
        assert learner.step == 0 and all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())
        assert f"{n_bad} non-finite" in caplog.text


def test_learner_and_sampler_agree_under_a_dropout_config(tiny_model_dir, tmp_path):
    """A model whose config asks for dropout: the sampler scores in eval mode, so the learner's old log-probs, the
    alarm and its training forward must score the same function (dropout off at load, pre-step scoring in eval)."""
    import json
    import shutil

    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.config import RolloutsConfig
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_algo.train.learner_config import MISMATCH_LEVELS
    from arpo_env.core import ToolTextEnv

    model = shutil.copytree(tiny_model_dir, tmp_path / "dropout")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    tools = {"python": {}, "cache": {"path": str(tmp_path / "c.sqlite")}}
    engine = HFEngine(model, dtype="float32", seed=0)
    sampler = TreeSampler.from_config(
        engine,
        lambda: ToolTextEnv(task="toolmath", tools=tools),
        TreeConfig.grpo(4),
        RolloutsConfig(max_response_tokens=16),
        seed=0,
    )
    learner = Learner(model, LearnerConfig(lr=1e-3, micro_batch_tokens=100_000, old_logprobs="rollout"), seed=0)
    try:
        groups, _ = sampler.sample([0, 1], step=0)
        groups = [_with_rewards(g, [0.0, 1.0, 0.0, 1.0]) for g in groups]  # signal: the update takes its step
        m = learner.update(groups)
    finally:
        sampler.close()
    assert m["kl_rollout"] < MISMATCH_LEVELS["fp32"][0] and m["logprob_diff_max"] < 1e-3
    # the training forward is the sampler's function too: one epoch, one mini-batch, ratio 1 up to rounding
    assert m["optimizer_steps"] == 1 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0.0
    assert learner.model.config.attention_dropout == 0.0
    # a saved policy keeps the model's own rate (zero is how RL scores, not the model); the learner stays at zero
    saved = learner.save_pretrained(tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())["attention_dropout"] == 0.5
    assert learner.model.config.attention_dropout == 0.0


def test_an_engine_not_told_about_the_update_stops_the_run(tiny_model_dir, groups, tmp_path):
    """A real HF engine with its own weight copy (as a rollout actor holds) samples; the learner steps; the engine
    is not sent the new weights. The next update must stop before training on the stale samples, naming the cause;
    once the weights are pushed, training goes on."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.config import RolloutsConfig
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_algo.train.learner_config import MISMATCH_LEVELS
    from arpo_base.errors import ArpoError
    from arpo_env.core import ToolTextEnv

    tools = {"python": {}, "cache": {"path": str(tmp_path / "c.sqlite")}}
    engine = HFEngine(tiny_model_dir, dtype="float32", seed=0)
    sampler = TreeSampler.from_config(
        engine,
        lambda: ToolTextEnv(task="toolmath", tools=tools),
        TreeConfig.grpo(2),
        RolloutsConfig(max_response_tokens=16),
        seed=0,
    )
    learner = Learner(tiny_model_dir, LearnerConfig(lr=3e-2, micro_batch_tokens=100_000), seed=0)
    warn, stop = MISMATCH_LEVELS["fp32"]
    try:
        fresh, _ = sampler.sample([0], step=0)
        m = learner.update(fresh)  # the engine holds the learner's weights: agreement up to kernel rounding
        assert m["kl_rollout"] < warn and m["logprob_diff_max"] < 1e-3
        learner.update([_unsampled(g) for g in groups])  # a real step the engine is not told about
        assert learner.step == 1
        stale, _ = sampler.sample([1], step=1)
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        with pytest.raises(ArpoError, match=r"KL\(sampler \|\| learner\) = .* above training.kl_rollout_stop") as e:
            learner.update(stale)
        assert "stale weights" in e.value.hint and learner.step == 1
        assert all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())
        engine.load_state_dict(learner.model.state_dict())
        pushed, _ = sampler.sample([1], step=1)
        assert learner.update(pushed)["kl_rollout"] < warn
    finally:
        sampler.close()


def test_mini_batches_are_sequential_steps_with_old_logprobs_fixed(tiny_model_dir, groups):
    """mini_batches = 2 is two optimizer steps, each on its own (shuffled) part of the groups with that part's loss
    aggregate, the old log-probs fixed for the update: exactly two one-part updates with the same behaviour
    log-probs. With recomputed old log-probs the second step's ratios move, so the clips act (clip_frac > 0)."""
    cfg = replace(BASE, old_logprobs="rollout", lr=3e-2)
    two = Learner(tiny_model_dir, replace(cfg, mini_batches=2), seed=0)
    parts = two.mini_batch_groups(len(groups))
    assert sorted(i for p in parts for i in p) == [0, 1] and all(len(p) == 1 for p in parts)
    m = two.update(groups)
    seq = Learner(tiny_model_dir, cfg, seed=0)
    for part in parts:
        seq.update([groups[i] for i in part])
    assert m["optimizer_steps"] == 2 and two.step == seq.step == 2
    for (name, p), q in zip(two.model.named_parameters(), seq.model.parameters()):
        assert torch.equal(p, q), name
    clipped = Learner(tiny_model_dir, replace(BASE, lr=3e-2, mini_batches=2), seed=0)
    mc = clipped.update([_unsampled(g) for g in groups])
    one = Learner(tiny_model_dir, replace(BASE, lr=3e-2), seed=0).update([_unsampled(g) for g in groups])
    assert one["clip_frac"] == 0.0 and one["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # one step: ratio 1
    assert mc["clip_frac"] > 0 and mc["optimizer_steps"] == 2


def test_aepo_defaults_take_several_steps_so_its_clip_acts(tiny_model_dir, groups):
    """AEPO's own defaults (entropy-balanced clip, recomputed old log-probs) split the batch into mini-batches, so
    from the second optimizer step on the ratio moves and the clip acts: clip_frac > 0 (with one step it is exactly
    0 and the clip is inert)."""
    from arpo_algo.algorithms.settings import Settings

    aepo = Settings.for_variant("aepo").training
    assert aepo.entropy_balanced_clip and aepo.old_logprobs == "recompute" and aepo.mini_batch_count > 1
    cfg = replace(aepo, lr=3e-2, grad_clip=0.0, micro_batch_tokens=100_000, **ALARM_OFF)
    m = Learner(tiny_model_dir, cfg, seed=0).update([_unsampled(g) for g in groups])
    assert m["optimizer_steps"] == 2 and m["clip_frac"] > 0  # 2 groups: one per part


@pytest.mark.parametrize("agg", ["dr_grpo", "seq_mean"])
def test_step_metrics_are_token_means_under_every_loss_agg(tiny_model_dir, groups, agg):
    """The logged ratio, clip fractions and entropy are token means whatever weights the loss uses: with one step and
    recomputed old log-probs every ratio is 1, so ratio_mean is 1, and entropy is the one token_mean logs."""
    mean = Learner(tiny_model_dir, BASE, seed=0).update(groups)
    m = Learner(tiny_model_dir, replace(BASE, loss_agg=agg), seed=0).update(groups)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac"] == 0.0
    assert m["entropy"] == pytest.approx(mean["entropy"], rel=1e-5) and mean["entropy"] > 0


def test_mini_batch_metrics_average_the_steps_taken_and_few_groups_make_fewer_parts(tiny_model_dir, groups):
    """A mini-batch without signal takes no step; the update's rate, losses and clip fractions are those of the steps
    taken (not pulled toward 0 by the skipped one). Fewer groups than mini-batches (dynamic sampling may keep fewer
    prompts than a step asks for) make one part per group instead of stopping the run."""
    flat = _with_rewards(groups[1], [1.0] * len(groups[1].trajectories))
    m = Learner(tiny_model_dir, replace(BASE, mini_batches=2), seed=0).update([groups[0], flat])
    alone = Learner(tiny_model_dir, BASE, seed=0).update([groups[0]])
    assert m["optimizer_steps"] == 1 and m["lr"] == pytest.approx(BASE.lr)
    assert m["loss/total"] == pytest.approx(alone["loss/total"], rel=1e-5) and alone["loss/total"] != 0
    three = Learner(tiny_model_dir, replace(BASE, mini_batches=3), seed=0)
    assert sorted(map(len, three.mini_batch_groups(len(groups)))) == [1, 1]
    assert three.update(groups)["optimizer_steps"] == 2


def test_mini_batches_are_validated():
    from arpo_algo.train.learner_config import TrainingConfig

    with pytest.raises(ConfigError, match="training.mini_batches must be > 0"):
        LearnerConfig(mini_batches=0).validate()
    with pytest.raises(ConfigError, match="mini_batches=3 is more than prompts_per_step=2"):
        TrainingConfig(mini_batches=3, prompts_per_step=2).validate()


def _hand_policy_loss(groups, hard: bool) -> float:
    """-(token-mean advantage) at ratio 1, by hand: soft attribution counts every trajectory's copy of a token with
    its own advantage; hard attribution counts a token inherited by branching once, with the mean advantage of the
    trajectories holding it."""
    from arpo_algo.core.advantages import grpo_advantages

    total, count = 0.0, 0
    for g in groups:
        adv = grpo_advantages([t.reward for t in g.trajectories])
        trajs = g.trajectories

        def owner(j: int, t: int, trajs=trajs) -> tuple[int, int]:
            p, bp = trajs[j].parent, trajs[j].branch_point
            return owner(p, t) if p is not None and t < bp else (j, t)

        holders: dict[tuple[int, int], list[int]] = {}
        for j, tr in enumerate(trajs):
            for t, m in enumerate(tr.trained_mask):
                if m:
                    holders.setdefault(owner(j, t) if hard else (j, t), []).append(j)
        for js in holders.values():
            total += sum(adv[j] for j in js) / len(js)
            count += 1
    return -total / count


@pytest.mark.parametrize("dedup", [True, False])
def test_hard_attribution_through_the_learner_counts_branch_prefixes_once(tiny_model_dir, groups, dedup):
    assert any(t.parent is not None for g in groups for t in g.trajectories)  # real shared prefixes
    got = {}
    for adv in ("hard", "grpo"):
        learner = Learner(tiny_model_dir, replace(BASE, advantage=adv, dedup_prefix=dedup), seed=0)
        got[adv] = learner.update([_unsampled(g) for g in groups])["loss/policy"]
    assert got["hard"] == pytest.approx(_hand_policy_loss(groups, hard=True), abs=1e-5)
    assert got["grpo"] == pytest.approx(_hand_policy_loss(groups, hard=False), abs=1e-5)
    assert abs(got["hard"] - got["grpo"]) > 1e-2


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize(
    "extra",
    [
        dict(loss_agg="token_mean"),
        dict(loss_agg="seq_mean"),
        dict(loss_agg="dr_grpo"),
        dict(loss_agg="dr_grpo", advantage="hard"),
        dict(advantage="hard"),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_micro_batch_split_does_not_change_the_update(tiny_model_dir, groups, dedup, extra):
    """One micro-batch for all groups vs one per group, the packing (dedup_prefix) held fixed: the same step."""
    if extra.get("advantage") == "hard" and extra.get("loss_agg") == "seq_mean":
        pytest.skip("refused combination")
    grads, metrics = [], []
    for mbt in (100_000, 10):
        learner = Learner(tiny_model_dir, replace(BASE, dedup_prefix=dedup, micro_batch_tokens=mbt, **extra), seed=0)
        m = learner.update(groups)
        assert m["micro_batches"] == (1 if mbt > 10 else len(groups)) and m["grad_norm"] > 0
        grads.append({n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None})
        metrics.append(m)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for key in ("loss/policy", "grad_norm", "entropy"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-6), key
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-4)
