"""arpo_algo: ARPO, AEPO and GRPO for tool-using LLM agents as an RLlib Algorithm.

Rollout engines (HF transformers, vLLM on GPU), entropy-triggered tree branching, tree-aware advantages, the policy
loss, the learner and checkpoints that transformers and vLLM load directly.
"""

__version__ = "0.1.0"
