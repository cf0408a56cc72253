"""AEPO (Agentic Entropy-Balanced Policy Optimization, arXiv 2510.14545): its config and its Algorithm."""

from __future__ import annotations

from arpo_algo.algorithms.arpo import ARPO, ARPOConfig


class AEPOConfig(ARPOConfig):
    """AEPO (arXiv 2510.14545): ARPO's pipeline with the entropy-balanced rollout and stop-gradient clipping.

    Defaults follow the released AEPO scripts (docs/concepts/aepo.md#aepo-defaults): consecutive-branch penalty on (the
    AEPO tree mode),
    entropy-balanced clipping on, pre-monitoring off (``ENABLE_DYNAMIC_ROLLOUTS=False`` in the scripts), entropy-aware
    advantage on (it is inert in the reference code, docs/concepts/aepo.md#entropy-aware-advantage; here it is live:
    set it False for parity).
    The AEPO paper's pre-monitoring (dynamic number of initial samples) stays reachable by name:
    ``.tree(aepo_premonitor=True)`` (the YAML default of the reference, docs/concepts/aepo.md#entropy-pre-monitoring),
    plus ``aepo_premonitor_keep=True`` for
    the reference's extra discarded trajectory.
    """

    variant = "aepo"  # its defaults: settings.VARIANT_DEFAULTS["aepo"]

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or AEPO)


class AEPO(ARPO):
    """AEPO: ARPO's pipeline with AEPO's defaults (:class:`AEPOConfig`)."""

    @classmethod
    def get_default_config(cls) -> AEPOConfig:
        return AEPOConfig(algo_class=cls)
