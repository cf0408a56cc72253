"""The learner: owns the policy model, the optimiser and schedule, and turns groups of trajectories into updates.

One :meth:`Learner.update` call = ``ppo_epochs`` x ``mini_batches`` optimizer steps over the groups passed (each epoch
visits every mini-batch, a shuffled part of the groups, once; the schedule ticks on each step). Within a step, the
groups are split into micro-batches by token count (a group is never split: the tree pack needs all of it, and the
entropy-aware z-score is per group) and gradients are accumulated.

**Loss aggregation (docs/concepts/arpo.md#loss-aggregation).** Every micro-batch's loss is divided by the normaliser of
the WHOLE update, not of the micro-batch, so the accumulated gradient is exactly the global objective whatever the
split:

* ``token_mean``: ``Σ_traj Σ_t w·ℓ / Σ_traj Σ_t w`` over all trained tokens of the update (``w`` = count weight:
  1 per trajectory copy for soft attribution; hard attribution counts a shared token once). The reference instead
  averages per micro-batch token means weighted by micro-batch size, which is not a global token mean.
* ``seq_mean``: per-trajectory token mean, then the mean over trajectories with at least one trained token.
* ``dr_grpo``: token sum / (trajectories x ``dr_grpo_tokens``, 0 = longest response); see algorithms.stabilizers.

**No signal, no step**: without a non-zero advantage (and no KL/entropy term) there is no forward, no
optimizer step, no scheduler tick: AdamW would replay its moments and decay the weights. ``param_change_norm``: L2.

**Device choices** (``precision``, ``tree_attention``, ``deterministic``) are resolved against the device once, in
``__init__``, by :mod:`arpo_algo.train.device_setup`; :meth:`Learner.autocast` is the precision context of every
forward.

**Data-parallel hooks.** :meth:`Learner._all_sum`, :meth:`~Learner._all_max`, :meth:`~Learner._backward`,
:meth:`~Learner._after_backward`, :meth:`~Learner._score`, :meth:`~Learner._before_micro_batches`,
:meth:`~Learner._clip_grads` and :meth:`~Learner._optimizer_step` are the
identity / plain torch here; the backends of :mod:`arpo_algo.train.ddp` and :mod:`arpo_algo.train.deepspeed_learner`
override them so that every normaliser and decision above is global over the ranks (see there).

Old log-probs: ``recompute`` (reference) evaluates them under ``no_grad`` with the current weights before the update;
``rollout`` takes ``Trajectory.old_logprobs`` from the sampler. Tool-result tokens (``trained_mask == 0``) are not in
any loss term, so they get no gradient; the sampler decides the mask of an appended tool-limit EOS
(docs/concepts/arpo.md#limit-eos). That EOS was never sampled: the trajectory marks its position in ``unsampled``
(its log-prob is only a placeholder), and ``rollout`` takes the learner's own log-prob for it (scored before any
step, i.e. under the policy version that sampled the rest of the trajectory). A non-finite log-prob at any sampled
position is an engine fault: the alarm stops the run, naming the count.

**Mismatch alarm**: before any step, every update compares the sampler's log-probs with the learner's for the same
sampled tokens (``kl_rollout``: k3 KL(sampler || learner); ``logprob_diff_max``), warns above ``kl_rollout_warn``
and raises above ``kl_rollout_stop`` (:class:`LearnerConfig`). Beside that token mean, which dilutes a fault on few
tokens or one trajectory, two tail statistics have their own levels: ``logprob_tail_frac`` (tokens off by more than
``tail_logprob_diff``) and ``kl_rollout_traj_max`` (the worst trajectory's KL); a ``kl_rollout`` that keeps rising
warns too. Every pre-step scoring runs in eval mode, with dropout zeroed at load, as the sampler scores.

**A stale batch** (asynchronous rollouts: sampled by an earlier policy version than the learner holds) comes with
``behaviour_weights``, the weights that sampled it. The pre-step scoring (the alarm, recomputed old log-probs and the
score of an unsampled EOS) then runs under those weights, swapped into the model and restored bitwise before any step:
the importance ratio is against the behaviour policy, and legitimate staleness does not look like a mismatch while
an engine holding other weights than the declared version still does.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arpo_algo.core.advantages import ADVANTAGE_SHAPERS, build_token_trie
from arpo_algo.core.losses import POLICY_LOSSES, k3_kl
from arpo_algo.models.dropout import rates_of
from arpo_algo.models.lora import (
    LoraSettings,
    attach_adapter,
    config_folder,
    load_policy_model,
    prepare_base,
    save_adapter,
)
from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.rollout.types import Group
from arpo_algo.train.device_setup import (
    enable_activation_checkpointing,
    make_deterministic,
    resolve_precision,
    resolve_tree_attention,
)
from arpo_algo.train.learner_config import LearnerConfig
from arpo_algo.train.mismatch import judge, local_sums, per_token
from arpo_algo.train.optim import build_optimizer
from arpo_algo.train.rng_state import rng_state, set_rng_state
from arpo_algo.train.tree_flex import FLEX_TREE_IMPL
from arpo_algo.train.tree_flex import register as register_flex
from arpo_algo.train.tree_forward import SeqSpec, TokenBatch, build_dedup_batch, build_padded_batch, forward_token_stats
from arpo_algo.train.update_stats import group_token_advantages, signal_stats
from arpo_base.errors import ArpoError

__all__ = ["Learner", "LearnerConfig", "mini_batch_parts"]
log = logging.getLogger(__name__)


def mini_batch_parts(num_groups: int, mini_batches: int, seed: int, step: int) -> list[list[int]]:
    """An update's mini-batches as group indices: ``mini_batches`` parts of the groups dealt from one shuffle (seeded
    by ``seed`` and the optimizer ``step``, so a resumed run draws the same), or one part in the groups' order.

    Invariant: every part holds at least one group. With fewer groups than ``mini_batches`` (dynamic sampling can
    keep fewer prompts than a step asks for) there is one part per group; the data-parallel backends cut these same
    parts across their ranks, so their steps are the single-process learner's steps."""
    n = min(mini_batches, num_groups)
    if n <= 1:
        return [list(range(num_groups))]
    order = list(range(num_groups))
    random.Random(f"{seed}:{step}").shuffle(order)
    return [sorted(order[k::n]) for k in range(n)]


class Learner:
    """Policy model + AdamW + schedule (+ frozen reference model when ``kl_coef > 0``).

    Args:
        model_path: A registered model name or a local Hugging Face folder.
        config: The learner settings.
        device: Torch device string.
        seed: Seeds torch, python and numpy RNGs.
        lora: Train a fresh LoRA adapter on the frozen ``model_path`` (an adapter folder there is merged first: RL
            after a LoRA SFT); None or disabled: full weights. Its target modules are resolved and checked against
            the model's config before any weight loads.
    """

    #: A data-parallel rank may get no groups in a step (it still takes part in the collectives).
    allow_empty_update = False
    #: Whether ``param_change_norm`` is measured (not where this process holds only a shard of each parameter).
    measures_param_change = True

    def __init__(
        self,
        model_path: str | Path,
        config: LearnerConfig,
        device: str = "cpu",
        seed: int = 0,
        lora: LoraSettings | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from arpo_algo.models import resolve_model_path

        config.validate()
        self.config = config
        self.device = torch.device(device)
        if config.deterministic:  # first: cuBLAS reads its workspace setting when it first runs
            make_deterministic()
        #: The resolved device choices: "fp32"/"bf16" and "dense"/"flex" (module device_setup).
        self.precision = resolve_precision(config.precision, self.device)
        self.tree_attention = resolve_tree_attention(
            config.tree_attention,
            self.device,
            attn_implementation=config.attn_implementation,
            deterministic=config.deterministic,
        )
        self.seed = seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        path = resolve_model_path(model_path)
        self.lora = lora if lora is not None and lora.enabled else None
        #: The frozen base a LoRA learner trains on, and the fingerprint every adapter it writes or reads carries.
        self.base_path, self.base_fingerprint, targets = Path(path).resolve(), None, ()
        if self.lora is not None:  # targets from the config and the base checked: before any weight loads
            targets, self.base_fingerprint = prepare_base(self.lora, path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        impl = config.attn_implementation
        if self.tree_attention == "flex":
            register_flex()
            impl = FLEX_TREE_IMPL
        # fp32 master weights (and so fp32 gradients and AdamW state) whatever the compute precision. Dropout off:
        # the sampler scores without it, so the ratio and the alarm must too (arpo_algo.models.dropout).
        load = {"dtype": torch.float32, "attn_implementation": impl}
        self.model = load_policy_model(path, merge=True, no_dropout=True, **load).to(self.device)
        if self.lora is not None:
            attach_adapter(self.model, self.lora, targets, str(path))
        #: The modules the adapter is on (empty: full weights), for engines that build their own copy of it.
        self.lora_targets = tuple(targets)
        if config.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
            self.model.config.use_cache = False
        self.ref_model = None
        if config.kl_coef > 0:
            self.ref_model = load_policy_model(path, merge=True, no_dropout=True, **load).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        self.optimizer, self.scheduler = build_optimizer(
            self.model,
            lr=config.lr,
            weight_decay=config.weight_decay,
            schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.schedule_steps,
        )
        self.step = 0
        self.nan_streak = 0
        self.skipped_total = 0
        self._kl_history: list[float] = []  # kl_rollout of the last updates (the alarm's growth warning)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]

    # ------------------------------------------------------------------ batch preparation
    def _specs(self, groups: list[Group]) -> list[list[SeqSpec]]:
        """Per group, the trajectories with their per-token advantages and count weights."""
        cfg, out, seq = self.config, [], 0
        for gi, g in enumerate(groups):
            if not g.trajectories:
                raise ArpoError(f"group {gi} (prompt {g.prompt_index}) has no trajectories")
            responses = [t.response_ids for t in g.trajectories]
            for ids in [g.prompt_ids, *responses]:
                if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                    raise ArpoError(
                        f"group {gi}: token id outside the model's vocabulary (size {self.vocab_size})",
                        hint="the rollout used a different tokenizer than the learner's model",
                    )
            tok = group_token_advantages(g, cfg)
            specs = []
            for j, t in enumerate(g.trajectories):
                specs.append(
                    SeqSpec(
                        gi,
                        seq,
                        list(g.prompt_ids),
                        list(t.response_ids),
                        list(t.trained_mask),
                        list(tok.advantages[j]),
                        list(tok.weights[j]),
                        list(t.old_logprobs),
                        tuple(t.unsampled),
                    )
                )
                seq += 1
            out.append(specs)
        return out

    def prepare_batches(self, groups: list[Group]) -> tuple[list[TokenBatch], list[torch.Tensor]]:
        """The micro-batches :meth:`update` trains on for ``groups``, with each one's loss normaliser (benchmarks)."""
        batches = self._micro_batches(self._specs(groups))
        return batches, self._pair_norm(batches)

    def _micro_batches(self, per_group: list[list[SeqSpec]]) -> list[TokenBatch]:
        """Greedy packing of whole groups up to ``micro_batch_tokens`` (a larger group goes alone)."""
        cfg, batches, cur, cur_cost = self.config, [], [], 0

        def flush() -> None:
            if cur:
                if cfg.dedup_prefix:
                    batches.append(build_dedup_batch(cur, merge_shared=cfg.merge_shared))
                else:
                    batches.append(build_padded_batch(cur, self.pad_id))

        for specs in per_group:
            seqs = [s.prompt + s.response for s in specs]
            cost = build_token_trie(seqs).num_nodes if cfg.dedup_prefix else len(seqs) * max(map(len, seqs))
            if cur and cur_cost + cost > cfg.micro_batch_tokens:
                flush()
                cur, cur_cost = [], 0
            cur.extend(specs)
            cur_cost += cost
        flush()
        return [b.to(self.device) for b in batches]

    def autocast(self) -> Any:
        """The compute-precision context of this learner's forwards: bf16 autocast, or nothing for fp32."""
        if self.precision != "bf16":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
        with self.autocast():
            lp, _ = forward_token_stats(model, batch, with_entropy=False, head_chunk=self.config.head_chunk_tokens)
        return lp[batch.pair_node].detach()

    def _pair_norm(self, batches: list[TokenBatch]) -> list[torch.Tensor]:
        """Per pair, the factor that turns a summed per-token term into the global aggregate
        (docs/concepts/arpo.md#loss-aggregation)."""
        if self.config.loss_agg == "token_mean":
            total = self._all_sum(sum(float(b.pair_weight.sum()) for b in batches))
            return [b.pair_weight / max(total, 1e-12) for b in batches]
        if self.config.loss_agg == "dr_grpo":  # token sum / (sequences x a constant): no length normalisation
            n = self._all_sum(len({s for b in batches for s in b.pair_seq.tolist()})) * (
                self.config.dr_grpo_tokens or self._all_max(self._max_resp)
            )
            return [b.pair_weight / float(max(n, 1)) for b in batches]
        per_seq: dict[int, float] = {}
        for b in batches:
            for s, w in zip(b.pair_seq.tolist(), b.pair_weight.tolist()):
                per_seq[s] = per_seq.get(s, 0.0) + w
        n_seq = self._all_sum(len(per_seq))
        return [
            b.pair_weight
            / torch.tensor(
                [per_seq[s] * n_seq for s in b.pair_seq.tolist()], dtype=torch.float32, device=b.pair_weight.device
            )
            for b in batches
        ]

    # ------------------------------------------------------------------ the update
    def update(
        self,
        groups: list[Group],
        behaviour_weights: dict[str, torch.Tensor] | None = None,
        parts: list[list[int]] | None = None,
    ) -> dict[str, float]:
        """``ppo_epochs`` x mini-batches optimizer steps on ``groups``; returns metrics (see module docstring for the
        loss).

        ``behaviour_weights``: the state dict of the policy version that sampled ``groups`` when it is not this
        learner's current one (a stale batch); None: the current weights sampled them. ``parts``: the mini-batches
        as indices into ``groups`` (a data-parallel rank's share of the global ones, possibly empty); None: this
        learner draws them (:meth:`mini_batch_groups`).

        Raises:
            ArpoError: after ``max_nan_updates`` consecutive updates with a non-finite loss or gradient norm.
        """
        if not groups and not self.allow_empty_update:
            raise ArpoError("update() got no groups")
        cfg = self.config
        per_group = self._specs(groups)
        seqs = [s for specs in per_group for s in specs]
        signal, base = signal_stats(seqs)
        signal = self._all_sum(float(signal)) > 0  # every data-parallel rank skips together
        parts = self.mini_batch_groups(len(groups)) if parts is None else parts
        mbs = [self._micro_batches([per_group[i] for i in part]) for part in parts]
        batches = [b for mb in mbs for b in mb]
        # The policy version that sampled the batch (no optimizer step of this update has run yet), checked on every
        # update, one without signal too: stale weights show before anything is trained on them. These are also
        # the recomputed old log-probs, fixed for every mini-batch and epoch of the update. Eval mode, as the sampler
        # scores (and dropout is zeroed at load, so the training forward computes the same function).
        self.model.eval()
        with self._weights_of(behaviour_weights):
            current = self._score(self.model, batches)
        # what the tree recorder may read of this update (the same pre-step log-probs): kept as tensors, laid out per
        # token only when read (scored_logprobs), so an update the recorder skips pays nothing for it
        self._scored = (
            [(b.pair_seq, b.pair_pos, cur) for b, cur in zip(batches, current) if b.pair_pos is not None],
            [len(s.response) for s in seqs],
        )
        mismatch = self._rollout_mismatch(batches, current)
        no_loss_without_signal = cfg.kl_coef == 0 and cfg.entropy_coef == 0
        if not signal and no_loss_without_signal:
            return {
                **base,
                **mismatch,
                LK.SKIPPED_NO_SIGNAL: 1.0,
                LK.SKIPPED_NAN: 0.0,
                LK.GRAD_NORM: 0.0,
                LK.PARAM_CHANGE_NORM: 0.0,
                LK.LR: self.optimizer.param_groups[0]["lr"],
                LK.STEP: float(self.step),
                LK.OPTIMIZER_STEPS: 0.0,
            }
        self._max_resp = max((len(s.response) for s in seqs), default=0)
        norms = [self._pair_norm(mb) for mb in mbs]  # each step's loss is its own mini-batch's aggregate
        # A mini-batch without signal takes no step (AdamW would replay its moments), on every rank alike.
        steps_with_signal = [
            not no_loss_without_signal
            or self._all_sum(float(signal_stats([s for i in part for s in per_group[i]])[0])) > 0
            for part in parts
        ]
        self.model.train()
        try:
            if cfg.old_logprobs == "recompute":
                old = current
            else:  # a token the sampler did not sample (the tool-limit EOS) is scored by the same policy here
                old = [torch.where(b.pair_sampled, b.pair_old_logp, c) for b, c in zip(batches, current)]
            ref = self._score(self.ref_model, batches) if self.ref_model is not None else None
            totals: dict[str, float] = {}
            skipped, taken = 0, 0
            for _ in range(cfg.ppo_epochs):
                first = 0
                for k, mb in enumerate(mbs):
                    sl = slice(first, first + len(mb))
                    first += len(mb)
                    if not steps_with_signal[k]:
                        continue
                    m = self._epoch(mb, norms[k], old[sl], ref[sl] if ref is not None else None, len(groups))
                    if m is None:
                        skipped = 1
                        break
                    taken += 1
                    for key, v in m.items():
                        totals[key] = totals.get(key, 0.0) + v
                if skipped:
                    break
        finally:
            self.model.eval()
        # Per-step metrics are means over the steps taken: a mini-batch without signal takes no step and must not
        # pull the reported rate, clip fraction or loss toward 0 (the same count on every data-parallel rank).
        totals = {key: v / max(taken, 1) for key, v in totals.items()}
        if skipped:
            self.nan_streak += 1
            self.skipped_total += 1
            if self.nan_streak >= cfg.max_nan_updates:
                raise ArpoError(
                    f"{self.nan_streak} consecutive updates had a non-finite (NaN/inf) loss or gradient "
                    f"norm; stopping instead of training on garbage",
                    hint="check the rewards for NaN, lower the learning rate, or set precision='fp32'",
                )
        else:
            self.nan_streak = 0
        if LK.LR not in totals:  # skipped: report the rate the step would have used
            totals[LK.LR] = self.optimizer.param_groups[0]["lr"]
        totals.update(
            {
                LK.PARAM_CHANGE_NORM: 0.0,
                **totals,
                **base,
                **mismatch,
                LK.SKIPPED_NAN: float(skipped),
                LK.UNIQUE_TOKENS: float(sum(b.num_tokens for b in batches)),
                LK.MICRO_BATCHES: float(len(batches)),
                LK.STEP: float(self.step),
                LK.OPTIMIZER_STEPS: float(taken),
            }
        )
        return totals

    @contextmanager
    def _weights_of(self, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """The model holds ``weights`` inside the block (None: its own); its own are copied back in place after it,
        bitwise, so the optimizer's parameters and state are untouched."""
        if weights is None:
            yield
            return
        own = {k: v.detach().clone() for k, v in self.trainable_state().items()}
        strict = self.lora is None  # with LoRA the frozen base is the same in every version: adapters only
        if not strict and set(weights) != set(own):
            # a partial load would score part of the batch under the current adapter and call it the old one
            raise ArpoError(
                f"behaviour weights hold {len(weights)} tensors, the adapter {len(own)}: "
                f"{sorted(set(weights) ^ set(own))[:3]} differ"
            )
        try:
            self.model.load_state_dict(weights, strict=strict)
            yield
        finally:
            self.model.load_state_dict(own, strict=strict)

    @property
    def scored_logprobs(self) -> list[list[float]] | None:
        """The last update's pre-step log-probs per sequence and response token (:func:`per_token`); None before it."""
        scored = getattr(self, "_scored", None)
        return None if scored is None else per_token(*scored)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights an update can change: the whole state dict, or with LoRA the adapter tensors only (the base
        is frozen), under the module's own key names."""
        state = self.model.state_dict()
        if self.lora is None:
            return state
        names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in names}

    def mini_batch_groups(self, num_groups: int) -> list[list[int]]:
        """The update's mini-batches as group indices (:func:`mini_batch_parts` at this learner's seed and step)."""
        return mini_batch_parts(num_groups, self.config.mini_batch_count, self.seed, self.step)

    def _rollout_mismatch(self, batches: list[TokenBatch], current: list[torch.Tensor]) -> dict[str, float]:
        """The mismatch alarm: the sampler's log-probs against ``current`` (this learner's, before any step) for the
        same sampled tokens; raises above a stop level, warns above a warning level (LearnerConfig).

        Three statistics, each with its levels: the token-mean k3 KL (``kl_rollout``), and two a local fault does
        not dilute: the fraction of tokens whose log-probs differ by more than ``tail_logprob_diff``, and the
        worst trajectory's KL. A ``kl_rollout`` that keeps rising over the last updates is warned about too.

        Invariant: with the engine holding the learner's weights and sampling the distribution the learner scores,
        the two agree up to kernel rounding; anything more means the update would be computed off-policy.
        """
        sums = local_sums(batches, current, self.config.tail_logprob_diff)
        kl = self._all_sum(sums.kl_sum) / max(self._all_sum(sums.weight), 1e-12)
        worst, count, bad = self._all_max(sums.worst), int(self._all_sum(sums.count)), int(self._all_sum(sums.bad))
        # each trajectory is scored on one rank, whole: the worst is the largest over ranks
        traj_max = self._all_max(max((k / max(w, 1e-12) for k, w in sums.traj_kl.values()), default=0.0))
        tail_frac = self._all_sum(sums.tail) / max(count, 1)
        self._kl_history, growing = judge(
            self.config,
            self.precision,
            self._kl_history,
            kl=kl,
            worst=worst,
            count=count,
            bad=bad,
            tail_frac=tail_frac,
            traj_max=traj_max,
        )
        return {
            LK.KL_ROLLOUT: kl,
            LK.LOGPROB_DIFF_MAX: worst,
            LK.LOGPROB_TAIL_FRAC: tail_frac,
            LK.KL_ROLLOUT_TRAJ_MAX: traj_max,
            LK.KL_ROLLOUT_GROWING: float(growing),
        }

    def _epoch(
        self,
        batches: list[TokenBatch],
        norms: list[torch.Tensor],
        old: list[torch.Tensor],
        ref: list[torch.Tensor] | None,
        num_groups: int,
    ) -> dict[str, float] | None:
        """One accumulated optimizer step; None (and no step) when the loss or gradient is not finite."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        acc = dict.fromkeys(LK.STEP_SUMS, 0.0)
        bad, done = False, 0
        # The step's diagnostics (entropy, ratio, clip fractions) are token means under every loss_agg: the loss
        # weights of dr_grpo or seq_mean would scale them (a ratio of 0.34 where every ratio is 1).
        tokens = max(self._all_sum(sum(float(b.pair_weight.sum()) for b in batches)), 1e-12)
        self._before_micro_batches(len(batches))
        for i, b in enumerate(batches):
            with self.autocast():
                lp_u, ent_u = forward_token_stats(
                    self.model,
                    b,
                    with_entropy=True,
                    entropy_grad=cfg.entropy_coef > 0,
                    head_chunk=cfg.head_chunk_tokens,
                )
            lp = lp_u[b.pair_node]
            ent = ent_u[b.pair_node]
            adv = b.pair_adv
            if cfg.entropy_advantage:
                adv, _ = ADVANTAGE_SHAPERS.lookup("entropy_aware")(
                    adv,
                    ent,
                    b.pair_weight,
                    b.pair_group,
                    num_groups,
                    coef=cfg.entropy_advantage_coef,
                    min_multiplier=cfg.entropy_advantage_clip,
                )
            out = POLICY_LOSSES.lookup(cfg.policy_loss)(lp, old[i], adv, cfg)
            w = norms[i]
            policy = (w * out.loss).sum()
            loss = policy
            if ref is not None:
                kl = (w * k3_kl(lp, ref[i])).sum()
                loss = loss + cfg.kl_coef * kl
                acc[LK.LOSS_KL] += float(kl.detach())
            ent_term = (w * ent).sum()
            if cfg.entropy_coef > 0:
                loss = loss - cfg.entropy_coef * ent_term
            if not torch.isfinite(loss.detach()):
                bad = True
                break
            self._backward(loss, i, len(batches))
            done += 1
            wd = (b.pair_weight / tokens).detach()
            acc[LK.LOSS_POLICY] += float(policy.detach())
            acc[LK.LOSS_TOTAL] += float(loss.detach())
            acc[LK.LOSS_ENTROPY_BONUS] += float(-cfg.entropy_coef * ent_term.detach())
            acc[LK.ENTROPY] += float((wd * ent.detach()).sum())
            acc[LK.CLIP_FRAC] += float((wd * out.clipped).sum())
            acc[LK.CLIP_FRAC_GRAD] += float((wd * out.clipped_grad).sum())
            acc[LK.CLIP_FRAC_DUAL] += float((wd * out.dual_clipped).sum())
            acc[LK.RATIO_MEAN] += float((wd * out.ratio).sum())
        self._after_backward(done)
        if self._all_sum(float(bad)) > 0:  # a non-finite loss on any rank: no rank steps
            self.optimizer.zero_grad(set_to_none=True)
            return None
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = self._clip_grads(params, max_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        acc[LK.GRAD_NORM] = grad_norm
        acc[LK.LR] = self.optimizer.param_groups[0]["lr"]
        before = [p.detach().clone() for p in params] if self.measures_param_change else None
        self._optimizer_step()
        acc[LK.PARAM_CHANGE_NORM] = (
            0.0
            if before is None
            else math.sqrt(sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(params, before)))
        )
        self.scheduler.step()
        self.step += 1
        return acc

    # ------------------------------------------------------------------ data-parallel hooks (single process here)
    def _all_sum(self, x: float) -> float:
        """``x`` summed over the data-parallel ranks."""
        return float(x)

    def _all_max(self, x: float) -> float:
        """The largest ``x`` over the data-parallel ranks."""
        return float(x)

    def _score(self, model: torch.nn.Module, batches: list[TokenBatch]) -> list[torch.Tensor]:
        """The forward-only passes of an update: ``model``'s log-probs of the trained tokens of each batch."""
        return [self._logprobs(model, b) for b in batches]

    def _before_micro_batches(self, count: int) -> None:
        """Before the first forward of an optimizer step that has ``count`` micro-batches on this rank."""

    def _backward(self, loss: torch.Tensor, index: int, count: int) -> None:
        """Backward of micro-batch ``index`` of ``count``."""
        loss.backward()

    def _after_backward(self, done: int) -> None:
        """After this rank's ``done`` backward passes of a step (a rank may have fewer micro-batches than another)."""

    def _clip_grads(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the step's (global) gradient to ``max_norm``; its norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    # ------------------------------------------------------------------ state
    def _optimizer_state(self) -> Any:
        """The optimizer's part of :meth:`get_state` (tensors and plain values)."""
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: Any) -> None:
        self.optimizer.load_state_dict(state)

    def get_state(self, *, include_model: bool = False) -> dict[str, Any]:
        """Optimizer, scheduler, step counters and RNG states (weights: :meth:`save_pretrained`, or include_model)."""
        state = {
            "optimizer": self._optimizer_state(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "nan_streak": self.nan_streak,
            "skipped_total": self.skipped_total,
            "rng": rng_state(),
            "config": asdict(self.config),
        }
        if include_model:
            state["model"] = {k: v.detach().clone() for k, v in self.trainable_state().items()}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`get_state` returned (a missing key raises ArpoError naming it)."""
        for key in ("optimizer", "scheduler", "step", "nan_streak", "skipped_total", "rng"):
            if key not in state:
                raise ArpoError(f"learner state lacks {key!r}", hint="pass a dict produced by Learner.get_state()")
        if "model" in state:
            self.model.load_state_dict(state["model"], strict=self.lora is None)
        self._load_optimizer_state(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.nan_streak = int(state["nan_streak"])
        self.skipped_total = int(state["skipped_total"])
        set_rng_state(state["rng"])

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write a plain HF folder (safetensors, config, generation config, tokenizer with chat template); with LoRA
        an adapter folder (:mod:`arpo_algo.models.lora`: the adapter, its config and its base's fingerprint)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            save_adapter(self.model, out, base=Path(self.base_path), fingerprint=self.base_fingerprint)
        else:
            with rates_of(self.model.config, config_folder(self.base_path)):
                self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out
