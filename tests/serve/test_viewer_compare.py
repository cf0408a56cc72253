"""``arpo eval`` records its runs as rollout trees; ``arpo view A B`` draws the same prompt's trees of two models side
by side (headless chromium); the token strip's learner and |delta log p| colourings follow the recorded values."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from arpo_algo.cli.main import main
from arpo_algo.eval.trees import TreeReader, TreeWriter
from arpo_algo.rollout.types import Group, Trajectory, TreeNode
from tests.serve.test_viewer import KEY, Viewer, _open, browser  # noqa: F401  (browser: the shared fixture)

FAST = ["--data", "toolmath", "--limit", "2", "--k", "2", "--max-response-tokens", "24", "--no-progress", "--no-charts"]


@pytest.fixture(scope="module")
def evaluation(tiny_model_dir, tmp_path_factory) -> Path:
    """One evaluation of two different tiny models ("first", "second"), trees recorded by default."""
    from arpo_algo.models import build_tiny_model

    root = tmp_path_factory.mktemp("evaltrees")
    second = build_tiny_model(root / "second_model", num_layers=2, hidden_size=64, seed=1)
    out = root / "eval"
    assert main(["eval", f"first={tiny_model_dir}", f"second={second}", *FAST, "--output", str(out)]) == 0
    return out


def _groups(folder: Path) -> list[dict]:
    reader = TreeReader(folder)
    reader.refresh()
    return [reader.group(it, 0) for it in sorted(reader.iterations)]


def test_eval_records_each_items_runs_as_a_tree(evaluation, tmp_path):
    samples = [json.loads(x) for x in (evaluation / "samples.jsonl").read_text().splitlines()]
    for label in ("first", "second"):
        folder = evaluation / "trees" / label
        assert json.loads((folder / "format.json").read_text())["source"] == "eval"
        recs = _groups(folder)
        assert [r["prompt_index"] for r in recs] == [0, 1] and [r["iteration"] for r in recs] == [1, 2]
        for rec in recs:
            rows = sorted(
                (r for r in samples if r["model"] == label and r["index"] == rec["prompt_index"]),
                key=lambda r: r["run"],
            )
            assert rec["task"]["item_id"] == rows[0]["item_id"]
            assert [t["id"] for t in rec["trajectories"]] == [r["run"] for r in rows] == [0, 1]
            assert [t["reward"] for t in rec["trajectories"]] == [round(r["reward"], 4) for r in rows]
            assert [len(t["response_ids"]) for t in rec["trajectories"]] == [r["response_tokens"] for r in rows]
            assert [t["finish_reason"] for t in rec["trajectories"]] == [r["finish_reason"] for r in rows]
            assert len(rec["nodes"]) == 3 and rec["nodes"][0]["end"] == 0  # the prompt, one child per run
    # opt-out, like training's rollouts.record_trees = false
    off = tmp_path / "off"
    assert (
        main(
            [
                "eval",
                f"first={evaluation.parent / 'second_model'}",
                *FAST,
                "--limit",
                "1",
                "--no-trees",
                "--output",
                str(off),
            ]
        )
        == 0
    )
    assert (off / "samples.jsonl").is_file() and not (off / "trees").exists()


def test_an_evaluation_of_two_models_is_named_one_by_one(evaluation, capsys):
    assert main(["view", str(evaluation)]) == 2
    err = capsys.readouterr().err
    assert "first, second" in err and "arpo view" in err
    assert main(["view", str(evaluation), str(evaluation), str(evaluation)]) == 2
    assert "at most two" in capsys.readouterr().err


def test_view_a_b_draws_the_same_prompt_side_by_side(browser, evaluation):  # noqa: F811
    a, b = evaluation / "trees" / "first", evaluation / "trees" / "second"
    v = Viewer(a, b)
    try:
        _open(browser, f"{v.url}/#key={KEY}")
        browser.wait("return document.querySelectorAll('#tree-b .node').length > 0", what="no compared tree")
        assert browser.js("return [...document.querySelectorAll('.side-label')].map(e => e.textContent)") == [
            "first",
            "second",
        ]
        for it, (ra, rb) in enumerate(zip(_groups(a), _groups(b)), 1):
            assert ra["prompt"] == rb["prompt"] and ra["trajectories"] != rb["trajectories"]  # two models differ
            browser.js(
                f"const s = document.getElementById('iteration'); s.value = '{it}'; "
                "s.dispatchEvent(new Event('change'))"
            )
            browser.wait(
                f"return document.querySelector('#tree-b .meta') && document.querySelector('#tree-b .meta')"
                f".textContent.startsWith('iteration {it} · prompt {rb['prompt_index']} ')"
            )
            leaves = browser.js("return [...document.querySelectorAll('#tree-b .leaf')].map(e => e.textContent)")
            assert leaves == [
                f"trajectory {t['id']} · reward {t['reward']:.2f} · {t['finish_reason']}" for t in rb["trajectories"]
            ]
            assert browser.js("return document.querySelectorAll('#tree-b .node').length") == len(rb["nodes"])
            assert browser.js("return document.querySelectorAll('#tree .node').length") == len(ra["nodes"])
        # a node of the compared tree shows that model's text
        node = max(rb["nodes"], key=lambda n: n["end"])
        browser.js(f"document.querySelector('#tree-b .node[data-node=\"{node['id']}\"]').click()")
        browser.wait("return document.querySelector('#detail h3')")
        assert browser.js("return document.querySelector('#detail .meta').textContent") == "second"
        shown = browser.js("return [...document.querySelectorAll('#detail .node-text pre')].map(e => e.textContent)")
        assert shown == [r[1] for r in node["text"]]
    finally:
        v.stop()


def _mismatch_folder(root: Path) -> tuple[Path, list[float], list[float], list[int]]:
    """The real writer on a hand-made group whose learner log-probs differ from the sampler's by chosen amounts."""
    from arpo_algo.models import byte_tokenizer

    tok = byte_tokenizer()
    ids = tok.encode("<python>1</python>RESULT<answer>1</answer>", add_special_tokens=False)
    mask = [1] * 17 + [0] * 6 + [1] * (len(ids) - 23)
    sampled = [-0.1 * (i % 7) for i in range(len(ids))]
    diffs = [0.0, 0.01, 0.05, 0.2, 0.4, 0.8, 3.0]
    learner = [s - diffs[i % 7] if m else math.nan for i, (s, m) in enumerate(zip(sampled, mask))]
    t = Trajectory(0, ids, mask, sampled, [0.5] * len(ids), reward=1.0, finish_reason="answer", node_ids=[0, 1])
    g = Group(
        3,
        tok.encode("What is 1?", add_special_tokens=False),
        [t],
        nodes=[TreeNode(0, None, 0, 0, 0, 0), TreeNode(1, 0, 0, len(ids), 1, 0)],
        policy_version=0,
    )
    folder = root / "mismatch"
    TreeWriter(folder, lambda x: tok.decode(x)).record(1, [g], [[[1.0] * len(ids)]], [[learner]])
    return folder, sampled, learner, mask


def _alpha(css: str) -> float:
    m = re.search(r"rgba\(\d+, \d+, \d+(?:, ([\d.]+))?\)|rgb\(", css)
    assert m, css
    return float(m.group(1)) if m.group(1) is not None else 1.0


def test_token_colours_follow_the_learner_values(browser, tmp_path):  # noqa: F811
    folder, sampled, learner, mask = _mismatch_folder(tmp_path)
    v = Viewer(folder)
    try:
        _open(browser, f"{v.url}/#key={KEY}")
        browser.js("document.querySelector('.node[data-node=\"1\"]').click()")
        browser.wait("return document.querySelector('#detail select#colour')")
        for mode, expect in (("abs_dlogp", lambda s, lp: abs(s - lp)), ("learner_logprob", lambda s, lp: lp)):
            browser.js(
                f"const c = document.getElementById('colour'); c.value = '{mode}'; c.dispatchEvent(new Event('change'))"
            )
            browser.wait(f"return document.getElementById('colour').value === '{mode}'")
            cells = browser.js(
                "return [...document.querySelectorAll('#detail .strip .tok')].map(e => "
                "[e.dataset.value === undefined ? null : Number(e.dataset.value), "
                "getComputedStyle(e).backgroundColor, e.classList.contains('inserted')])"
            )
            assert len(cells) == len(mask)
            pairs = []
            for (value, css, inserted), s, lp, m in zip(cells, sampled, learner, mask):
                assert inserted == (m == 0)
                if m == 0:
                    assert value is None
                    continue
                want = expect(round(s, 4), round(lp, 4))
                assert value == pytest.approx(want, abs=1e-6)
                pairs.append((abs(want), _alpha(css)))
            # the colour's strength rises with the magnitude: no mismatch is blank, a large one saturates
            pairs.sort()
            assert all(a1 <= a2 for (_, a1), (_, a2) in zip(pairs, pairs[1:])), pairs
            assert pairs[0][1] == 0.0 and pairs[-1][1] > 0.5
            if mode == "abs_dlogp":
                assert pairs[-1][1] == 1.0  # 3 nats off: as strong as it gets
            assert len({a for _, a in pairs}) >= 5
    finally:
        v.stop()


def test_a_prompt_the_other_side_lacks_says_so(browser, evaluation, tmp_path):  # noqa: F811
    folder, *_ = _mismatch_folder(tmp_path)
    v = Viewer(evaluation / "trees" / "first", folder)
    try:
        _open(browser, f"{v.url}/#key={KEY}")
        text = browser.wait("const b = document.querySelector('#tree-b .hint'); return b && b.textContent")
        assert text == "no tree of this prompt in mismatch"
        assert browser.js("return document.querySelectorAll('#tree-b .node').length") == 0
    finally:
        v.stop()
