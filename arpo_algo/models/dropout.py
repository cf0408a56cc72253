"""Dropout off for RL: the learner and the sampler must score one distribution.

The sampler runs the model in eval mode (no dropout); the learner's training forward would otherwise apply the
config's dropout, so every importance ratio and the mismatch alarm would carry dropout noise instead of the policy
change. Every model the learner or an HF rollout engine loads therefore gets its dropout rates set to 0 in the
config before the modules are built (as other RL trainers do); supervised fine-tuning keeps them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)


def _is_rate(name: str, value: Any) -> bool:
    return ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float) and value > 0


def zero_dropout(config: Any, prefix: str = "") -> list[str]:
    """Set every dropout rate of a transformers config (and its sub-configs) to 0; returns what was changed."""
    from transformers import PretrainedConfig

    changed: list[str] = []
    for name, value in list(vars(config).items()):
        if _is_rate(name, value):
            setattr(config, name, 0.0)
            changed.append(f"{prefix}{name}={value:g}")
        elif isinstance(value, PretrainedConfig):
            changed += zero_dropout(value, f"{prefix}{name}.")
    return changed


def config_without_dropout(path: Any) -> Any:
    """The model folder's config with every dropout rate 0 (pass it as ``from_pretrained(path, config=...)``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    changed = zero_dropout(config)
    if changed:
        log.info("dropout off for RL scoring and sampling (was %s)", ", ".join(changed))
    return config


def _copy_rates(source: Any, config: Any) -> None:
    from transformers import PretrainedConfig

    for name, value in vars(source).items():
        if _is_rate(name, value):
            setattr(config, name, value)
        elif isinstance(value, PretrainedConfig) and isinstance(getattr(config, name, None), PretrainedConfig):
            _copy_rates(value, getattr(config, name))


@contextmanager
def rates_of(config: Any, folder: Any) -> Iterator[None]:
    """Inside the block ``config`` carries the dropout rates of the model folder ``folder``; 0 again after.

    Invariant: a saved policy folder keeps its model's dropout rates: zero dropout is how RL scores, not a property
    of the model, so a later fine-tune of an exported policy trains with the rates its model came with."""
    from transformers import AutoConfig

    _copy_rates(AutoConfig.from_pretrained(folder), config)
    try:
        yield
    finally:
        zero_dropout(config)
