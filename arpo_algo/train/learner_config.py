"""LearnerConfig: the learner's settings, validated (see :mod:`arpo_algo.train.learner` for what they do)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from arpo_algo.core.advantages import ADVANTAGES
from arpo_algo.core.losses import POLICY_LOSSES
from arpo_algo.train.device_setup import PRECISIONS, TREE_ATTENTIONS
from arpo_algo.train.optim import SCHEDULES, check_schedule
from arpo_base.errors import ConfigError
from arpo_base.options import check_choice, dataclass_from_dict, setting

#: Default (warn, stop) levels of ``learner/kl_rollout`` by the learner's precision, for a bfloat16 sampler against a
#: float32 learner (``"bf16_sampler"``: bf16 rounding alone gives about 3e-4 there; see LearnerConfig), and for a
#: bf16-autocast learner on a CPU against a float32 sampler (``"bf16_cpu"``, the quickstart on a CPU with bf16 in
#: hardware: SmolLM2-135M's clean RL iterations measured at most 1.8e-4 token mean, 7.3e-4 tail fraction and 2.1e-3
#: worst trajectory, under these warn levels, while the planted 1%-token fault's tail fraction (0.01) crosses its stop
#: level; docs/results/mismatch-alarm.md).
MISMATCH_LEVELS = {"fp32": (1e-4, 1e-2), "bf16_sampler": (1e-3, 1e-2), "bf16": (1e-2, 1e-1), "bf16_cpu": (1e-3, 1e-2)}
#: Default (warn, stop) levels of the alarm's tail statistics, which a local fault does not dilute: the fraction of
#: sampled tokens whose log-probs differ by more than ``tail_logprob_diff`` (``learner/logprob_tail_frac``) and the
#: worst trajectory's k3 KL (``learner/kl_rollout_traj_max``). In fp32 a correct engine gives no such token and a
#: trajectory KL at rounding level (about 1e-14 on the tests' tiny model); the bf16 levels are not measured on
#: models larger than the tests'.
TAIL_LEVELS = {
    "fp32": {"frac": (1e-3, 5e-3), "traj": (1e-4, 1e-3)},
    "bf16_sampler": {"frac": (5e-3, 2e-2), "traj": (1e-2, 1e-1)},
    "bf16": {"frac": (5e-3, 2e-2), "traj": (1e-2, 1e-1)},
    "bf16_cpu": {"frac": (1e-3, 5e-3), "traj": (5e-3, 5e-2)},
}
#: kl_rollout counts as growing when each of the last GROWTH_WINDOW updates is above the one before and the last is
#: more than GROWTH_FACTOR times the first of the window.
GROWTH_WINDOW, GROWTH_FACTOR = 3, 3.0
#: Every stop level of the alarm off (warnings stay): for measuring what the alarm would see, and for learners fed
#: hand-built log-probs that are not the model's.
ALARM_OFF: dict[str, float] = {"kl_rollout_stop": math.inf, "tail_frac_stop": math.inf, "traj_kl_stop": math.inf}


@dataclass(frozen=True)
class LearnerConfig:
    """Learner settings (defaults = the ARPO reference scripts where they exist, see
    docs/concepts/reference-choices.md#reference-training-recipe).

    Attributes:
        lr: AdamW learning rate (reference 1e-6).
        weight_decay: AdamW weight decay (reference 0.01).
        lr_schedule: Learning-rate schedule (:mod:`arpo_algo.train.optim`); a decaying one needs ``total_steps``.
        warmup_steps: Steps of linear warm-up before the schedule (:mod:`arpo_algo.train.optim`).
        total_steps: Optimizer steps the schedule spans, when set; it wins over ``schedule_iterations``.
        schedule_iterations: Iterations a decaying schedule spans when ``total_steps`` is not set: it then ends after
            ``schedule_iterations x ppo_epochs x mini_batches`` optimizer steps, the steps of that many updates
            (``arpo train`` and ``arpo tune`` set it to the experiment's iterations, so a trial that changes
            ``ppo_epochs`` or ``mini_batches`` keeps a schedule that ends at its own last step). None = not known.
        grad_clip: Gradient-norm clip (reference 1.0).
        clip_low: Lower PPO clip epsilon: the ratio is clipped at 1 - clip_low.
        clip_high: Upper PPO clip epsilon: the ratio is clipped at 1 + clip_high (above clip_low: DAPO clip-higher).
        clip_c: Dual-clip constant bounding the loss of negative-advantage tokens (reference 3.0).
        loss_agg: How per-token losses are aggregated: "token_mean" (an exact global token mean over the update),
            "seq_mean" (per-trajectory token mean, then the mean over trajectories) or "dr_grpo" (token sum over a
            constant).
        dr_grpo_tokens: The constant per-trajectory token count "dr_grpo" aggregation divides by (0 = the longest
            response of the update).
        advantage: A registered advantage estimator (:data:`arpo_algo.core.advantages.ADVANTAGES`: "grpo" = soft
            attribution, "hard", "turn" = each turn credited with the change of its tree node's Monte Carlo value,
            docs/concepts/arpo.md#turn-credit).
        policy_loss: A registered policy loss (:data:`arpo_algo.core.losses.POLICY_LOSSES`: "dual_clip").
        hard_scope: Which tokens the tree-aware estimators ("hard", "turn") count as shared: "tree" (default: tokens
            shared by branching only) or "tokens" (any identical prefix in the group, the former behaviour).
        norm_adv_by_std: Divide group-relative advantages by the group's standard deviation (reference True).
        entropy_advantage: AEPO's entropy-aware advantage (the "entropy_aware" shaping, per-group z-score of the
            current policy's token entropy; docs/concepts/aepo.md#entropy-aware-advantage).
        entropy_advantage_coef: Weight of the entropy z-score in the entropy-aware advantage (reference 0.2).
        entropy_advantage_clip: Minimum multiplier of the entropy-aware advantage, or None (no clip).
        entropy_balanced_clip: AEPO's stop-gradient clipping (docs/concepts/aepo.md#entropy-balanced-clipping).
        kl_coef: k3 KL to a frozen copy of the initial model (loaded only when > 0).
        entropy_coef: Weight of the entropy bonus (reference 0).
        ppo_epochs: Passes over each batch of trajectories per iteration (reference 1).
        mini_batches: Optimizer steps per epoch, each on a shuffled part of the iteration's groups, with the old
            log-probs fixed for the whole update (1 = one step per epoch: the former update; more lets clipping act).
            A part without reward signal takes no step; an iteration with fewer groups makes one part per group.
            None (AEPO's default, ``[training]`` only): ``min(8, prompts_per_step)``, derived from the prompts per
            step of the run itself, so a sweep over prompts_per_step keeps it valid.
        micro_batch_tokens: Tokens per learner micro-batch (packed forward and backward).
        dedup_prefix: Run each shared prefix of a tree once in the forward pass (a tree attention mask) instead of
            once per trajectory.
        old_logprobs: "recompute" (as the reference) or "rollout" (use the sampler's logprobs).
        precision: Device setting (:mod:`arpo_algo.train.device_setup`, docs/howto/learner-backends.md): "auto"
            (bf16 autocast on a CUDA GPU with native bfloat16, fp32 elsewhere), "fp32", "bf16" or "native" (bf16
            wherever the CPU or GPU multiplies bf16 matrices in hardware, fp32 elsewhere); weights and optimizer
            state stay fp32 in every case, and "bf16" on a GPU without bfloat16 is an error.
        tree_attention: How the packed tree of ``dedup_prefix`` is attended: "dense" (an [N, N] mask handed to
            SDPA/eager), "flex" (FlexAttention with a block mask built from the tree; CUDA only, needs
            ``attn_implementation="sdpa"``) or "auto" (flex on CUDA with sdpa unless ``deterministic``, dense
            otherwise).
        gradient_checkpointing: Recompute activations in the backward pass (less memory, about one more forward).
        head_chunk_tokens: Run the LM head, log-softmax and entropy over at most this many predicted tokens at a
            time, each chunk recomputed in the backward pass, so the [tokens, vocabulary] tensors exist one chunk at
            a time (same update up to float rounding, one more head forward; default: all at once; not with the
            deepspeed backend).
        deterministic: Deterministic kernels in this process (``torch.use_deterministic_algorithms``, cuBLAS
            workspace, cuDNN flags): slower on GPU; CPU kernels are deterministic without it at a fixed thread count.
        max_nan_updates: The run stops after this many consecutive updates with a non-finite loss or gradient norm
            (each of them is skipped).
        attn_implementation: "sdpa" or "eager" (the tree mask of ``dedup_prefix`` needs one of them).
        kl_rollout_warn: Mismatch alarm: warn when the k3 KL(sampler || learner) on the sampled tokens, measured
            before the first step, exceeds this (None = by precision: 1e-4 in fp32 and 1e-3 for a bf16 rollout
            engine against an fp32 learner, both measured; 1e-2 for a bf16 learner, 1e-3 for a bf16 learner on a
            CPU against an fp32 engine, measured).
        kl_rollout_stop: Mismatch alarm: stop the run above this (None = by precision: 1e-2 in fp32, also with a
            bf16 rollout engine or a bf16 learner on a CPU, measured; 1e-1 for a bf16 learner).
        tail_logprob_diff: Mismatch alarm's tail: a sampled token whose sampler and learner log-probs differ by
            more than this (nats) counts in ``logprob_tail_frac``.
        tail_frac_warn: Warn when the fraction of such tokens exceeds this (None = by precision: 1e-3 in fp32 and
            for a bf16 learner on a CPU against an fp32 engine, 5e-3 with bf16 on either side otherwise).
        tail_frac_stop: Stop above this fraction (None = by precision: 5e-3 in fp32 and for a bf16 learner on a
            CPU, 2e-2 with bf16 otherwise).
        traj_kl_warn: Warn when the worst trajectory's k3 KL (sampler || learner, its sampled tokens' mean) exceeds
            this (None = by precision: 1e-4 in fp32, 5e-3 for a bf16 learner on a CPU, 1e-2 with bf16 otherwise).
        traj_kl_stop: Stop above this (None = by precision: 1e-3 in fp32, 5e-2 for a bf16 learner on a CPU,
            1e-1 with bf16 otherwise). The GPU bf16 tail levels are not measured on larger models.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    schedule_iterations: int | None = None
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    loss_agg: str = "token_mean"
    dr_grpo_tokens: int = 0
    advantage: str = "grpo"
    policy_loss: str = "dual_clip"
    hard_scope: str = "tree"
    norm_adv_by_std: bool = True
    entropy_advantage: bool = False
    entropy_advantage_coef: float = 0.2
    entropy_advantage_clip: float | None = None
    entropy_balanced_clip: bool = False
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batches: int | None = 1
    micro_batch_tokens: int = 8192
    dedup_prefix: bool = True
    old_logprobs: str = "recompute"
    precision: str = "auto"
    tree_attention: str = "auto"
    gradient_checkpointing: bool = False
    head_chunk_tokens: int | None = None
    deterministic: bool = False
    max_nan_updates: int = 3
    attn_implementation: str = "sdpa"
    kl_rollout_warn: float | None = None
    kl_rollout_stop: float | None = None
    tail_logprob_diff: float = 0.5
    tail_frac_warn: float | None = None
    tail_frac_stop: float | None = None
    traj_kl_warn: float | None = None
    traj_kl_stop: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LearnerConfig:
        """Build from a dict; unknown keys (with the closest valid name) and wrong types raise ConfigError."""
        cfg = dataclass_from_dict(cls, d, "training")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid setting."""
        choices = {
            "lr_schedule": SCHEDULES,
            "loss_agg": ("token_mean", "seq_mean", "dr_grpo"),
            "hard_scope": ("tree", "tokens"),
            "old_logprobs": ("recompute", "rollout"),
            "attn_implementation": ("sdpa", "eager"),
            "precision": PRECISIONS,
            "tree_attention": TREE_ATTENTIONS,
        }
        for key, allowed in choices.items():
            check_choice(key, getattr(self, key), allowed, "training")
        ADVANTAGES.check(self.advantage, "training")
        POLICY_LOSSES.check(self.policy_loss, "training")
        positive = {
            "lr": self.lr,
            "ppo_epochs": self.ppo_epochs,
            "mini_batches": self.mini_batch_count,
            "micro_batch_tokens": self.micro_batch_tokens,
            "max_nan_updates": self.max_nan_updates,
        }
        if self.head_chunk_tokens is not None:
            positive["head_chunk_tokens"] = self.head_chunk_tokens
        for key, val in positive.items():
            if val is None or not val > 0:
                raise ConfigError(f"training.{key} must be > 0, got {val!r}")
        for key in (
            "weight_decay",
            "warmup_steps",
            "grad_clip",
            "clip_low",
            "clip_high",
            "kl_coef",
            "entropy_coef",
            "dr_grpo_tokens",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"training.{key} must be >= 0, got {getattr(self, key)!r}")
        for key in (
            "kl_rollout_warn",
            "kl_rollout_stop",
            "tail_frac_warn",
            "tail_frac_stop",
            "traj_kl_warn",
            "traj_kl_stop",
        ):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ConfigError(f"training.{key} must be > 0 (or None: by precision), got {getattr(self, key)!r}")
        for w, s in (
            ("kl_rollout_warn", "kl_rollout_stop"),
            ("tail_frac_warn", "tail_frac_stop"),
            ("traj_kl_warn", "traj_kl_stop"),
        ):
            if None not in (getattr(self, w), getattr(self, s)) and getattr(self, w) > getattr(self, s):
                raise ConfigError(
                    f"training.{w}={getattr(self, w)} is above {s}={getattr(self, s)}",
                    hint="the warning level must not exceed the stop level",
                )
        if not self.tail_logprob_diff > 0:
            raise ConfigError(f"training.tail_logprob_diff must be > 0 (nats), got {self.tail_logprob_diff!r}")
        if self.schedule_iterations is not None and self.schedule_iterations < 1:
            raise ConfigError(f"training.schedule_iterations must be >= 1 or None, got {self.schedule_iterations}")
        check_schedule(self.lr_schedule, self.warmup_steps, self.schedule_steps, "training")
        if self.clip_low >= 1:
            raise ConfigError(f"training.clip_low must be < 1, got {self.clip_low}")
        if self.clip_c <= 1:
            raise ConfigError(f"training.clip_c must be > 1 (dual clip), got {self.clip_c}")
        if self.tree_attention == "flex" and self.attn_implementation != "sdpa":
            raise ConfigError(
                f"training.tree_attention='flex' with attn_implementation={self.attn_implementation!r}: "
                "the flex model runs every other attention call (padded batches, decoding) through "
                "SDPA",
                hint="set attn_implementation='sdpa', or tree_attention='dense'",
            )
        if ADVANTAGES.meta.get(self.advantage, {}).get("merge_shared") and self.loss_agg == "seq_mean":
            raise ConfigError(
                f"training.loss_agg='seq_mean' is undefined with advantage={self.advantage!r}",
                hint="a shared token counted once belongs to no single sequence; use 'token_mean'",
            )

    def mismatch_levels(self, precision: str) -> tuple[float, float]:
        """The (warn, stop) levels of the mismatch alarm for a learner running in ``precision`` ("fp32"/"bf16", or
        "bf16_sampler"): the levels set here, else that precision's defaults (a default warning level never above
        the stop level)."""
        warn, stop = MISMATCH_LEVELS[precision]
        stop = self.kl_rollout_stop if self.kl_rollout_stop is not None else stop
        warn = self.kl_rollout_warn if self.kl_rollout_warn is not None else min(warn, stop)
        return warn, stop

    def tail_levels(self, precision: str) -> dict[str, tuple[float, float]]:
        """The (warn, stop) levels of the tail statistics ("frac", "traj") for ``precision``, as
        :meth:`mismatch_levels`."""
        out = {}
        for name, (w_key, s_key) in {
            "frac": ("tail_frac_warn", "tail_frac_stop"),
            "traj": ("traj_kl_warn", "traj_kl_stop"),
        }.items():
            warn, stop = TAIL_LEVELS[precision][name]
            stop = getattr(self, s_key) if getattr(self, s_key) is not None else stop
            warn = getattr(self, w_key) if getattr(self, w_key) is not None else min(warn, stop)
            out[name] = (warn, stop)
        return out

    def for_sampler(self, dtype: str, device: str) -> LearnerConfig:
        """This config with the mismatch alarm's levels for a sampler computing in ``dtype`` where they are not set:
        a bfloat16 sampler's log-probs differ from a float32 learner's (on ``device``) by bf16 rounding, so the
        ``"bf16_sampler"`` levels apply; a bf16-autocast learner on a CPU scoring a float32 sampler's tokens gets
        the measured ``"bf16_cpu"`` levels; other pairs leave the levels to the learner's precision."""
        import torch

        from arpo_algo.train.device_setup import resolve_precision

        learner = resolve_precision(self.precision, torch.device(device))
        if dtype == "bfloat16" and learner != "bf16":
            key = "bf16_sampler"
        elif dtype != "bfloat16" and learner == "bf16" and torch.device(device).type == "cpu":
            key = "bf16_cpu"
        else:
            return self
        warn, stop = self.mismatch_levels(key)
        tail = self.tail_levels(key)
        return replace(
            self,
            kl_rollout_warn=warn,
            kl_rollout_stop=stop,
            tail_frac_warn=tail["frac"][0],
            tail_frac_stop=tail["frac"][1],
            traj_kl_warn=tail["traj"][0],
            traj_kl_stop=tail["traj"][1],
        )

    @property
    def schedule_steps(self) -> int | None:
        """The optimizer steps the learning-rate schedule spans: ``total_steps``, else ``schedule_iterations`` updates
        of ``ppo_epochs x mini_batches`` steps each (the learner ticks the schedule once per step), else None."""
        if self.total_steps is not None:
            return self.total_steps
        if self.schedule_iterations is None:
            return None
        return self.schedule_iterations * self.ppo_epochs * self.mini_batch_count

    @property
    def mini_batch_count(self) -> int | None:
        """Optimizer steps per epoch: ``mini_batches`` as set (None is only meaningful with prompts per step, see
        :class:`TrainingConfig`, and is refused by :meth:`validate` here)."""
        return self.mini_batches

    @property
    def merge_shared(self) -> bool:
        """The learner merges identical prefixes of a group into one trained copy: an estimator that counts a shared
        token once (e.g. "hard") with ``hard_scope="tokens"``; with "tree" the 1/d weights do it per copy."""
        return bool(ADVANTAGES.meta.get(self.advantage, {}).get("merge_shared", False)) and self.hard_scope == "tokens"


@dataclass(frozen=True)
class TrainingConfig(LearnerConfig):
    """``[training]``: the learner's settings (every :class:`LearnerConfig` field) plus how many prompts one
    iteration samples. The learner receives this object as it is and reads its own fields."""

    prompts_per_step: int = setting(
        4, "Prompts per training iteration; each yields one group of tree.budget trajectories (reference: 128)."
    )
    dynamic_sampling: bool = setting(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the "
        "batch is full. Off: the paper's and the reference's behaviour.",
    )
    dynamic_sampling_max_rounds: int = setting(3, "Cap of sampling rounds per iteration with dynamic_sampling.")
    records: str | None = setting(
        None,
        "Train on the episodes `arpo serve --record` wrote to this folder instead of sampling: each iteration "
        "takes up to prompts_per_step task groups of rewarded episodes (docs/howto/record.md).",
    )
    records_wait_s: float = setting(
        0.0, "How long an iteration waits for a trainable group of recorded episodes before the run stops."
    )

    @property
    def mini_batch_count(self) -> int:
        """Optimizer steps per epoch, with the unset value (None) derived from this run's prompts per step."""
        return self.mini_batches if self.mini_batches is not None else min(8, self.prompts_per_step)

    def validate(self) -> None:
        super().validate()
        if self.prompts_per_step < 1:
            raise ConfigError(f"training.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.mini_batch_count > self.prompts_per_step:
            raise ConfigError(
                f"training.mini_batches={self.mini_batches} is more than prompts_per_step={self.prompts_per_step}",
                hint="each mini-batch needs at least one group (one prompt): set "
                f"training.mini_batches <= {self.prompts_per_step}, or leave it unset under AEPO "
                "(its default is min(8, prompts_per_step))",
            )
        if self.dynamic_sampling_max_rounds < 1:
            raise ConfigError(
                f"training.dynamic_sampling_max_rounds must be >= 1, got {self.dynamic_sampling_max_rounds}"
            )
        if self.records_wait_s < 0:
            raise ConfigError(f"training.records_wait_s must be >= 0, got {self.records_wait_s:g}")
        if self.records is not None:
            self._check_records()

    def _check_records(self) -> None:
        """Recorded episodes train with GRPO over each task group, against the log-probs the server recorded."""
        wrong = {
            "advantage": (self.advantage, "grpo", "recorded episodes have no sampling tree"),
            "old_logprobs": (self.old_logprobs, "rollout", "the recorded log-probs are the behaviour policy's"),
            "dynamic_sampling": (self.dynamic_sampling, False, "recorded episodes are not sampled"),
        }
        for name, (value, needed, why) in wrong.items():
            if value != needed:
                raise ConfigError(
                    f"training.records needs training.{name} = {json.dumps(needed)}, got {json.dumps(value)} ({why})",
                    hint=f"set training.{name} = {json.dumps(needed)}, or drop training.records",
                )
