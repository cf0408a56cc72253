"""The optimizer and learning-rate schedule, shared by SFT (:mod:`arpo_algo.train.sft`) and RL
(:class:`arpo_algo.train.learner.Learner`): one implementation, so both train with the same rules.

* **AdamW** (betas 0.9/0.999, eps 1e-8: torch's defaults, as the reference's verl and LLaMA-Factory use), the fused
  kernel where torch has one for the parameters' device (CPU and CUDA in torch 2.13), else the foreach one.
* **Weight decay** on parameters with two or more dimensions (weight matrices and embeddings) only; biases and norm
  gains are never decayed (HF Trainer's and LLaMA-Factory's rule). The reference's RL trainer (verl) decays every
  parameter; with its 0.01 and a few hundred steps the difference is far below the update size.
* **Schedule**: linear warm-up ``(step + 1) / warmup_steps`` over the first ``warmup_steps`` optimizer steps (the first
  update already uses a non-zero rate), then ``constant``, ``linear`` decay to 0 or ``cosine`` decay to 0 at
  ``total_steps``. A decaying schedule needs ``total_steps``: the RL learner takes it from
  ``training.total_steps`` or ``training.schedule_iterations`` (which ``arpo train`` and ``arpo tune`` set from the
  experiment's iterations), SFT from its epochs and ``max_steps``.
"""

from __future__ import annotations

import math

import torch

from arpo_base.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")
#: Schedules whose rate depends on total_steps.
DECAYING = ("linear", "cosine")


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, total_steps: int | None) -> float:
    """Learning-rate factor for optimizer step ``step`` (0-based: the factor used by the (step+1)-th update)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule not in DECAYING:
        raise ConfigError(f"lr_schedule: unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if total_steps is None:
        raise ConfigError(f"lr_schedule={schedule!r} needs total_steps")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def check_schedule(schedule: str, warmup_steps: int, total_steps: int | None, where: str) -> None:
    """Refuse a schedule that cannot be right: a decaying one without total_steps, or one that ends in warm-up."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"{where}: lr_schedule={schedule!r} is not one of {', '.join(map(repr, SCHEDULES))}")
    if warmup_steps < 0:
        raise ConfigError(f"{where}: warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and total_steps < 1:
        raise ConfigError(f"{where}: total_steps must be >= 1 or None, got {total_steps}")
    if schedule in DECAYING:
        if total_steps is None:
            raise ConfigError(
                f"{where}: lr_schedule={schedule!r} decays to 0 at total_steps, which is not set",
                hint="set total_steps to the number of optimizer steps of the run, or "
                "schedule_iterations to its iterations (arpo train and arpo tune set it from "
                "[experiment] iterations), or use lr_schedule='constant'",
            )
        if total_steps <= warmup_steps:
            raise ConfigError(
                f"{where}: lr_schedule={schedule!r} with total_steps={total_steps} <= "
                f"warmup_steps={warmup_steps}: the rate would never decay after warm-up",
                hint="total_steps counts every optimizer step of the run, warm-up included",
            )


def _fused_ok(params: list[torch.nn.Parameter]) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = {p.device.type for p in params}
    return (
        len(devices) == 1
        and devices <= set(_get_fused_kernels_supported_devices())
        and all(p.is_floating_point() for p in params)
    )


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (decay on >= 2-D ones) plus a LambdaLR implementing :func:`lr_multiplier`.

    Raises:
        ConfigError: an unknown schedule, or a decaying one without a usable ``total_steps``.
    """
    check_schedule(schedule, warmup_steps, total_steps, "optimizer")
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = _fused_ok(params)
    opt = torch.optim.AdamW(groups, lr=lr, fused=True if fused else None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps)
    )
    return opt, sched
