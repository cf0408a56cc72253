"""Waves and lockstep rounds grow the same trees: the tree sampler's two schedules on the real HF engine.

``schedule="rounds"`` sends every live path of every prompt to one engine call per round; ``schedule="waves"`` lets a
prompt whose round has ended start its next round inside the running call (the HF engine's ``on_finish``). The
policy is the tiny Llama taught to call the python tool at every turn (:mod:`tests.arpo_algo.rollout.teach`), so a
step has several rounds, tool results, branches and fill-ups."""

from __future__ import annotations

import re

import pytest

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.sampler import TreeSampler
from arpo_base.errors import ConfigError
from tests.arpo_algo.rollout import teach

env_creator, caller_dir = teach.env_creator, teach.caller_dir  # the module-scoped fixtures, shared


class CountingEngine(HFEngine):
    """The HF engine, counting its calls and the requests each call served (joined ones included)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[int] = []

    def generate(self, requests, **kw):
        out = super().generate(requests, **kw)
        self.calls.append(len(out))
        return out


def _step(caller_dir, env_creator, tree, schedule, decode="dynamic"):
    engine = CountingEngine(caller_dir, dtype="float32", seed=0, max_batch_size=4, decode=decode)
    sampler = TreeSampler.from_config(
        engine, env_creator, tree, RolloutsConfig(max_response_tokens=120), seed=3, schedule=schedule
    )
    try:
        groups, metrics = sampler.sample([0, 1, 2], step=0)
    finally:
        sampler.close()
    return groups, metrics, engine.calls


#: What a decision records as floats (entropies, gains): equal up to float32 rounding, see :func:`_floats`.
FLOAT_KEYS = ("h_init", "h_now", "h_before", "logprob_gain")


def _trees(groups):
    """Everything discrete a tree holds that sampling decides: tokens, masks, shape, finishes, rewards, tool calls
    (what was called and returned) and every branch decision (where, how many, the RNG draws); compared exactly."""
    return [
        (
            g.prompt_index,
            [
                (
                    t.traj_id,
                    t.kind,
                    t.parent,
                    t.branch_point,
                    t.response_ids,
                    t.trained_mask,
                    t.finish_reason,
                    t.reward,
                    [(c["tool"], c["args"], c["output"], c["error"]) for c in t.tool_calls],  # not timing, cache hits
                )
                for t in g.trajectories
            ],
            [{k: v for k, v in d.items() if k not in FLOAT_KEYS} for d in g.decisions],
        )
        for g in groups
    ]


def _floats(groups):
    """The per-token log-probs and entropies and the decisions' measured entropies, NaN (tool tokens) as None."""
    out = []
    for g in groups:
        for t in g.trajectories:
            out += [None if x != x else x for x in (*t.old_logprobs, *t.entropies)]
        out += [d.get(k) for d in g.decisions for k in FLOAT_KEYS]
    return out


TREES = {
    "paper": TreeConfig(budget=6, initial=2, branch_factor=2, tau=0.4, entropy_tokens=4),  # entropy rule, look-ahead
    "reference": TreeConfig(budget=6, initial=2, branch_factor=2, tau=0.4, decision_rule="reference"),
    "random": TreeConfig(budget=6, initial=2, branch_factor=2, branch_policy="random", random_rate=0.5),
    "aepo": TreeConfig.aepo(6, 2, branch_factor=2, tau=0.4),  # lazy pre-monitoring: a probe, then the others
    "aepo_kept": TreeConfig.aepo(6, 2, branch_factor=2, tau=0.4, aepo_premonitor_keep=True),  # a discarded probe
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_waves_grow_the_trees_of_lockstep_rounds(caller_dir, env_creator, name):
    tree = TREES[name]
    want, m_rounds, calls_rounds = _step(caller_dir, env_creator, tree, "rounds")
    got, m_waves, calls_waves = _step(caller_dir, env_creator, tree, "waves")
    # the step really ran both ways: one call per round, or the rounds' requests joining fewer calls (one for the
    # tree; the reference pre-monitoring's probes and discarded trajectories come first, in calls of their own)
    assert len(calls_rounds) > 2 and sum(calls_waves) == sum(calls_rounds)
    assert len(calls_waves) == (3 if tree.aepo_premonitor_keep else 1)
    trajs = [t for g in want for t in g.trajectories]
    assert any(t.tool_calls for t in trajs)
    assert any(t.kind == "fillup" for t in trajs) or any(t.kind == "branch" for t in trajs)
    assert _trees(got) == _trees(want)
    # The log-probs and entropies are those of the same tokens in the same contexts, computed in batches of other
    # sizes: a float32 forward's rounding depends on the batch shape, so they agree to rounding, not bit for bit.
    assert _floats(got) == pytest.approx(_floats(want), abs=1e-5, nan_ok=True)
    for key in ("rollout/branches", "rollout/fillups", "rollout/trajectories"):
        if key in m_rounds:
            assert m_waves[key] == m_rounds[key], key


def test_waves_on_the_static_decode_path(caller_dir, env_creator):
    tree = TREES["paper"]
    want, _, _ = _step(caller_dir, env_creator, tree, "rounds", decode="static")
    got, _, calls = _step(caller_dir, env_creator, tree, "waves", decode="static")
    assert len(calls) == 1 and _trees(got) == _trees(want)
    assert _floats(got) == pytest.approx(_floats(want), abs=1e-5, nan_ok=True)


def test_schedule_is_checked(caller_dir, env_creator):
    engine = HFEngine(caller_dir, dtype="float32")
    with pytest.raises(ConfigError, match="not one of"):
        TreeSampler.from_config(engine, env_creator, TREES["paper"], RolloutsConfig(), schedule="wave")
    legacy = TreeConfig(budget=4, initial=2, legacy_stale_baseline=True)
    with pytest.raises(ConfigError, match="legacy_stale_baseline"):
        TreeSampler.from_config(engine, env_creator, legacy, RolloutsConfig(), schedule="waves")
    assert TreeSampler.from_config(engine, env_creator, legacy, RolloutsConfig(), schedule="auto").schedule == "rounds"
    auto = TreeSampler.from_config(engine, env_creator, TREES["paper"], RolloutsConfig(), schedule="auto")
    assert auto.schedule == "waves"
    assert TreeSampler.from_config(engine, env_creator, TREES["paper"], RolloutsConfig()).schedule == "rounds"
    from .test_sampler import ScriptedEngine  # an engine without joins_requests: one call per round

    with pytest.raises(ConfigError, match="takes requests into a running call"):
        TreeSampler.from_config(ScriptedEngine(), env_creator, TREES["paper"], RolloutsConfig(), schedule="waves")
    assert (
        TreeSampler.from_config(
            ScriptedEngine(), env_creator, TREES["paper"], RolloutsConfig(), schedule="auto"
        ).schedule
        == "rounds"
    )


def test_an_experiment_chooses_the_schedule_with_rollouts_schedule(caller_dir, env_creator, tiny_model_dir):
    """``rollouts.schedule`` reaches the training sampler (an explicit ``schedule=`` still wins); 'waves' is refused
    where it is set for an engine or rollout actors that cannot take requests into a running call."""
    from arpo_algo.rollout.engines.registry import engine_spec
    from arpo_algo.run.experiment import load_experiment

    engine = HFEngine(caller_dir, dtype="float32")
    assert engine.joins_requests and engine_spec("hf").capabilities.joins_requests  # the class and the registry agree
    waves = RolloutsConfig(schedule="waves")
    waves.validate()
    assert TreeSampler.from_config(engine, env_creator, TREES["paper"], waves).schedule == "waves"
    assert TreeSampler.from_config(engine, env_creator, TREES["paper"], waves, schedule="rounds").schedule == "rounds"
    exp = load_experiment("quickstart", [f'model.path="{tiny_model_dir}"', 'rollouts.schedule="auto"'])
    assert exp.config.settings.rollouts.schedule == "auto"
    refused = "[rollouts]: schedule must be 'rounds' | 'waves' | 'auto', got 'wave'"
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_experiment("quickstart", [f'model.path="{tiny_model_dir}"', 'rollouts.schedule="wave"'])
    with pytest.raises(ConfigError, match="rollout actors does not"):
        RolloutsConfig(schedule="waves", num_rollout_actors=1).validate()
    assert not engine_spec("vllm").capabilities.joins_requests
    with pytest.raises(ConfigError, match="rollouts.engine='vllm' does not"):
        RolloutsConfig(engine="vllm", schedule="waves").validate()
