"""The algorithms: one module per variant holding its config class (preset, changes from ARPO, tree mode) and its
RLlib Algorithm, registered by one line (:func:`~arpo_algo.algorithms.variants.register_variant`).

``arpo`` -> :class:`ARPOConfig` / :class:`ARPO`; ``aepo`` -> :class:`AEPOConfig` / :class:`AEPO`; ``grpo`` ->
:class:`GRPOConfig` / :class:`GRPO`. Shared machinery: :mod:`.config` (strict settings), :mod:`.base` (the Algorithm),
:mod:`.components` (data order, env factory, resources, checkpoint component), :mod:`.settings` (every setting, one
dataclass per section), :mod:`.variants` (the registry).
"""

from arpo_algo.algorithms.aepo import AEPO, AEPOConfig
from arpo_algo.algorithms.arpo import ARPO, ARPOConfig
from arpo_algo.algorithms.config import AgenticRLConfig
from arpo_algo.algorithms.grpo import GRPO, GRPOConfig
from arpo_algo.algorithms.variants import ALGORITHMS, CONFIG_CLASSES, VARIANTS, register_variant

__all__ = [
    "AEPO",
    "ALGORITHMS",
    "ARPO",
    "CONFIG_CLASSES",
    "GRPO",
    "VARIANTS",
    "AEPOConfig",
    "ARPOConfig",
    "AgenticRLConfig",
    "GRPOConfig",
    "register_variant",
]
