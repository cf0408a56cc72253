"""Pinned trees: the tree sampler's outputs for a seed must not change under refactoring.

The fingerprints were taken from the sampler before the agent-loop extraction (the commit that added this file);
any change to tokens, masks, tree shape, finish reasons or rewards for the same seed fails here. If a change of
behaviour is intended, say so in the commit and re-pin.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv

from .test_sampler import ScriptedEngine


def fingerprint(groups) -> str:
    rows = [
        [
            g.prompt_index,
            g.prompt_ids,
            [
                [
                    t.traj_id,
                    t.response_ids,
                    t.trained_mask,
                    t.parent,
                    t.branch_point,
                    t.kind,
                    t.finish_reason,
                    round(t.reward, 6),
                    len(t.tool_calls),
                ]
                for t in g.trajectories
            ],
        ]
        for g in groups
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def creator(tmp_path_factory):
    cache = tmp_path_factory.mktemp("pincache") / "python.sqlite"
    return lambda: ToolTextEnv(
        task="toolmath", tools={"python": {}, "cache": {"path": str(cache), "mode": "read_write"}}
    )


PINNED_SCRIPTED = {
    "arpo": (TreeConfig(budget=6, initial=2, branch_factor=2), "11f0e782fcae8fac"),
    "aepo": (TreeConfig.aepo(6, 2, decision_rule="reference"), "24690db7e5eed12f"),
    "grpo": (TreeConfig.grpo(3), "44ea3c013627504f"),
}


@pytest.mark.parametrize("name", sorted(PINNED_SCRIPTED))
def test_scripted_tree_is_pinned(name, creator):
    """Tool-using trees (real python tool) from the scripted engine: the sampler's tree logic and turn handling."""
    cfg, want = PINNED_SCRIPTED[name]
    s = TreeSampler(ScriptedEngine(), creator, cfg, SamplingParams(), max_response_tokens=400, seed=3)
    groups, _ = s.sample([0, 7], step=2)
    s.close()
    assert sum(len(t.tool_calls) for g in groups for t in g.trajectories) > 0
    assert fingerprint(groups) == want


def test_tiny_model_tree_is_pinned(tiny_model_dir, creator):
    """A real tiny model through the HF engine: ARPO with branching."""
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    s = TreeSampler(
        HFEngine(str(tiny_model_dir)),
        creator,
        TreeConfig(budget=4, initial=2, branch_factor=1),
        SamplingParams(),
        max_response_tokens=40,
        seed=5,
    )
    groups, _ = s.sample([0, 1], step=1)
    s.close()
    assert fingerprint(groups) == "bdca641ad8aefb25"
