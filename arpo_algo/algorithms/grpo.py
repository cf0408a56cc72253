"""The GRPO baseline: the same code path with the tree sampler off; its config and its Algorithm."""

from __future__ import annotations

from arpo_algo.algorithms.arpo import ARPO, ARPOConfig


class GRPOConfig(ARPOConfig):
    """GRPO baseline: the tree sampler off, ``budget`` independent samples per prompt, same learner.

    The tree must then say so explicitly: ``initial == budget`` and ``branch_factor == 0`` (the defaults here; change
    both ``budget`` and ``initial`` together).
    """

    variant = "grpo"  # its defaults: settings.VARIANT_DEFAULTS["grpo"]

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or GRPO)


class GRPO(ARPO):
    """The GRPO baseline: same code path, tree sampler off (:class:`GRPOConfig`)."""

    @classmethod
    def get_default_config(cls) -> GRPOConfig:
        return GRPOConfig(algo_class=cls)
