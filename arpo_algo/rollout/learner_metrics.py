"""The learner's update metric names: the keys of the result of every learner backend's ``update()``.

The learner writes them (:class:`arpo_algo.train.learner.Learner`, and the DDP and DeepSpeed backends, which must
report the same names); the Algorithm logs them under ``learner/`` (:data:`PREFIX`), and the diagnostics
(:mod:`arpo_algo.rollout.diagnostics`), the run driver, sweeps and experiments read them. They are defined in the
rollout room, the lowest room that names metrics, so that the learner and every reader import the same strings.
"""

from __future__ import annotations

#: The section of a training iteration's result that holds these names (``learner/kl_rollout``).
PREFIX = "learner/"

# Terms of one optimizer step, each a sum of per-token weighted values over its micro-batches.
LOSS_POLICY = "loss/policy"
LOSS_KL = "loss/kl"
LOSS_ENTROPY_BONUS = "loss/entropy_bonus"
LOSS_TOTAL = "loss/total"
CLIP_FRAC = "clip_frac"
CLIP_FRAC_GRAD = "clip_frac_grad"
CLIP_FRAC_DUAL = "clip_frac_dual"
ENTROPY = "entropy"  # the learner's token-mean entropy (sum-normalised as the loss)
RATIO_MEAN = "ratio_mean"
#: The per-token sums above, in the order the learner accumulates them.
STEP_SUMS = (
    LOSS_POLICY,
    LOSS_KL,
    LOSS_ENTROPY_BONUS,
    LOSS_TOTAL,
    CLIP_FRAC,
    CLIP_FRAC_GRAD,
    CLIP_FRAC_DUAL,
    ENTROPY,
    RATIO_MEAN,
)

# The mismatch alarm: the sampler's log-probs against the learner's for the same tokens, before any optimizer step of
# the update (the policy version that sampled them), over the sampled trained tokens; global over data-parallel ranks.
KL_ROLLOUT = "kl_rollout"  # k3 estimate of KL(sampler || learner), token-weighted mean
LOGPROB_DIFF_MAX = "logprob_diff_max"  # the largest |sampler log-prob - learner log-prob|
LOGPROB_TAIL_FRAC = "logprob_tail_frac"  # fraction of those tokens with |difference| > training.tail_logprob_diff
KL_ROLLOUT_TRAJ_MAX = "kl_rollout_traj_max"  # the worst trajectory's k3 KL (mean over its sampled tokens)
KL_ROLLOUT_GROWING = "kl_rollout_growing"  # 1 when kl_rollout rose over the last updates (see LearnerConfig)

# The optimizer step itself.
GRAD_NORM = "grad_norm"  # before clipping
LR = "lr"
PARAM_CHANGE_NORM = "param_change_norm"  # L2 norm of the weights' change
STEP = "step"  # optimizer steps taken so far
OPTIMIZER_STEPS = "optimizer_steps"  # optimizer steps this update took (ppo_epochs x mini-batches with signal)
SKIPPED_NAN = "skipped_nan"  # 1 when a non-finite loss or gradient norm skipped the step
SKIPPED_NO_SIGNAL = "skipped_no_signal"  # 1 when the update had no signal and was skipped

# The update's data (before it runs).
TOKENS = "tokens"  # prompt + response tokens of the trajectories
TRAINED_TOKENS = "trained_tokens"
UNIQUE_TOKENS = "unique_tokens"  # tokens the forward computed (shared prefixes once when deduplicated)
MICRO_BATCHES = "micro_batches"
TRAJ_WITH_GRAD_FRAC = "traj_with_grad_frac"  # trajectories with a non-zero advantage on a trained token
ADV_MEAN = "adv_mean"  # over trained tokens
ADV_SD = "adv_sd"

# Data-parallel backends only.
LEARNER_WORKERS = "learner_workers"  # ranks of the backend
RANK_TOKEN_IMBALANCE = "rank_token_imbalance"  # the busiest rank's tokens over the mean rank's
