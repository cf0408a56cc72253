"""TreeSampler on the real ToolMath environment (real python tool) with a scripted engine and with the real HFEngine.

The scripted engine is a test double for the engine boundary only: it writes tool-using turns as text (so the real
environment runs real tool calls) with preset per-token entropies, which makes branching controllable.
"""

from __future__ import annotations

import math
import random

import pytest

from arpo_algo.core.tree import TreeConfig, aepo_initial_samples
from arpo_algo.models import byte_tokenizer
from arpo_algo.rollout.engines.base import Generation, GenRequest, SamplingParams, replay_tokens
from arpo_algo.rollout.sampler import TreeSampler
from arpo_base.errors import ArpoError
from arpo_env.core import ToolTextEnv

CALL = "<think>{c}</think><python>print({n}+1)</python>"
ANSWER = "<think>{c}</think><answer>\\boxed{{{n}}}</answer>"
#: A call whose output is the interpreter's next ``random`` and numpy draws.
DRAW = "<think>{c}</think><python>import random\nimport numpy\nprint(random.random(), numpy.random.rand())</python>"


class ScriptedEngine:
    """Continues contexts with scripted turns: tool calls until ``calls`` results are in the context, then an answer.

    The turn text is chosen from the request seed at the start of a turn and recovered from the partial text on
    continuation requests (the paper rule's look-ahead splits a turn). ``entropy(n_results, variant)`` gives the
    per-token entropy of a turn.
    """

    def __init__(self, calls=(0, 3), entropy=lambda n, v: 1.0 + 0.2 * v, fail=None, call=CALL):
        self.tokenizer = byte_tokenizer()
        self.calls, self.entropy, self.fail, self.call = calls, entropy, fail or (lambda req: False), call
        self.requests: list[GenRequest] = []
        self.generated = 0
        self.max_context = None  # unbounded (RolloutEngine interface)

    def _turn(self, n_results: int, variant: int, limit: int) -> str:
        tmpl = self.call if n_results < limit else ANSWER
        return tmpl.format(c="abcdefgh"[variant], n=variant)

    def generate(self, requests, *, on_token=None):
        out = []
        for req in requests:
            self.requests.append(req)
            if self.fail(req):
                out.append(Generation(req.request_id, [], [], [], "error", error=f"request {req.request_id}: boom"))
                continue
            text = self.tokenizer.decode(req.token_ids, skip_special_tokens=False)
            asst = text.rsplit("<|im_start|>assistant\n", 1)[-1]
            n_results = asst.count("</result>")
            partial = asst.rsplit("</result>", 1)[-1] if n_results else asst
            prompt_rng = random.Random(text.split("<|im_start|>assistant")[0])
            limit = prompt_rng.randint(*self.calls)
            if partial:
                variant = "abcdefgh".index(partial[len("<think>")])
            else:
                variant = random.Random(req.params.seed).randrange(8)
            full = self._turn(n_results, variant, limit)
            ids = self.tokenizer(full[len(partial) :], add_special_tokens=False)["input_ids"]
            finish, stop = ("stop", "</python>") if full.endswith("</python>") else ("eos", None)
            if finish == "eos":
                ids = ids + [self.tokenizer.eos_token_id]
            if len(ids) > req.params.max_new_tokens:
                ids, finish, stop = ids[: req.params.max_new_tokens], "length", None
            self.generated += len(ids)
            ent = self.entropy(n_results, variant)
            top = [[(0, -0.1), (1, -2.5)]] * len(ids) if req.params.logprobs_topk else None
            out.append(
                Generation(
                    req.request_id, ids, [-0.5] * len(ids), [ent] * len(ids), finish, stop_string=stop, top_logprobs=top
                )
            )
        replay_tokens(on_token, out)
        return out

    def release(self, cache_keys):
        pass

    def close(self):
        pass

    def load_state_dict(self, state_dict):
        pass

    def stats(self):
        n, self.generated = self.generated, 0
        return {"generated_tokens": float(n)}


@pytest.fixture(scope="module")
def env_creator(tmp_path_factory):
    cache = tmp_path_factory.mktemp("toolcache") / "python.sqlite"
    tools = {"python": {}, "cache": {"path": str(cache), "mode": "read_write"}}
    return lambda: ToolTextEnv(task="toolmath", tools=tools)


def _sampler(engine, env_creator, cfg, max_response_tokens=400, **kw):
    return TreeSampler(engine, env_creator, cfg, SamplingParams(), max_response_tokens=max_response_tokens, **kw)


def _check_group(g, cfg, tok, max_response_tokens):
    assert len(g.trajectories) == cfg.budget
    by_id = {t.traj_id: t for t in g.trajectories}
    for t in g.trajectories:
        assert len(t.response_ids) <= max_response_tokens
        assert t.finish_reason in ("answer", "eos", "length", "tool_limit", "turn_limit", "error")
        depth, cur = 0, t
        while cur.parent is not None:  # shares the parent's tokens up to the branch point
            par = by_id[cur.parent]
            assert cur.response_ids[: cur.branch_point] == par.response_ids[: cur.branch_point]
            assert cur.trained_mask[: cur.branch_point] == par.trained_mask[: cur.branch_point]
            depth, cur = depth + 1, par
        assert cfg.max_depth is None or depth <= cfg.max_depth
        # masked tokens are exactly the inserted tool results
        runs, cur_run = [], None
        for tid, m in zip(t.response_ids, t.trained_mask):
            if cur_run is None or cur_run[0] != m:
                cur_run = (m, [])
                runs.append(cur_run)
            cur_run[1].append(tid)
        for m, ids in runs:
            text = tok.decode(ids, skip_special_tokens=False)
            if m == 0:
                assert text.startswith(" <result>") and text.endswith("</result>"), text
            else:
                assert "<result>" not in text
        assert all(lp == 0.0 for lp, m in zip(t.old_logprobs, t.trained_mask) if m == 0)


CONFIGS = [
    TreeConfig(budget=6, initial=2, branch_factor=1),
    TreeConfig(budget=6, initial=2, branch_factor=2, decision_rule="reference", fillup="trickle"),
    TreeConfig(budget=5, initial=1, branch_factor=1, max_depth=1, decision_rule="reference"),
    TreeConfig.aepo(6, 2, decision_rule="reference", aepo_penalty_scope="prompt"),
    TreeConfig.aepo(6, 2, aepo_premonitor_keep=True),
    TreeConfig.grpo(4),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.decision_rule}-{c.fillup}-{c.max_depth}")
def test_budget_depth_masks_over_seeds(cfg, env_creator):
    eng = ScriptedEngine(entropy=lambda n, v: random.Random(n * 31 + v).uniform(0.0, 3.0))
    branched = 0
    for seed in range(4):
        s = _sampler(eng, env_creator, cfg, max_response_tokens=300, seed=seed)
        groups, metrics = s.sample([3, 8], step=seed)
        for g in groups:
            _check_group(g, cfg, eng.tokenizer, 300)
            branched += sum(t.kind == "branch" for t in g.trajectories)
        assert metrics["num_trajectories"] == 2 * cfg.budget
        s.close()
    if cfg.mode == "grpo":
        assert branched == 0
    else:
        assert branched > 0, "entropy swings of 3 nats must make some branches"


def test_the_premonitoring_trajectory_is_an_independent_sample(env_creator):
    """Bug: AEPO's extra, discarded pre-monitoring trajectory (aepo_premonitor_keep) numbered its path 0 and so drew
    the seeds of the real trajectory 0: a replay of it, not the reference's independent sample."""
    cfg = TreeConfig.aepo(6, 2, decision_rule="reference", aepo_premonitor_keep=True)
    eng = ScriptedEngine(calls=(2, 2), entropy=lambda n, v: 1.0)
    s = _sampler(eng, env_creator, cfg, seed=3)
    s.sample([4], step=1)
    s.close()
    first_turns = [r for r in eng.requests if r.request_id[1:] == (0, 1)]  # path 0's first request
    assert len(first_turns) == 2  # the pre-monitoring path's and trajectory 0's
    assert first_turns[0].params.seed != first_turns[1].params.seed


def test_same_seed_same_tree_and_different_seed_differs(env_creator):
    cfg = TreeConfig(budget=6, initial=2, branch_factor=1, decision_rule="reference")

    def run(seed):
        eng = ScriptedEngine(entropy=lambda n, v: random.Random(n * 7 + v).uniform(0.0, 3.0))
        groups, _ = _sampler(eng, env_creator, cfg, seed=seed).sample([1, 2], step=5)
        return [(t.response_ids, t.parent, t.branch_point, t.kind, t.reward) for g in groups for t in g.trajectories]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_paper_rule_lookahead_and_constant_entropy(env_creator):
    k = 10
    # constant entropy: dH = 0 -> the deterministic paper rule never branches; the budget is filled with fresh samples
    eng = ScriptedEngine(calls=(2, 2), entropy=lambda n, v: 1.0)
    cfg = TreeConfig(budget=4, initial=2, branch_factor=1, entropy_tokens=k)
    groups, m = _sampler(eng, env_creator, cfg).sample([0], step=0)
    assert m["rollout/branches"] == 0 and [t.kind for t in groups[0].trajectories].count("fillup") == 2
    # the request right after each tool result is a k-token look-ahead
    after_result = [r for r in eng.requests if eng.tokenizer.decode(r.token_ids).endswith("</result>")]
    assert after_result and all(r.params.max_new_tokens == k for r in after_result)
    # entropy rises after every tool result: every decision branches until the budget is spent, at once (no fill-up)
    eng = ScriptedEngine(calls=(2, 2), entropy=lambda n, v: 1.0 + n)
    groups, m = _sampler(eng, env_creator, cfg).sample([0], step=0)
    kinds = [t.kind for t in groups[0].trajectories]
    assert kinds.count("branch") == 2 and "fillup" not in kinds
    for t in groups[0].trajectories:
        if t.kind == "branch":  # branch point right after a tool result, before the look-ahead tokens
            par = groups[0].trajectories[t.parent]
            assert eng.tokenizer.decode(par.response_ids[: t.branch_point]).endswith("</result>")


@pytest.mark.parametrize("alpha", [0.2, 0.8])
def test_reference_rule_branches_with_probability_alpha_at_constant_entropy(env_creator, alpha):
    """dH = 0 at every decision: each decision branches with probability alpha (binomial, 4 sd tolerance)."""
    eng = ScriptedEngine(calls=(2, 3), entropy=lambda n, v: 1.0)
    cfg = TreeConfig(budget=12, initial=2, branch_factor=1, decision_rule="reference", fillup="trickle", alpha=alpha)
    branches = decisions = 0
    for seed in range(3):
        _, m = _sampler(eng, env_creator, cfg, seed=seed).sample([0, 1, 2, 3], step=0)
        branches, decisions = branches + m["rollout/branches"], decisions + m["rollout/branch_decisions"]
    assert decisions >= 60
    sd = (alpha * (1 - alpha) / decisions) ** 0.5
    assert abs(branches / decisions - alpha) < 4 * sd, (branches, decisions)


def test_every_branch_decision_is_kept_with_its_draws(env_creator):
    """Each decision that could have branched is in Group.decisions; under the reference rule its draws are the ones
    that decided (clone iff clip(u - beta * dH, 0, 1) <= alpha) and their count of clones made is the group's."""
    from arpo_algo.core.tree import reference_decision

    eng = ScriptedEngine(calls=(2, 3), entropy=lambda n, v: 1.0 + 0.3 * (n % 3))
    cfg = TreeConfig(budget=8, initial=2, branch_factor=2, decision_rule="reference", fillup="trickle", alpha=0.5)
    groups, m = _sampler(eng, env_creator, cfg).sample([0, 1], step=0)
    decisions = [d for g in groups for d in g.decisions]
    assert len(decisions) == m["rollout/branch_decisions"] > 0
    assert sum(d["branches"] for d in decisions) == m["rollout/branches"] > 0
    for d in decisions:
        assert d["rule"] == "reference" and len(d["draws"]) >= 1
        made = sum(reference_decision(cfg, d["h_now"] - d["h_init"], d["penalty_l"], u) for u in d["draws"])
        assert made == d["branches"]
    for g in groups:  # a branch starts where its decision was taken
        for t in g.trajectories:
            if t.kind == "branch":
                assert any(
                    d["trajectory"] == t.parent and d["at"] == t.branch_point and d["branches"] for d in g.decisions
                )


def test_aepo_path_scope_counter_in_the_sampler(env_creator):
    """AEPO paper rule, path scope, dH = 0.5 at every tool result: 0.6 * (1 - 0.1 l) > 0.5 branches for l <= 1 only.
    The first path decides at its 4 tool results with l = 0, 1, 2, 0: branch, branch, no, branch (the counter
    counts that path's consecutive branches and resets when it does not branch)."""
    eng = ScriptedEngine(calls=(4, 4), entropy=lambda n, v: 1.0 if n == 0 else 1.5)
    cfg = TreeConfig.aepo(64, 1, aepo_penalty=0.1, beta=0.2, tau=0.5, aepo_penalty_scope="path", aepo_premonitor=False)
    groups, _ = _sampler(eng, env_creator, cfg, max_response_tokens=600).sample([0], step=0)
    trajs = groups[0].trajectories
    first = trajs[0]
    results_at = [
        i + 1
        for i in range(len(first.response_ids) - 1)
        if first.trained_mask[i] == 0 and first.trained_mask[i + 1] == 1
    ]
    assert len(results_at) == 4
    children = sorted(t.branch_point for t in trajs if t.parent == 0)
    assert children == [results_at[0], results_at[1], results_at[3]]


def test_tool_limit_eos_mask_option(env_creator):
    for trained in (True, False):
        eng = ScriptedEngine(calls=(9, 9))  # more calls than the env's limit of 4
        groups, _ = _sampler(eng, env_creator, TreeConfig.grpo(2), train_tool_limit_eos=trained).sample([0], step=0)
        assert len(groups[0].trajectories) == 2  # the loop below checks both
        for t in groups[0].trajectories:
            assert t.finish_reason == "tool_limit" and len(t.tool_calls) == 4
            assert t.response_ids[-1] == eng.tokenizer.eos_token_id and t.trained_mask[-1] == int(trained)
            # appended, never sampled: its log-prob is unknown (0.0 would claim probability 1 to the learner)
            assert math.isnan(t.old_logprobs[-1]) and all(math.isfinite(x) for x in t.old_logprobs[:-1])
            assert t.unsampled == [len(t.response_ids) - 1]  # the mark, explicit: the value is only a placeholder


def test_length_budget_and_engine_error(env_creator):
    eng = ScriptedEngine(calls=(3, 3), fail=lambda r: r.request_id[1] == 1 and r.request_id[2] == 2)
    cfg = TreeConfig.grpo(3)
    groups, m = _sampler(eng, env_creator, cfg, max_response_tokens=70).sample([0], step=0)
    trajs = groups[0].trajectories
    assert len(trajs) == 3 and trajs[1].finish_reason == "error" and "boom" in trajs[1].reward_info["engine_error"]
    assert trajs[0].finish_reason == "length" and len(trajs[0].response_ids) == 70
    assert "score" in trajs[0].reward_info and m["rollout/engine_errors"] == 1


def test_prompt_overflow_policies(env_creator):
    eng = ScriptedEngine()
    with pytest.raises(ArpoError, match="task 7"):
        _sampler(eng, env_creator, TreeConfig.grpo(1), max_prompt_tokens=16).sample([7], step=0)
    groups, _ = _sampler(
        eng, env_creator, TreeConfig.grpo(1), max_prompt_tokens=16, prompt_overflow="left_truncate"
    ).sample([7], step=0)
    assert len(groups[0].prompt_ids) == 16


def test_aepo_lazy_premonitor_sets_m_from_probe(env_creator, tmp_path):
    eng = ScriptedEngine(calls=(1, 2), entropy=lambda n, v: 3.0 if n == 0 else 0.5 * v)
    cfg = TreeConfig.aepo(8, 2)
    groups, _ = _sampler(eng, env_creator, cfg).sample([0, 4], step=0)
    for g in groups:
        probe = g.trajectories[0]
        h_tool = probe.segment_entropy[1] if len(probe.segment_entropy) > 1 else probe.segment_entropy[0]
        m = aepo_initial_samples(8, probe.segment_entropy[0], h_tool)
        assert g.metrics["initial_samples"] == m
        assert [t.kind for t in g.trajectories[:m]] == ["initial"] * m
    assert len(groups) == 2 and all(len(g.trajectories) == 8 for g in groups)


def test_legacy_stale_baseline_persists_across_calls(env_creator):
    eng = ScriptedEngine(entropy=lambda n, v: 0.1 * v)
    s = _sampler(eng, env_creator, TreeConfig(budget=4, initial=2, legacy_stale_baseline=True))
    s.sample([0], step=0)
    first = dict(s._stale)
    s.sample([5], step=1)
    assert first and all(s._stale[k] == v for k, v in first.items())


def test_hf_engine_tiny_model_full_sample(tiny_model_dir, env_creator):
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    eng = HFEngine(str(tiny_model_dir))
    cfg = TreeConfig(budget=4, initial=2, branch_factor=1)
    s = _sampler(eng, env_creator, cfg, max_response_tokens=48, seed=0)
    groups, m = s.sample([0, 1], step=0)
    for g in groups:
        _check_group(g, cfg, eng.tokenizer, 48)
        assert g.prompt_ids == list(
            eng.tokenizer.apply_chat_template(
                ToolTextEnv(task="toolmath").reset(options={"task_index": g.prompt_index})[1]["messages"],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    assert m["num_trajectories"] == 8 and m["rollout/tokens_generated"] > 0


def test_arpo_without_branching_is_grpo_token_for_token(tiny_model_dir, env_creator):
    # The control "ARPO with Z = 0 must match GRPO": with no clone per branch decision the tree is N roots plus
    # M - N fill-ups from the prompt. Per-request seeds come from (seed, step, prompt, slot), so on the real engine
    # the group must hold exactly GRPO's M samples (same tokens, log-probs and rewards); any code-path difference
    # between the two (fill-up seeding, masks, finish handling) shows up here. The random tiny model writes no tool
    # call, so no look-ahead happens; the same control with SmolLM2 after SFT, where it does, is a run
    # (docs/results/stabilizers.md).
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    eng = HFEngine(str(tiny_model_dir))
    arpo = TreeConfig(budget=4, initial=2, branch_factor=0).validate()
    grpo = TreeConfig.grpo(4)
    got = {}
    for name, cfg in (("arpo", arpo), ("grpo", grpo)):
        groups, _ = _sampler(eng, env_creator, cfg, max_response_tokens=48, seed=3).sample([0, 1], step=2)
        got[name] = [
            sorted((tuple(t.response_ids), tuple(t.trained_mask), t.reward, t.finish_reason) for t in g.trajectories)
            for g in groups
        ]
        assert all(t.parent is None for g in groups for t in g.trajectories)
    assert got["arpo"] == got["grpo"]
    assert len({traj[0] for g in got["grpo"] for traj in g}) > 2  # sampled, not one repeated greedy answer


def test_groups_and_their_tree_records_carry_the_answer_from_the_task_list(env_creator):
    """The env's ``info`` withholds the answer by default; the sampler reads it from the task list, so the recorded
    trees (and the viewer that shows them) still hold it."""
    from arpo_algo.eval.trees import group_record

    s = _sampler(ScriptedEngine(), env_creator, TreeConfig.grpo(2), seed=0)
    groups, _ = s.sample([3, 8], step=0)
    s.close()
    env = env_creator()
    for g, index in zip(groups, [3, 8], strict=True):
        truth = env.tasks[index]["ground_truth"]
        assert g.task["ground_truth"] == truth and g.task["index"] == index
        assert group_record(g, 0, 0, str, None)["task"]["ground_truth"] == truth
