"""AEPO (Agentic Entropy-Balanced Policy Optimization, arXiv 2510.14545): ARPO with an entropy-balanced rollout and
entropy-balanced policy optimization (docs/concepts/aepo.md).

Its preset follows the released AEPO scripts (docs/concepts/aepo.md#aepo-defaults). What it changes from ARPO, knob
by knob, with the paper's mechanism (:attr:`AEPOConfig.changes`):

* branch policy: ``aepo_paper`` / ``aepo_reference`` (:mod:`arpo_algo.core.branching`), ARPO's rules times the
  consecutive-branch penalty ``max(0, 1 - tree.aepo_penalty * l)`` (entropy-balanced rollout,
  docs/concepts/aepo.md#consecutive-branch-penalty); ``tree.aepo_penalty_scope`` says what ``l`` counts;
* ``tree.aepo_premonitor``: entropy pre-monitoring, the number of initial samples per prompt from ``H_root`` and
  ``H_tool`` (entropy-balanced rollout, docs/concepts/aepo.md#entropy-pre-monitoring). Off in the scripts, so off
  here; ``.tree(aepo_premonitor=True)`` turns the paper's mechanism on, ``aepo_premonitor_keep=True`` adds the
  reference's discarded trajectory. It decides before any branch point, so it is a knob, not a branch policy;
* ``training.entropy_balanced_clip``: stop-gradient clipping (entropy-balanced policy optimization,
  docs/concepts/aepo.md#entropy-balanced-clipping); it acts only through the ratio, so AEPO takes several optimizer
  steps per batch (``training.mini_batches`` unset = min(8, prompts_per_step));
* ``training.entropy_advantage``: entropy-aware advantage (entropy-balanced policy optimization,
  docs/concepts/aepo.md#entropy-aware-advantage); inert in the reference code, live here (set it False for parity).
"""

from __future__ import annotations

from arpo_algo.algorithms.arpo import ARPO, ARPOConfig
from arpo_algo.algorithms.variants import register_variant


class AEPOConfig(ARPOConfig):
    """AEPO (arXiv 2510.14545): ARPO's pipeline with the entropy-balanced rollout and stop-gradient clipping.

    Its preset follows the released scripts (docs/concepts/aepo.md#aepo-defaults): consecutive-branch penalty on,
    entropy-balanced clipping on, pre-monitoring off, entropy-aware advantage on (live here, inert in the reference).
    The module docstring lists each change with the paper's mechanism; :attr:`changes` holds the same by setting.
    """

    variant = "aepo"
    tree_mode = "aepo"  # branch policies aepo_paper / aepo_reference (arpo_algo.core.tree.MODE_POLICIES)
    preset = {
        "tree.aepo_penalty": 0.05,
        "training.entropy_balanced_clip": True,
        "training.entropy_advantage": True,
        "tree.aepo_premonitor": False,
        "training.mini_batches": None,
    }
    changes = {
        "tree.aepo_penalty": "consecutive high-entropy branch penalty (entropy-balanced rollout)",
        "tree.aepo_premonitor": "entropy pre-monitoring (entropy-balanced rollout); off in the released scripts",
        "training.entropy_balanced_clip": "stop-gradient clipping (entropy-balanced policy optimization)",
        "training.entropy_advantage": "entropy-aware advantage (entropy-balanced policy optimization)",
        "training.mini_batches": "several optimizer steps per batch, as the released scripts",
    }


class AEPO(ARPO):
    """AEPO: ARPO's pipeline with AEPO's preset (:class:`AEPOConfig`)."""


register_variant(AEPOConfig, AEPO)
