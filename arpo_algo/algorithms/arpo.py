"""ARPO (Agentic Reinforced Policy Optimization, arXiv 2507.19849): the algorithm every variant starts from.

One iteration (:meth:`~arpo_algo.algorithms.base.AgenticRLAlgorithm.training_step`): sync the weights -> sample a
tree per prompt (:class:`~arpo_algo.rollout.sampler.TreeSampler`) -> advantages -> update
(:class:`~arpo_algo.train.learner.Learner`) -> record. What makes it ARPO, by setting (docs/concepts/arpo.md):

* entropy-based adaptive rollout: N initial samples of a budget of M per prompt (``tree.initial``, ``tree.budget``),
  each branching Z times (``tree.branch_factor``) after a tool result where the entropy rises; its branch policy
  (:mod:`arpo_algo.core.branching`) is ``paper`` (``tree.decision_rule = "paper"``, the paper's k-token look-ahead
  rule, docs/concepts/arpo.md#the-paper-rule) or ``reference`` (the released code's draw,
  docs/concepts/arpo.md#the-reference-rule);
* advantage attribution over the tree: ``training.advantage`` ("grpo" soft attribution, "hard", or "turn" credit
  per turn from the tree's node values, docs/concepts/arpo.md#soft-attribution).

Its preset is empty: ARPO's values are the sections' own defaults.
"""

from __future__ import annotations

from arpo_algo.algorithms.base import AgenticRLAlgorithm
from arpo_algo.algorithms.config import AgenticRLConfig
from arpo_algo.algorithms.variants import register_variant


class ARPOConfig(AgenticRLConfig):
    """Configuration of :class:`ARPO` (and, through subclasses, of every other variant).

    Example:
        >>> config = (ARPOConfig()
        ...     .environment("arpo/ToolMath-v0", env_config={"max_tool_calls": 3})
        ...     .training(model_path="smollm2-135m-instruct", lr=1e-5, prompts_per_step=4)
        ...     .tree(budget=8, initial=4)
        ...     .llm_rollouts(max_response_tokens=256)
        ...     .evaluation(every=5, num_prompts=50))   # doctest: +SKIP

    The same settings by dotted name (as experiment files, ``--set`` and sweeps write them)::

        ARPOConfig().update_settings({"model.path": "smollm2-135m-instruct", "tree.budget": 8, "training.lr": 1e-5})
    """

    variant = "arpo"
    tree_mode = "arpo"
    preset = {}
    changes = {}


class ARPO(AgenticRLAlgorithm):
    """Agentic Reinforced Policy Optimization (arXiv 2507.19849) as a thin RLlib Algorithm."""


register_variant(ARPOConfig, ARPO)
