"""The optimizer and schedule shared by SFT and RL (arpo_algo.train.optim)."""

from __future__ import annotations

import pytest
import torch

from arpo_algo.train.optim import build_optimizer, check_schedule, lr_multiplier
from arpo_base.errors import ConfigError


def test_lr_schedule():
    f = lambda s, sched: lr_multiplier(s, schedule=sched, warmup_steps=2, total_steps=6)  # noqa: E731
    assert [f(s, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [f(s, "linear") for s in range(2, 7)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert f(2, "cosine") == pytest.approx(1.0) and f(4, "cosine") == pytest.approx(0.5)
    assert f(6, "cosine") == pytest.approx(0.0) and f(10, "cosine") == pytest.approx(0.0)


def test_decaying_schedule_needs_a_usable_total_steps():
    check_schedule("constant", 0, None, "x")
    with pytest.raises(ConfigError, match="x: lr_schedule='cosine' decays to 0 at total_steps, which is not set"):
        check_schedule("cosine", 0, None, "x")
    with pytest.raises(ConfigError, match="total_steps=3 <= warmup_steps=3"):
        check_schedule("linear", 3, 3, "x")
    with pytest.raises(ConfigError, match="lr_schedule='step'"):
        check_schedule("step", 0, 10, "x")


def test_one_optimizer_for_sft_and_rl():
    """Weight decay on matrices only, the first update already uses a non-zero rate, fused AdamW on CPU."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt, sched = build_optimizer(model, lr=1.0, weight_decay=0.1, schedule="cosine", warmup_steps=2, total_steps=4)
    decay, no_decay = opt.param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert sorted(p.ndim for p in no_decay["params"]) == [1, 1, 1] and no_decay["weight_decay"] == 0.0
    assert opt.defaults["fused"] is True  # torch 2.13 has a fused AdamW kernel for CPU tensors
    rates = []
    for _ in range(4):
        rates.append(opt.param_groups[0]["lr"])
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert rates == pytest.approx([0.5, 1.0, 1.0, 0.5])
