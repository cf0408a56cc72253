"""The tree sampler with persistent Python interpreters: every trajectory keeps its interpreter's state between its
calls, a branch continues from its parent's state at the branch point and never sees its siblings', and nothing of a
step's interpreters outlives the step.

The policy is the tiny random Llama taught, in teacher-forced steps, to answer every turn with one python call whose
output counts the interpreter's names: 3 in a fresh interpreter, one more for every call it ran before."""

from __future__ import annotations

import os
import shutil

import pytest

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv
from arpo_env.tools.interpreter import interpreter_metrics, live_interpreters
from tests.arpo_algo.rollout.teach import teach_call

# Each call adds one name (its own n_<count>): the output is the number of names the interpreter held before.
CALL = "<python>exec(f'n_{len(dir())}=1');print(len(dir()))</python>"


@pytest.fixture(scope="module")
def counter_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model taught to write CALL at every turn (loss on the call tokens only; contexts from a stateless
    env, so the persistent runs below see outputs it was never shown)."""
    env = ToolTextEnv(task="toolmath", tools={"python": {}})
    return teach_call(tiny_model_dir, tmp_path_factory.mktemp("counter"), env, CALL, turns=4)


def test_branches_continue_from_their_parents_interpreter(counter_dir):
    if shutil.which("bwrap") is None and os.environ.get("ARPO_REQUIRE_BWRAP") != "1":
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    tools = {"python": {"backend": "bwrap", "persistent": True}}
    engine = HFEngine(counter_dir, dtype="float32", seed=0)
    tree = TreeConfig(budget=4, initial=2, branch_factor=1, tau=0.4)  # alpha 0.5 > tau: branch after every result
    sampler = TreeSampler.from_config(
        engine,
        lambda: ToolTextEnv(task="toolmath", tools=tools, max_tool_calls=4),
        tree,
        RolloutsConfig(max_response_tokens=240),
        seed=0,
    )
    interpreter_metrics()  # the figures are per process since the last read: count this step's only
    try:
        groups, metrics = sampler.sample([0], step=0)
    finally:
        sampler.close()
    assert live_interpreters() == 0  # the step's interpreters ended with it
    trajs = {t.traj_id: t for g in groups for t in g.trajectories}
    counted = 0
    for t in trajs.values():
        outs = [c["output"].strip() for c in t.tool_calls]
        ok = [o for o in outs if o.isdigit()]
        if len(ok) != len(outs):  # a garbled call (sampled at temperature 1) breaks the count: skip that one
            continue
        # Each call sees one more name than the one before it, from 3 (fresh: two dunder names and its own n_) on:
        # state kept across calls, and a branch's first call continues its parent's count (its record holds the
        # parent's calls before the branch point).
        assert [int(o) for o in ok] == list(range(3, 3 + len(ok))), (t.kind, outs)
        counted += len(ok) > 1
    assert counted >= 2
    assert any(t.kind == "branch" and len(t.tool_calls) >= 2 for t in trajs.values())
    assert metrics["rollout/interpreter_forks"] >= 1 and metrics["rollout/interpreter_fork_ms"] > 0
    assert metrics["rollout/interpreter_fork_ms_total"] == pytest.approx(
        metrics["rollout/interpreter_fork_ms"] * metrics["rollout/interpreter_forks"]
    )
    assert metrics["rollout/interpreter_forks_failed"] == 0
    assert 1 <= metrics["rollout/interpreters_peak"] <= len(trajs) + 1
    # Sampled once per round with the round's interpreters live: at least one fresh interpreter's worth (several MB).
    assert 2 <= metrics["rollout/interpreter_pss_mib_peak"] < 50 * metrics["rollout/interpreters_peak"]


def test_a_stateless_step_reports_no_interpreter_figures(counter_dir):
    engine = HFEngine(counter_dir, dtype="float32", seed=0)
    tree = TreeConfig(budget=2, initial=2, branch_factor=1)
    sampler = TreeSampler.from_config(
        engine,
        lambda: ToolTextEnv(task="toolmath", tools={"python": {}}, max_tool_calls=1),
        tree,
        RolloutsConfig(max_response_tokens=120),
        seed=0,
    )
    try:
        _, metrics = sampler.sample([0], step=0)
    finally:
        sampler.close()
    assert metrics["rollout/tool_calls"] >= 1  # the stateless tool ran, and logged nothing about interpreters
    assert not [k for k in metrics if "interpreter" in k]


def test_a_served_request_has_one_interpreter_per_choice_ended_with_it(counter_dir):
    """``arpo serve``'s agent (in this process): each choice keeps its own interpreter across its calls, and none
    survives the request."""
    if shutil.which("bwrap") is None and os.environ.get("ARPO_REQUIRE_BWRAP") != "1":
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    import threading

    from serve.agents import build_specs
    from serve.runtime import Agent
    from serve.schema import parse_chat_request

    spec = build_specs(
        [f"counter={counter_dir}"],
        engine="hf",
        max_tool_calls=3,
        max_tokens=200,
        tools={"python": {"backend": "bwrap", "persistent": True}},
    )[0]
    agent = Agent(spec)
    try:
        _, info = ToolTextEnv(task="toolmath").reset(options={"task_index": 0})  # the contexts it was taught on
        body = {"model": "counter", "n": 2, "seed": 0, "temperature": 0.0, "messages": info["messages"]}
        result = agent.run(agent.prepare(parse_chat_request(body)), threading.Event())
    finally:
        agent.front.close()
    assert live_interpreters() == 0
    counted = 0
    for choice in result["choices"]:
        outs = [c["output"].strip() for c in choice["message"]["arpo"]["tool_calls"]]
        if outs and all(o.isdigit() for o in outs):
            assert [int(o) for o in outs] == list(range(3, 3 + len(outs))), outs
            counted += len(outs) > 1
    assert counted >= 1, [c["message"]["arpo"]["trajectory"][:300] for c in result["choices"]]


def test_root_trajectories_seed_their_interpreters_from_the_run_seed_step_prompt_and_trajectory(tiny_model_dir):
    """Each root trajectory's session carries the seed its interpreter starts from: the same in two samplers with
    one seed, distinct across trajectories, steps and run seeds (the draws themselves: tests/arpo_env)."""
    tools = {"python": {"persistent": True}}

    def seeds(run_seed: int, step: int) -> list[int | None]:
        engine = HFEngine(tiny_model_dir, dtype="float32", seed=0)
        sampler = TreeSampler.from_config(
            engine,
            lambda: ToolTextEnv(task="toolmath", tools=tools, max_tool_calls=1),
            TreeConfig(budget=2, initial=2, branch_factor=1),
            RolloutsConfig(max_response_tokens=8),
            seed=run_seed,
        )
        try:
            ps = sampler._new_prompt(0, step)
            paths = [sampler._spawn(ps, "initial") for _ in range(2)]
            return [p.env.session.tool_seed for p in paths]
        finally:
            sampler.close()

    first = seeds(0, 1)
    assert first == seeds(0, 1) and None not in first and len(set(first)) == 2
    assert set(first).isdisjoint(seeds(0, 2)) and set(first).isdisjoint(seeds(1, 1))
