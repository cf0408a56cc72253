"""Dropout off for RL: the learner and the sampler must score one distribution.

The sampler runs the model in eval mode (no dropout); the learner's training forward would otherwise apply the
config's dropout, so every importance ratio and the mismatch alarm would carry dropout noise instead of the policy
change. Every model the learner or an HF rollout engine loads therefore gets its dropout rates set to 0 in the
config before the modules are built (as other RL trainers do); supervised fine-tuning keeps them.
"""

from __future__ import annotations

import logging
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
