"""The GRPO baseline: ARPO's code path with the tree sampler off.

What it changes from ARPO: no branch point at all (branch policy ``never``), so the budget of M trajectories per
prompt is M independent samples (``tree.initial = tree.budget``, ``tree.branch_factor = 0``).
"""

from __future__ import annotations

from arpo_algo.algorithms.arpo import ARPO, ARPOConfig
from arpo_algo.algorithms.variants import register_variant
from arpo_algo.core.tree import TreeConfig


class GRPOConfig(ARPOConfig):
    """GRPO baseline: the tree sampler off, ``budget`` independent samples per prompt, same learner.

    The tree must then say so explicitly: ``initial == budget`` and ``branch_factor == 0`` (the defaults here; change
    both ``budget`` and ``initial`` together).
    """

    variant = "grpo"
    tree_mode = "grpo"  # branch policy "never" (arpo_algo.core.tree.MODE_POLICIES)
    preset = {"tree.initial": TreeConfig.budget, "tree.branch_factor": 0}
    changes = {
        "tree.initial": "all M samples are independent roots (GRPO, the ARPO paper's baseline)",
        "tree.branch_factor": "no branching: the tree sampler is off (GRPO, the ARPO paper's baseline)",
    }


class GRPO(ARPO):
    """The GRPO baseline: same code path, tree sampler off (:class:`GRPOConfig`)."""


register_variant(GRPOConfig, GRPO)
