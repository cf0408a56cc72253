"""Learner: real updates on the tiny Llama with hand-built trees (no sampler)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_algo.core.advantages import grpo_advantages
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_base.errors import ArpoError, ConfigError
from tests.arpo_algo.train.test_tree_forward import make_groups

# Hand-built behaviour log-probs are not the model's: the rollout/learner mismatch alarm would (rightly) stop.
BASE = LearnerConfig(lr=1e-3, grad_clip=0.0, micro_batch_tokens=100_000, **ALARM_OFF)


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_update_changes_params_and_masked_tokens_get_no_gradient(tiny_model_dir, groups):
    learner = Learner(tiny_model_dir, replace(BASE, dedup_prefix=False), seed=0)
    captured = []

    def hook(module, inputs, out):
        if out.requires_grad:  # skip the no-grad pass that recomputes the old log-probs
            out.retain_grad()
            captured.append(out)

    learner.model.lm_head.register_forward_hook(hook)
    before = _params(learner)
    metrics = learner.update(groups[:1])
    assert any(not torch.equal(before[n], p) for n, p in learner.model.named_parameters())
    assert metrics["skipped_nan"] == 0 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    (logits,) = captured
    assert logits.grad is not None
    row_norm = logits.grad.abs().sum(-1)  # [B, K]; all prompts equal, so row t predicts response token t
    g = groups[0]
    for b, traj in enumerate(g.trajectories):
        for t, m in enumerate(traj.trained_mask):
            assert (float(row_norm[b, t]) > 0) == bool(m), (b, t, m)


def test_policy_loss_equals_hand_computation(tiny_model_dir, groups):
    """Ratios from the model's own log-probs, old log-probs and advantages by hand, dual clip in plain Python."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = groups[0]
    deltas = [-0.5, -0.1, 0.0, 0.1, 0.4, 1.5]  # old = lp + delta: ratios e^-delta spanning every clip region
    trajs, hand_terms = [], []
    adv = grpo_advantages(g.rewards)
    for j, traj in enumerate(g.trajectories):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([g.prompt_ids + traj.response_ids])).logits[0], -1)
        p = len(g.prompt_ids)
        old = []
        for t, m in enumerate(traj.trained_mask):
            lp = float(logp[p + t - 1, traj.response_ids[t]])
            o = lp + deltas[t % len(deltas)] if m else 0.0
            old.append(o)
            if m:
                r = math.exp(lp - o)
                a = adv[j]
                loss = max(-a * r, -a * min(max(r, 0.8), 1.2))
                if a < 0:
                    loss = min(loss, -a * 3.0)
                hand_terms.append(loss)
        trajs.append(replace(traj, old_logprobs=old))
    hand = sum(hand_terms) / len(hand_terms)
    group = replace(g, trajectories=trajs)
    for dedup in (False, True):
        learner = Learner(tiny_model_dir, replace(BASE, old_logprobs="rollout", dedup_prefix=dedup))
        m = learner.update([group])
        assert m["loss/policy"] == pytest.approx(hand, abs=1e-5)
        assert 0 < m["clip_frac"] < 1


CASES = [
    dict(),
    dict(advantage="hard"),
    dict(loss_agg="seq_mean"),
    dict(old_logprobs="rollout", entropy_balanced_clip=True, entropy_advantage=True, entropy_advantage_clip=0.0),
    dict(advantage="hard", old_logprobs="rollout", entropy_advantage=True, kl_coef=0.1, entropy_coef=0.01),
    dict(advantage="turn"),
    dict(advantage="turn", hard_scope="tokens", old_logprobs="rollout", entropy_advantage=True),
]


@pytest.mark.parametrize("extra", CASES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_dedup_gradients_equal_duplicated(tiny_model_dir, groups, extra):
    # Duplicated in one micro-batch vs deduplicated with one micro-batch per group (10 tokens < any group), so
    # the global-token-mean accumulation is checked at the same time.
    results = []
    for dedup, mbt in ((False, 100_000), (True, 10)):
        learner = Learner(tiny_model_dir, replace(BASE, dedup_prefix=dedup, micro_batch_tokens=mbt, **extra))
        m = learner.update(groups)
        results.append((m, _grads(learner)))
    (m_dup, g_dup), (m_ded, g_ded) = results
    assert m_ded["unique_tokens"] < m_dup["unique_tokens"] == m_dup["tokens"]
    assert m_ded["micro_batches"] == 2 and m_dup["micro_batches"] == 1
    for key in ("loss/policy", "loss/kl", "entropy", "clip_frac"):
        assert m_ded[key] == pytest.approx(m_dup[key], abs=1e-5)
    for name, g in g_dup.items():
        torch.testing.assert_close(g_ded[name], g, atol=1e-5, rtol=1e-4)


def test_nan_loss_skips_then_raises(tiny_model_dir, groups):
    learner = Learner(tiny_model_dir, replace(BASE, max_nan_updates=2))
    bad = replace(groups[0], trajectories=[replace(t, reward=float("nan")) for t in groups[0].trajectories])
    before = _params(learner)
    m = learner.update([bad])
    assert m["skipped_nan"] == 1 and learner.step == 0
    assert all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())
    assert learner.update(groups)["skipped_nan"] == 0  # a good update resets the streak
    learner.update([bad])
    with pytest.raises(ArpoError, match="2 consecutive updates"):
        learner.update([bad])


def test_state_round_trip_is_bit_equal(tiny_model_dir, groups, tmp_path):
    cfg = replace(BASE, lr_schedule="cosine", warmup_steps=1, total_steps=5, grad_clip=1.0, ppo_epochs=2)
    a = Learner(tiny_model_dir, cfg, seed=3)
    a.update(groups[:1])
    folder = a.save_pretrained(tmp_path / "ckpt")
    torch.save(a.get_state(), tmp_path / "state.pt")
    b = Learner(folder, cfg, seed=99)
    b.set_state(torch.load(tmp_path / "state.pt", weights_only=False))
    ma, mb = a.update(groups), b.update(groups)
    assert ma == mb
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), n
    state = a.get_state()
    torch.rand(3)  # advance the RNG, then restoring must bring it back
    b.set_state(state)
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])


def test_save_pretrained_is_a_plain_hf_folder(tiny_model_dir, tmp_path):
    learner = Learner(tiny_model_dir, BASE)
    out = learner.save_pretrained(tmp_path / "out")
    assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    for (n, p), q in zip(learner.model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


def test_bf16_and_gradient_checkpointing(tiny_model_dir, groups):
    ref = Learner(tiny_model_dir, BASE)
    ref.update(groups)
    ckpt = Learner(tiny_model_dir, replace(BASE, gradient_checkpointing=True))
    ckpt.update(groups)
    # checkpointing recomputes the same activations in the same shapes: bit for bit the same gradients
    assert _grads(ckpt).keys() == _grads(ref).keys()
    for name, g in _grads(ref).items():
        assert torch.equal(_grads(ckpt)[name], g), name
    m = Learner(tiny_model_dir, replace(BASE, precision="bf16")).update(groups)
    assert m["skipped_nan"] == 0 and math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0


def test_kl_to_reference_is_zero_at_start_and_lr_schedule(tiny_model_dir, groups):
    cfg = replace(BASE, kl_coef=0.5, lr_schedule="linear", warmup_steps=2, total_steps=4)
    learner = Learner(tiny_model_dir, cfg)
    m1 = learner.update(groups)
    assert m1["loss/kl"] == pytest.approx(0.0, abs=1e-7) and m1["lr"] == pytest.approx(0.5e-3)
    m2 = learner.update(groups)
    assert m2["loss/kl"] > 0 and m2["lr"] == pytest.approx(1e-3)
    assert learner.update(groups)["lr"] == pytest.approx(1e-3)  # step 2 = start of decay: factor 1 - 0/2
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)


def test_config_validation():
    with pytest.raises(ConfigError, match="training: unknown key 'cliprange'"):
        LearnerConfig.from_dict({"cliprange": 0.2})
    with pytest.raises(ConfigError, match="training: unknown key 'clip_hihg'") as err:
        LearnerConfig.from_dict({"clip_hihg": 0.2})
    assert err.value.hint == "did you mean 'clip_high'?"
    with pytest.raises(ConfigError, match="training: ppo_epochs must be int, got 1.5"):  # types were not checked
        LearnerConfig.from_dict({"ppo_epochs": 1.5})
    with pytest.raises(ConfigError, match="seq_mean"):
        LearnerConfig(advantage="hard", loss_agg="seq_mean").validate()
    with pytest.raises(ConfigError, match="lr_schedule"):
        LearnerConfig(lr_schedule="step").validate()
    assert LearnerConfig.from_dict({"kl_coef": 0.1}).kl_coef == 0.1


def test_decaying_schedule_needs_total_steps():
    """Bug: total_steps defaulted to 1, so a cosine/linear schedule reached lr 0 after the first update, silently."""
    with pytest.raises(ConfigError, match="decays to 0 at total_steps, which is not set"):
        LearnerConfig(lr_schedule="cosine").validate()
    with pytest.raises(ConfigError, match="total_steps=2 <= warmup_steps=2"):
        LearnerConfig(lr_schedule="linear", warmup_steps=2, total_steps=2).validate()
    LearnerConfig(lr_schedule="cosine", total_steps=10).validate()
    LearnerConfig().validate()  # constant needs no total_steps


def test_learner_looks_up_estimator_and_loss_by_name(tiny_model_dir, groups):
    """A new advantage estimator or policy loss is one function and one name; the config selects it."""
    from arpo_algo.core.advantages import ADVANTAGES, TokenAdvantages, register_advantage
    from arpo_algo.core.losses import POLICY_LOSSES, dual_clip, register_policy_loss

    calls = []

    @register_advantage("test_ones")
    def ones(prompt_ids, responses, trained_masks, rewards, *, norm_by_std=True):
        return TokenAdvantages([[1.0] * len(r) for r in responses], [[1.0] * len(r) for r in responses])

    @register_policy_loss("test_spy")
    def spy(logp, old_logp, adv, settings):
        calls.append(settings.clip_c)
        return dual_clip(logp, old_logp, adv, settings)

    try:
        learner = Learner(tiny_model_dir, replace(BASE, advantage="test_ones", policy_loss="test_spy", lr=1e-9))
        m = learner.update(groups)
        # ratio 1 (recomputed old log-probs), advantage 1 everywhere: the token-mean policy loss is exactly -1
        assert m["loss/policy"] == pytest.approx(-1.0, abs=1e-5) and calls == [3.0] * int(m["micro_batches"])
    finally:
        ADVANTAGES.pop("test_ones")
        POLICY_LOSSES.pop("test_spy")
    with pytest.raises(ConfigError, match="advantage='test_ones' is not a registered advantage estimator"):
        replace(BASE, advantage="test_ones").validate()


def test_update_without_signal_is_skipped_and_changes_nothing(tiny_model_dir, groups):
    """Equal rewards in every group: no optimizer or scheduler step, the weights stay bit-equal. A step there would
    not be harmless: AdamW's moments would replay the previous update and weight decay would shrink the weights."""
    learner = Learner(tiny_model_dir, replace(BASE, weight_decay=0.01, lr_schedule="linear", total_steps=10), seed=0)
    learner.update(groups)
    assert learner.step == 1
    flat = [replace(g, trajectories=[replace(t, reward=0.5) for t in g.trajectories]) for g in groups]
    before, lr = _params(learner), learner.optimizer.param_groups[0]["lr"]
    m2 = learner.update(flat)
    assert all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())
    assert learner.step == 1 and learner.optimizer.param_groups[0]["lr"] == lr  # the schedule did not tick
    assert m2.get("skipped_no_signal") == 1 and m2["traj_with_grad_frac"] == 0 and m2["param_change_norm"] == 0
    m3 = learner.update(groups)  # signal again: a real step, and its change norm is the measured one
    after = _params(learner)
    delta = math.sqrt(sum(float((after[n] - before[n]).pow(2).sum()) for n in before))
    assert learner.step == 2 and m3["skipped_no_signal"] == 0 and 0 < m3["traj_with_grad_frac"] <= 1
    assert m3["param_change_norm"] == pytest.approx(delta, rel=1e-4)


def test_advantages_are_normalised_per_group_not_over_the_batch(tiny_model_dir, groups):
    """Group 1's rewards are all equal (1.0 in one batch, 0.0 in the other); group 0 has a spread. Per-group GRPO
    gives group 1 zero advantages in both, so both updates are identical; normalising over the batch would move the
    batch mean with group 1's level and give every trajectory a non-zero advantage."""
    g0 = groups[0]
    out = []
    for level in (1.0, 0.0):
        g1 = replace(groups[1], trajectories=[replace(t, reward=level) for t in groups[1].trajectories])
        learner = Learner(tiny_model_dir, BASE, seed=0)
        m = learner.update([g0, g1])
        assert m["traj_with_grad_frac"] == pytest.approx(len(g0.trajectories) / 7)
        out.append(_params(learner))
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[0])


@pytest.mark.parametrize(
    "extra",
    [{}, {"entropy_coef": 0.01, "kl_coef": 0.1}, {"dedup_prefix": False}, {"gradient_checkpointing": True}],
    ids=["default", "entropy_grad+kl", "padded", "checkpointed"],
)
def test_head_chunk_tokens_gives_the_same_update(tiny_model_dir, groups, extra):
    """Memory option: the LM head in chunks of 3 predictions (recomputed in backward) leaves the loss,
    the metrics and every gradient as they were."""
    results = []
    for chunk in (None, 3):
        learner = Learner(tiny_model_dir, replace(BASE, micro_batch_tokens=10, head_chunk_tokens=chunk, **extra))
        m = learner.update(groups)
        results.append((m, _grads(learner)))
    (m_ref, g_ref), (m_chunk, g_chunk) = results
    for key in ("loss/policy", "loss/kl", "loss/entropy_bonus", "entropy", "clip_frac", "grad_norm"):
        assert m_chunk[key] == pytest.approx(m_ref[key], abs=1e-6), key
    assert g_chunk.keys() == g_ref.keys()
    for name, g in g_ref.items():
        torch.testing.assert_close(g_chunk[name], g, atol=1e-5, rtol=1e-4)


def test_head_chunk_tokens_is_validated_and_refused_where_unsupported():
    for bad in (0, -4):
        with pytest.raises(ConfigError, match="head_chunk_tokens must be > 0"):
            LearnerConfig.from_dict({"head_chunk_tokens": bad})
    with pytest.raises(ConfigError, match="head_chunk_tokens must be int"):
        LearnerConfig.from_dict({"head_chunk_tokens": 2.5})
    from arpo_algo.train.deepspeed_learner import DeepSpeedLearner

    with pytest.raises(ConfigError, match="not supported by the deepspeed backend"):
        DeepSpeedLearner("unused", LearnerConfig(head_chunk_tokens=64))


@pytest.mark.parametrize("advantage,scope", [("grpo", "tree"), ("hard", "tree"), ("hard", "tokens"), ("turn", "tree")])
def test_learner_and_recorder_share_one_estimator_call(tiny_model_dir, groups, advantage, scope):
    """The learner trains on, and the tree recorder writes, the registered estimator's advantages with the tree's
    owners exactly where the estimator takes them (``needs_tree``) and the scope is "tree"."""
    from arpo_algo.core.advantages import ADVANTAGES, tree_token_owners
    from arpo_algo.eval.trees import token_advantages

    cfg = replace(BASE, advantage=advantage, hard_scope=scope)
    learner = Learner(tiny_model_dir, cfg)
    trained = [[s.adv for s in specs] for specs in learner._specs(groups)]
    assert [c.advantages for c in token_advantages(groups, cfg)] == trained
    for g, got in zip(groups, trained):
        ts = g.trajectories
        extra = {}
        if advantage != "grpo":
            owners = tree_token_owners(
                [t.parent for t in ts], [t.branch_point for t in ts], [len(t.response_ids) for t in ts]
            )
            extra["owners"] = owners if scope == "tree" else None
        want = ADVANTAGES[advantage](
            g.prompt_ids, [t.response_ids for t in ts], [t.trained_mask for t in ts], g.rewards, **extra
        )
        assert got == want.advantages
    if advantage == "turn":  # the tool result of group 0 starts a new turn with its own credit
        assert len({a for a, m in zip(trained[0][0], groups[0].trajectories[0].trained_mask) if m}) > 1
