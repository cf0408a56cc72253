"""The process's random-number generators as one checkpointable state: a resumed learner draws what an unbroken run
would have drawn (dropout masks, mini-batch shuffles, sampling in the learner's process)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """torch's, Python's and numpy's generator states (and every CUDA device's, where there is one)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (a CUDA state is skipped where there is no CUDA device)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
