"""``arpo view`` on a tiny model's real training run: the page in headless chromium, the export from a file URL, the
guard in front of the data, and bad input (a folder without trees, a torn chunk, a newer format)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arpo_algo.cli.main import main
from arpo_algo.eval.trees import INDEX, VERSION, TreeReader, TreeWriter
from arpo_algo.rollout.types import Group, Trajectory, TreeNode
from arpo_base.http import HTTPJSONError, get_json
from tests.arpo_algo.run.test_train_cli import write_experiment
from tests.browser import WebDriver, find_browser, free_port

KEY = "viewer-test-key-0123456789"
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


SEEN_LIVE: list[int] = []  # the iterations `arpo train --view`'s viewer served while the run trained


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """Two iterations of ARPO on the tiny model, trees recorded by default (2 prompts x 4 trajectories), trained
    with ``--view``: a thread polls that viewer during the training."""
    root = tmp_path_factory.mktemp("viewrun")
    exp = write_experiment(root, tiny_model_dir, iterations=2)
    text = (
        exp.read_text()
        .replace("prompts_per_step = 1", "prompts_per_step = 2")
        .replace("budget = 2", "budget = 4")
        .replace("initial = 1", "initial = 2")
    )
    exp.write_text(text)
    out, port, done = root / "run", free_port(), threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                rows = get_json(
                    f"http://127.0.0.1:{port}/v1/index", headers={"Authorization": f"Bearer {KEY}"}, timeout=2
                )["rows"]
                SEEN_LIVE[:] = sorted({*SEEN_LIVE, *(r["iteration"] for r in rows)})
            except HTTPJSONError:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    saved = os.environ.get("ARPO_VIEW_KEY")
    os.environ["ARPO_VIEW_KEY"] = KEY
    watcher.start()
    try:
        assert main(["train", str(exp), "--output", str(out), "--no-progress", "--view", "--view-port", str(port)]) == 0
    finally:
        done.set()
        watcher.join(10)
        if saved is None:
            os.environ.pop("ARPO_VIEW_KEY")
        else:
            os.environ["ARPO_VIEW_KEY"] = saved
    return out


def test_train_view_serves_the_run_while_it_trains(run_dir, capsys):
    assert SEEN_LIVE and set(SEEN_LIVE) <= {1, 2}  # at least the first iteration, seen before the training ended


def test_training_records_the_learners_logprobs(run_dir):
    """The learner's log-probs of the update (before its first step) are recorded per token: null on tool-result
    tokens, finite on every sampled one, and next to the sampler's (the in-process engine shares the weights)."""
    import math

    diffs = []
    for it in (1, 2):
        for rec in _records(run_dir, it):
            for t in rec["trajectories"]:
                lp = t["learner_logprobs"]
                assert len(lp) == len(t["response_ids"])
                for m, s, v in zip(t["trained_mask"], t["sampled_logprobs"], lp):
                    assert (v is None) == (m == 0), (m, v)
                    if m and s is not None:
                        assert math.isfinite(v) and v <= 1e-4
                        diffs.append(abs(s - v))
    assert diffs and max(diffs) < 0.01, max(diffs)


def test_recorded_trees_hold_the_answer_from_the_task_list(run_dir):
    """The env withholds the answer from ``info``; the trees (and so the viewer) get it from the task list."""
    from arpo_env.core import ToolTextEnv

    env = ToolTextEnv(task="toolmath", levels=[1])
    for rec in _records(run_dir, 1):
        assert rec["task"]["ground_truth"] == env.tasks[rec["task"]["index"]]["ground_truth"]


def _records(run_dir: Path, iteration: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trees" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]


class Viewer:
    """``arpo view FOLDER`` as a user starts it, in a subprocess."""

    def __init__(self, *folders: Path) -> None:
        self.port = free_port()
        env = dict(os.environ, ARPO_VIEW_KEY=KEY, PYTHONPATH=os.getcwd())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arpo_algo.cli", "view", *map(str, folders), "--port", str(self.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                get_json(f"{self.url}/v1/index", headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
                break
            except HTTPJSONError:
                assert self.proc.poll() is None, self.proc.communicate()
                assert time.monotonic() < deadline, "the viewer did not start"
                time.sleep(0.2)

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return out


def _copy_iteration(src: Path, dst: Path, iteration: int) -> None:
    """What a training writes for one iteration, in its order: the chunk, then the index line."""
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "format.json", dst / "format.json")
    name = f"iter_{iteration:06d}.jsonl"
    shutil.copy(src / name, dst / name)
    line = next(x for x in (src / INDEX).read_text().splitlines() if json.loads(x)["iteration"] == iteration)
    with open(dst / INDEX, "a") as f:
        f.write(line + "\n")


def _hostile_folder(root: Path) -> Path:
    """The real writer on a hand-made group: one solved trajectory whose tool result holds markup, one failed."""
    from arpo_algo.models import byte_tokenizer

    tok = byte_tokenizer()
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call, result, answer = ids("<python>print(1)</python>"), ids(HOSTILE), ids("<answer>1</answer>")
    resp = call + result + answer
    mask = [1] * len(call) + [0] * len(result) + [1] * len(answer)
    a = Trajectory(
        0,
        resp,
        mask,
        [-0.5] * len(resp),
        [0.7] * len(resp),
        reward=1.0,
        finish_reason="answer",
        tool_calls=[{"tool": "python", "args": {"code": "print(1)"}}],
        node_ids=[0, 1],
    )
    fail = call + ids("x")
    b = Trajectory(
        1,
        fail,
        [1] * len(fail),
        [-1.0] * len(fail),
        [2.0] * len(fail),
        reward=0.0,
        parent=0,
        branch_point=len(call),
        kind="branch",
        finish_reason="eos",
        node_ids=[0, 2],
    )
    nodes = [
        TreeNode(0, None, 0, len(call), 0, 0),
        TreeNode(1, 0, len(call), len(resp), 1, 0),
        TreeNode(2, 0, len(call), len(fail), 1, 0),
    ]
    g = Group(7, ids("What is 1?"), [a, b], nodes=nodes, policy_version=0)
    folder = root / "hostile"
    TreeWriter(folder, lambda x: tok.decode(x)).record(1, [g], [[[1.0] * len(resp), [-1.0] * len(fail)]])
    return folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, chromedriver = find_browser()
    wd = WebDriver(chromedriver, chromium, str(tmp_path_factory.mktemp("profile")))
    yield wd
    wd.close()


@pytest.fixture(scope="module")
def live(run_dir, tmp_path_factory):
    """A viewer over a folder holding iteration 1 only (iteration 2 is written while the page is open)."""
    folder = tmp_path_factory.mktemp("live") / "trees"
    _copy_iteration(run_dir / "trees", folder, 1)
    v = Viewer(folder)
    yield v, folder
    v.stop()


def _open(wd: WebDriver, url: str) -> None:
    wd.open("about:blank")
    wd.open(url)
    wd.wait(
        "return document.querySelectorAll('#groups .group-item').length > 0 && "
        "document.querySelectorAll('#tree .node').length > 0",
        what="the page never drew a tree",
    )


def test_page_shows_every_recorded_tree_node_and_leaf(browser, live, run_dir):
    v, _ = live
    _open(browser, f"{v.url}/#key={KEY}")
    recs = _records(run_dir, 1)
    assert browser.js("return document.querySelectorAll('#groups .group-item').length") == len(recs) == 2
    for i, rec in enumerate(recs):
        browser.js(f"document.querySelector('.group-item[data-group=\"{i}\"]').click()")
        browser.wait(
            f"return document.querySelector('#tree .meta').textContent.includes('prompt {rec['prompt_index']} ')"
        )
        parents = {n["parent"] for n in rec["nodes"]}
        leaf_nodes = {n["id"] for n in rec["nodes"] if n["id"] not in parents}
        assert browser.js("return document.querySelectorAll('#tree .node').length") == len(rec["nodes"])
        assert browser.js("return document.querySelectorAll('#tree .leaf').length") == len(rec["trajectories"]) == 4
        drawn = browser.js(
            "return [...document.querySelectorAll('#tree .leaf')].map(e => "
            "Number(e.parentElement.querySelector(':scope > .node').dataset.node))"
        )
        assert set(drawn) == leaf_nodes
        branches = sum("branch" in n for n in rec["nodes"])
        assert browser.js("return document.querySelectorAll('#tree .branch').length") == branches
        answer = browser.js("return document.querySelector('#tree .answer').textContent")
        assert answer == f"answer: {rec['task']['ground_truth']}"  # from the task list: info withholds it
    # the page fetched its own files, the index and each group it showed once: nothing else, nothing ahead
    paths = browser.js("return performance.getEntriesByType('resource').map(e => new URL(e.name).pathname)")
    assert set(paths) <= {"/viewer.js", "/viewer.css", "/v1/index", "/v1/group"}, paths
    assert paths.count("/v1/group") == len(recs)


def test_clicking_a_node_shows_its_decoded_text(browser, live, run_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    v, _ = live
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    _open(browser, f"{v.url}/#key={KEY}")
    rec = _records(run_dir, 1)[0]
    node = max(rec["nodes"], key=lambda n: n["end"] - n["start"])
    owner = next(t for t in rec["trajectories"] if node["id"] in t["node_ids"])
    ids, mask = owner["response_ids"][node["start"] : node["end"]], owner["trained_mask"][node["start"] : node["end"]]
    runs, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        runs.append(tok.decode(ids[i:j], skip_special_tokens=False))
        i = j
    browser.js(f"document.querySelector('.node[data-node=\"{node['id']}\"]').click()")
    browser.wait(
        f"return document.querySelector('#detail h3') && "
        f"document.querySelector('#detail h3').textContent === 'node {node['id']}'"
    )
    shown = browser.js("return [...document.querySelectorAll('#detail .node-text pre')].map(e => e.textContent)")
    assert shown == runs and "".join(runs)
    # one cell per token, the inserted (tool-result) ones marked, each with its recorded entropy in the tooltip
    assert browser.js("return document.querySelectorAll('#detail .strip .tok').length") == len(ids)
    assert browser.js("return document.querySelectorAll('#detail .strip .tok.inserted').length") == mask.count(0)
    k = mask.index(1)
    tip = browser.js(f"return document.querySelectorAll('#detail .strip .tok')[{k}].title")
    shown_entropy = float(tip.split(" · entropy ")[1].split(" ")[0])
    assert abs(shown_entropy - owner["entropies"][node["start"] + k]) <= 0.0006, tip


@pytest.fixture
def growing(run_dir, tmp_path):
    """A viewer of its own over iteration 1, for the test that adds iteration 2: the module's ``live`` viewer keeps
    showing iteration 1 only, whatever order the tests run in."""
    folder = tmp_path / "trees"
    _copy_iteration(run_dir / "trees", folder, 1)
    v = Viewer(folder)
    yield v, folder
    v.stop()


def test_a_new_iteration_appears_without_a_reload(browser, growing, run_dir):
    v, folder = growing
    _open(browser, f"{v.url}/#key={KEY}")
    browser.js("window.__sameDocument = true")
    assert browser.js("return [...document.querySelectorAll('#iteration option')].map(o => o.value)") == ["1"]
    _copy_iteration(run_dir / "trees", folder, 2)
    browser.wait(
        "return [...document.querySelectorAll('#iteration option')].map(o => o.value).join() === '1,2'",
        what="iteration 2 never appeared",
    )
    assert browser.js("return window.__sameDocument") is True  # no reload happened
    # the chart grew a column for it, and a click on that column opens iteration 2
    assert browser.js("return document.querySelectorAll('#chart .chart-col').length") == 2
    browser.js(
        "document.querySelector('#chart .chart-col[data-iteration=\"2\"]')"
        ".dispatchEvent(new MouseEvent('click', {bubbles: true}))"
    )
    browser.wait("return document.querySelector('#tree .meta').textContent.startsWith('iteration 2 ')")


def test_permalink_opens_the_node(browser, live, run_dir):
    v, _ = live
    _open(browser, f"{v.url}/#key={KEY}")  # the key stays in the tab's session storage
    rec = _records(run_dir, 1)[1]
    node = rec["nodes"][-1]
    _open(browser, f"{v.url}/#it=1&g=1&n={node['id']}")
    browser.wait(
        f"return document.querySelector('#detail h3') && "
        f"document.querySelector('#detail h3').textContent === 'node {node['id']}'"
    )
    assert browser.js(
        f"return document.querySelector('.node[data-node=\"{node['id']}\"]').classList.contains('selected')"
    )
    assert browser.js("return document.querySelector('#tree .meta').textContent").startswith(
        f"iteration 1 · prompt {rec['prompt_index']} "
    )


def test_hostile_text_is_text_and_the_failed_filter(browser, tmp_path):
    v = Viewer(_hostile_folder(tmp_path))
    try:
        _open(browser, f"{v.url}/#key={KEY}")
        browser.js("document.querySelector('.node[data-node=\"1\"]').click()")
        browser.wait("return document.querySelector('#detail .toolcard')")
        assert browser.js("return document.querySelector('#detail .toolcard pre').textContent") == HOSTILE
        assert browser.js("return window.__pwned") is None
        assert browser.js("return document.querySelectorAll('#detail script, #detail img').length") == 0
        assert browser.js("return document.querySelectorAll('#tree .leaf').length") == 2
        browser.js(
            "const f = document.getElementById('filter'); f.value = 'failed'; f.dispatchEvent(new Event('change'))"
        )
        browser.wait("return document.querySelectorAll('#tree .leaf').length === 1")
        assert browser.js("return [...document.querySelectorAll('#tree .leaf')].map(e => e.dataset.traj)") == ["1"]
        assert browser.js("return document.querySelectorAll('#tree .node[data-node=\"1\"]').length") == 0
        assert browser.js("return [...document.querySelectorAll('#tree .node')].map(e => e.dataset.node)") == ["0", "2"]
    finally:
        v.stop()


def test_export_opens_from_a_file_url_without_network(browser, run_dir, tmp_path, capsys):
    out = tmp_path / "trees.html"
    assert main(["view", str(run_dir), "--export", str(out), "--iteration", "1,2"]) == 0
    assert "iterations 1, 2" in capsys.readouterr().out
    _open(browser, out.as_uri())
    assert browser.js("return [...document.querySelectorAll('#iteration option')].map(o => o.value)") == ["1", "2"]
    rec = _records(run_dir, 2)[0]
    browser.js("const s = document.getElementById('iteration'); s.value = '2'; s.dispatchEvent(new Event('change'))")
    browser.wait("return document.querySelector('#tree .meta').textContent.startsWith('iteration 2 ')")
    assert browser.js("return document.querySelectorAll('#tree .node').length") == len(rec["nodes"])
    assert browser.js("return performance.getEntriesByType('resource').length") == 0  # nothing fetched


def test_export_escapes_the_embedded_data(tmp_path):
    out = tmp_path / "h.html"
    assert main(["view", str(_hostile_folder(tmp_path)), "--export", str(out)]) == 0
    page = out.read_text()
    assert HOSTILE not in page and "<script>window.__pwned" not in page
    assert page.count("<script") == 2  # the data block and the viewer's own script


def test_the_guard_and_the_page_headers(live):
    import requests

    v, _ = live
    r = requests.get(f"{v.url}/", timeout=5)  # the page itself holds no data: no key needed
    csp, body = r.headers["Content-Security-Policy"], r.text
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    assert '<script src="viewer.js"></script>' in body and "<script>" not in body
    with pytest.raises(HTTPJSONError) as e:
        get_json(f"{v.url}/v1/index", timeout=5)  # no key
    assert e.value.status == 401
    with pytest.raises(HTTPJSONError) as e:
        get_json(f"{v.url}/v1/index", headers={"Authorization": f"Bearer {KEY}", "Host": "evil.example"}, timeout=5)
    assert e.value.status == 403
    with pytest.raises(HTTPJSONError) as e:
        get_json(f"{v.url}/v1/group?iteration=1&group=99", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    assert e.value.status == 404


def test_bad_input(tmp_path, run_dir, capsys):
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no rollout trees" in err and "arpo train" in err
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "format.json").write_text(json.dumps({"format": "arpo-trees", "version": VERSION + 1}))
    assert main(["view", str(newer)]) == 2
    assert f"format version {VERSION + 1}" in capsys.readouterr().err
    # a chunk cut short after its index line was written (a crash, a full disk): that iteration is skipped
    torn = tmp_path / "torn"
    for it in (1, 2):
        _copy_iteration(run_dir / "trees", torn, it)
    chunk = torn / "iter_000002.jsonl"
    chunk.write_bytes(chunk.read_bytes()[:-50])
    with open(torn / INDEX, "a") as f:
        f.write('{"iteration": 3, "chunk": "iter_0000')  # a torn last index line: waits, then is never trusted
    reader = TreeReader(torn)
    assert reader.refresh() == [1]
    assert reader.group(1, 0)["iteration"] == 1


def test_the_viewer_never_takes_or_prints_the_serving_key(run_dir):
    """Bug: with ARPO_API_KEY set (the serving key), the viewer used it as its own and printed it in the address,
    so the serving key landed in terminal logs; now the viewer's key is its own (ARPO_VIEW_KEY, a file, or fresh)."""
    port, serving = free_port(), "the-serving-key-do-not-print"
    env = {k: v for k, v in os.environ.items() if k != "ARPO_VIEW_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo_algo.cli", "view", str(run_dir), "--port", str(port)],
        env=dict(env, ARPO_API_KEY=serving, PYTHONPATH=os.getcwd()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "#key=" in line and serving not in line, line
        fresh = line.strip().rsplit("#key=", 1)[1]
        url = f"http://127.0.0.1:{port}/v1/index"
        deadline = time.monotonic() + 60
        while True:
            try:
                get_json(url, headers={"Authorization": f"Bearer {fresh}"}, timeout=2)  # the printed key opens it
                break
            except HTTPJSONError:
                assert proc.poll() is None and time.monotonic() < deadline, "the viewer did not start"
                time.sleep(0.2)
        with pytest.raises(HTTPJSONError) as e:
            get_json(url, headers={"Authorization": f"Bearer {serving}"}, timeout=5)
        assert e.value.status == 401
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=10)
    assert serving not in rest


def test_turn_credit_shows_node_values_and_turn_advantages(browser, tmp_path):
    """A run trained with ``training.advantage = "turn"``: each node shows its value, the detail pane its turns."""
    from arpo_algo.eval.trees import token_advantages
    from arpo_algo.train.learner_config import LearnerConfig
    from tests.arpo_algo.eval.test_trees import _branched, _decode

    g = _branched()
    (credit,) = token_advantages([g], LearnerConfig(advantage="turn", norm_adv_by_std=False))
    TreeWriter(tmp_path / "trees", _decode).record(1, [g], [credit.advantages], None, [credit.values])
    v = Viewer(tmp_path / "trees")
    try:
        _open(browser, f"{v.url}/#key={KEY}")
        chips = (
            "return [...document.querySelectorAll('#tree .node')]"
            ".map(e => [e.dataset.node, e.querySelector('.value-chip')?.textContent])"
        )
        assert browser.js(chips) == [["0", "V 0.50"], ["1", "V 1.00"], ["2", "V 0.00"]]
        browser.js("document.querySelector('.node[data-node=\"2\"]').click()")
        browser.wait("return document.querySelector('#detail .turns')")
        assert browser.js("return document.querySelector('#detail .meta.value').textContent") == "value 0.000"
        turns = browser.js("return [...document.querySelectorAll('#detail .turns li')].map(e => e.textContent)")
        assert turns == ["turn, tokens 15–18: value 0.500 → 0.000 · advantage -0.500"]
        browser.js("document.querySelector('.leaf[data-traj=\"0\"]').click()")
        browser.wait("return document.querySelector('#detail .path-values')")
        line = browser.js("return document.querySelector('#detail .path-values').textContent")
        assert line.endswith("0: 0.500 → 15: 0.500 → 17: 1.000")
    finally:
        v.stop()
