"""Add a branch-point policy: branch each candidate with a fixed probability, whatever its entropy.

A worked example of the seam, not the control to run: the built-in ``random`` policy is that control, with its rate
a setting (``tree.random_rate``) that ``arpo tune`` can search. A policy is one class with the protocol of
:class:`arpo_algo.core.branching.BranchPolicy` plus ONE registration line; ``tree.branch_policy =
"fixed_rate_demo"`` (in an experiment file, ``--set``, or ``.tree(branch_policy="fixed_rate_demo")``, once this
module is imported) then selects it. The sampler asks it at every candidate (a live trajectory right after a tool
result, with free budget and below ``tree.max_depth``) and makes the number of clones it returns.

Run the demo: ``python examples/extend/branch_policy.py``.
"""

from __future__ import annotations

from arpo_algo.core.branching import Candidate, register_branch_policy
from arpo_algo.core.tree import TreeConfig


class FixedRateDemo:
    """Each of the ``cap`` clones at a candidate is made with probability :attr:`rate`: one draw per clone from the
    prompt's seeded branch RNG, so the same seed gives the same tree (and the draws are recorded with the decision)."""

    rate = 0.3
    lookahead = False  # decide right after the tool result (True: after tree.entropy_tokens look-ahead tokens)
    fresh_baseline = False  # a clone keeps its parent's entropy baseline (this policy does not read it anyway)
    needs_logprobs = False  # Candidate.logprobs stays None

    def __init__(self, cfg: TreeConfig) -> None:
        self.cfg = cfg

    def branches(self, c: Candidate) -> int:
        if c.rng is None:
            raise ValueError("the fixed_rate_demo branch policy needs the prompt's branch RNG")
        return sum(c.rng.random() < self.rate for _ in range(c.cap))


register_branch_policy("fixed_rate_demo")(FixedRateDemo)


if __name__ == "__main__":
    from arpo_algo.core.tree import branch_rng, num_branches

    cfg = TreeConfig(branch_factor=1, branch_policy="fixed_rate_demo")
    rng = branch_rng(seed=0, step=0, prompt_index=0)
    made = [num_branches(cfg, delta_h=0.0, depth=0, consecutive=0, free=1, rng=rng) for _ in range(10_000)]
    print(f"policy {cfg.policy_name!r}: branched {sum(made)} of {len(made)} candidates (rate {FixedRateDemo.rate})")
