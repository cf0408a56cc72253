"""arpo_algo/eval/render_trees.py on a real dump: the sampler on ToolMath with the scripted engine."""

from __future__ import annotations

import html
import json

import pytest

from arpo_algo.core.tree import TreeConfig
from arpo_algo.eval.render_trees import load_groups, main, render
from arpo_algo.models import byte_tokenizer
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv
from tests.arpo_algo.rollout.test_sampler import ScriptedEngine


@pytest.fixture()
def env_creator(tmp_path):
    return lambda: ToolTextEnv(task="toolmath", tools={"python": {}, "cache": {"path": str(tmp_path / "c.sqlite")}})


def test_render_one_iteration_draws_shared_prefixes_once(env_creator, tmp_path):
    eng = ScriptedEngine(calls=(2, 2), entropy=lambda n, v: 1.0 + n)  # entropy rises after results: branches
    dump = tmp_path / "trees.jsonl"
    s = TreeSampler(eng, env_creator, TreeConfig(budget=4, initial=2, branch_factor=1, entropy_tokens=10),
                    SamplingParams(), max_response_tokens=400, dump_path=str(dump))
    s.sample([0], step=0)
    groups1, _ = s.sample([1], step=1)
    step, groups = load_groups(tmp_path, None)
    assert step == 1 and [g["prompt_index"] for g in groups] == [1]
    tok = byte_tokenizer()
    page = render(groups, step, lambda ids: tok.decode(ids))
    g = groups1[0]
    roots = sum(t.parent is None for t in g.trajectories)
    branches = sum(t.kind == "branch" for t in g.trajectories)
    assert branches >= 1 and page.count("branch point at token") >= 1
    # the first turn is drawn once per independent root, not once per trajectory
    first = g.trajectories[0].response_ids[:10]
    same = sum(t.parent is None and t.response_ids[:10] == first for t in g.trajectories)
    assert page.count(html.escape(tok.decode(first))) == same and roots < len(g.trajectories)
    assert page.count("trajectory ") == len(g.trajectories) and "<script" not in page
    assert main([str(dump), "--iteration", "0", "--output", str(tmp_path / "p.html")]) == 0
    assert (tmp_path / "p.html").read_text().startswith("<!doctype html>")
    assert json.loads(dump.read_text().splitlines()[0])["metrics"]["step"] == 0
