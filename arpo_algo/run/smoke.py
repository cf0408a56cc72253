"""``ARPO_SMOKE=1``: every command at its smallest budget, to check that a pipeline runs end to end.

With the variable set, each experiment (``arpo train``, ``arpo quickstart``'s RL stage, every Tune trial) runs one
iteration of at most two prompts with short responses and a two-task evaluation; a sweep runs one trial of one
iteration; ``arpo sft`` and the quickstart's SFT stage use 16 demonstrations; ``arpo eval`` scores 4 items with
responses of at most 48 tokens. Models, data, tools, algorithms and every other setting stay as given, so a smoke run
exercises the same code paths as the real one; its numbers mean nothing and every command that applies it says so on
stderr. The documentation's tier runs every shell and Python block of the README and the docs this way, on the tiny test
model.
"""

from __future__ import annotations

import os
import sys
from typing import Any

SMOKE_ENV = "ARPO_SMOKE"
#: The smallest budget of each kind.
ITERATIONS, PROMPTS, RESPONSE_TOKENS, EVAL_TASKS, SFT_EXAMPLES, EVAL_ITEMS = 1, 2, 48, 2, 16, 4


def smoke() -> bool:
    """True when ``ARPO_SMOKE`` is ``1``; unset, empty or ``0`` is off; any other value is a :class:`ConfigError`
    (``ARPO_SMOKE=false`` must not quietly shrink a real run)."""
    value = os.environ.get(SMOKE_ENV, "").strip()
    if value not in ("", "0", "1"):
        from arpo_base.errors import ConfigError

        raise ConfigError(
            f"{SMOKE_ENV}={value!r} is neither 1 (smallest budgets) nor 0 (off)", hint=f"set {SMOKE_ENV}=1 or unset it"
        )
    return value == "1"


_announced: set[str] = set()


def announce(what: str) -> None:
    """Say once per process and kind of thing that it runs at the smoke budget."""
    kind = what.split()[0]
    if kind not in _announced:
        _announced.add(kind)
        print(
            f"[arpo] {SMOKE_ENV} is set: {what} at the smallest budget (a wiring check; its numbers mean nothing)",
            file=sys.stderr,
            flush=True,
        )


def experiment_budget(settings: Any) -> dict[str, Any]:
    """The dotted settings that shrink one experiment's budget (an empty dict when smoke is off)."""
    if not smoke():
        return {}
    t, r, e = settings.training, settings.rollouts, settings.evaluation
    prompts = min(t.prompts_per_step, PROMPTS)
    mini_batches = None if t.mini_batches is None else min(t.mini_batches, prompts)  # None: derived from prompts
    return {
        "training.prompts_per_step": prompts,
        "training.mini_batches": mini_batches,
        "rollouts.max_response_tokens": min(r.max_response_tokens, RESPONSE_TOKENS),
        "evaluation.num_prompts": min(e.num_prompts or EVAL_TASKS, EVAL_TASKS),
    }


def sweep_budget() -> dict[str, Any]:
    """The ``[sweep]`` keys that shrink a sweep (an empty dict when smoke is off)."""
    return {"num_samples": 1, "iterations": ITERATIONS, "max_concurrent": 1} if smoke() else {}


def capped(value: int | None, cap: int) -> int | None:
    """``value`` capped at ``cap`` under smoke (``None`` = all becomes ``cap``); unchanged otherwise."""
    if not smoke():
        return value
    return cap if value is None else min(value, cap)
