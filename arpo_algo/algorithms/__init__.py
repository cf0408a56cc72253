"""The algorithms: one module per family holding its config class and its RLlib Algorithm (no lazy cross-imports).

``arpo`` -> :class:`ARPOConfig` / :class:`ARPO`; ``aepo`` -> :class:`AEPOConfig` / :class:`AEPO`; ``grpo`` ->
:class:`GRPOConfig` / :class:`GRPO`. Shared machinery: :mod:`.config` (strict settings), :mod:`.base` (the Algorithm),
:mod:`.components` (data order, env factory, resources, checkpoint component), :mod:`.settings` (every setting, one
dataclass per section).
"""

from arpo_algo.algorithms.aepo import AEPO, AEPOConfig
from arpo_algo.algorithms.arpo import ARPO, ARPOConfig
from arpo_algo.algorithms.config import AgenticRLConfig
from arpo_algo.algorithms.grpo import GRPO, GRPOConfig

#: The experiment files' ``[experiment] algorithm`` names.
CONFIG_CLASSES: dict[str, type[ARPOConfig]] = {"arpo": ARPOConfig, "aepo": AEPOConfig, "grpo": GRPOConfig}
ALGORITHMS: dict[str, type[ARPO]] = {"arpo": ARPO, "aepo": AEPO, "grpo": GRPO}

__all__ = [
    "AEPO",
    "ALGORITHMS",
    "ARPO",
    "CONFIG_CLASSES",
    "GRPO",
    "AEPOConfig",
    "ARPOConfig",
    "AgenticRLConfig",
    "GRPOConfig",
]
