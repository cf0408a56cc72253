"""What a rollout produces and the learner consumes: trajectories grouped per prompt, with their tree.

A :class:`Group` is the whole sampling tree of one prompt: M trajectories (initial samples, branches and fill-ups).
Trajectories that branched from another share its tokens up to ``branch_point``; the learner finds shared prefixes
from the token ids themselves, so this structure is only needed for metrics and inspection.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from arpo_algo.core.tree import TreeNode

__all__ = ["Group", "Trajectory", "TreeNode"]


@dataclass
class Trajectory:
    """One root-to-leaf path of a sampling tree.

    Attributes:
        traj_id: Index within the group (creation order).
        response_ids: Every token after the prompt: sampled tokens and inserted tool-result tokens.
        trained_mask: 1 for sampled tokens (trained), 0 for inserted tokens (tool results; masked). Same length.
        old_logprobs: Sampling-time log-probability per response token (0.0 for inserted tokens; a NaN placeholder
            at the positions in ``unsampled``). Every other trained position holds a finite value from the engine.
        entropies: Sampling-time entropy per response token (0.0 for inserted tokens).
        reward: Scalar reward of the finished trajectory.
        reward_info: The reward breakdown from the environment.
        tool_calls: One dict per tool call: tool, args, latency_s, cache_hit, error.
        parent: traj_id this one branched from (None for initial samples and fill-ups).
        branch_point: Number of response tokens shared with ``parent`` (None when parent is None).
        kind: "initial", "branch" or "fillup".
        node_ids: Tree node ids along the path, root first.
        finish_reason: Why the trajectory ended: "answer", "eos", "length", "tool_limit", "turn_limit", "error".
        segment_entropy: Per generated segment, the entropy value the branch rule saw (for metrics and debugging).
        policy_version: The policy version (learner updates applied) whose weights sampled it; the learner scores
            a batch older than its own version under that version's weights. None: not recorded.
        unsampled: Response positions appended without being sampled (the tool-limit EOS): no engine log-prob
            exists for them, so the learner scores them itself. This list, not the NaN placeholder, is the mark;
            a non-finite log-prob anywhere else is an engine fault.
    """

    traj_id: int
    response_ids: list[int]
    trained_mask: list[int]
    old_logprobs: list[float]
    entropies: list[float]
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parent: int | None = None
    branch_point: int | None = None
    kind: str = "initial"
    node_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    segment_entropy: list[float] = field(default_factory=list)
    policy_version: int | None = None
    unsampled: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if any(not 0 <= i < n for i in self.unsampled):
            raise ValueError(
                f"trajectory {self.traj_id}: unsampled positions {self.unsampled} outside the response ({n} tokens)"
            )
        if not (len(self.trained_mask) == len(self.old_logprobs) == len(self.entropies) == n):
            raise ValueError(
                f"trajectory {self.traj_id}: response_ids ({n}), trained_mask ({len(self.trained_mask)}), "
                f"old_logprobs ({len(self.old_logprobs)}) and entropies ({len(self.entropies)}) must have equal length"
            )


@dataclass
class Group:
    """All trajectories sampled for one prompt.

    Attributes:
        prompt_index: Index of the task in its dataset/split.
        prompt_ids: The tokenized prompt (chat template applied, generation prompt added).
        trajectories: Exactly M trajectories (the budget).
        task: What the learner and metrics may need from the task (id, ground truth, split).
        nodes: The sampling tree.
        metrics: Rollout metrics of this group (tokens generated/reused, tool calls, branches by depth, ...).
        policy_version: The version that sampled the whole tree (every trajectory and node carries it too).
        decisions: Every branch decision that could have branched: the trajectory and response position, the
            entropies it compared, the rule's constants, the random draws of a drawing rule, the log-prob gain
            (``logprob_gain``) a log-prob look-ahead policy read, and the clones made.
    """

    prompt_index: int
    prompt_ids: list[int]
    trajectories: list[Trajectory]
    task: dict[str, Any] = field(default_factory=dict)
    nodes: list[TreeNode] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def to_json(self) -> str:
        """One JSON line for tree dumps (``--dump-trees``)."""
        return json.dumps(asdict(self))
