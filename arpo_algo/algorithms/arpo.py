"""ARPO (Agentic Reinforced Policy Optimization, arXiv 2507.19849): its config and its Algorithm."""

from __future__ import annotations

from arpo_algo.algorithms.base import AgenticRLAlgorithm
from arpo_algo.algorithms.config import AgenticRLConfig


class ARPOConfig(AgenticRLConfig):
    """Configuration of :class:`ARPO` (and, through subclasses, AEPO and GRPO).

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

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or ARPO)


class ARPO(AgenticRLAlgorithm):
    """Agentic Reinforced Policy Optimization (arXiv 2507.19849) as a thin RLlib Algorithm."""

    @classmethod
    def get_default_config(cls) -> ARPOConfig:
        return ARPOConfig(algo_class=cls)
