"""What the ``arpo view`` page fetches on a large tree folder, counted in headless chromium.

A folder of ``--prompts`` groups x ``--trajectories`` trajectories x ``--iterations`` iterations is written with the
real :class:`~arpo_algo.eval.trees.TreeWriter` (hand-made groups over a byte tokenizer: a shared tool call and tool
result, then one answer per trajectory), ``arpo view`` is started on it in a subprocess (127.0.0.1, a fresh key), and
the page is opened in headless chromium. After each of three steps (the first load, switching to the first iteration,
opening another prompt) the requests the step added are read from ``performance`` (navigation and resource entries):
their number, paths, bytes transferred, and whether every one went to the viewer's own origin.

The page polls ``/v1/index?since=N`` every two seconds; such polls that fall inside a step are counted and listed
apart. Needs chromium and chromedriver.

    python -m benchmarks.bench_viewer_requests --out viewer-requests.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo_algo.eval.trees import INDEX, TreeWriter
from arpo_algo.rollout.types import Group, Trajectory, TreeNode
from arpo_base.http import HTTPJSONError, get_json

#: The page's own files and the two data routes: everything the page may request.
ALLOWED = {"/", "/viewer.js", "/viewer.css", "/v1/index", "/v1/group"}

ENTRIES = """return [...performance.getEntriesByType('navigation'), ...performance.getEntriesByType('resource')]
  .map(e => ({url: e.name, type: e.entryType, transfer: e.transferSize, body: e.encodedBodySize,
              same_origin: new URL(e.name).origin === location.origin}))"""


def make_group(tok: Any, prompt: int, trajectories: int, iteration: int) -> tuple[Group, list[list[float]]]:
    """One prompt's tree: node 0 is the shared tool call and its result (the result masked), and every trajectory
    adds its own answer as a child node; the first is the initial sample, the others branch after node 0."""
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call, result = ids(f"<python>print({prompt} * {iteration})</python>"), ids(f"<result>{prompt * iteration}</result>")
    shared = call + result
    mask0 = [1] * len(call) + [0] * len(result)
    trajs, nodes = [], [TreeNode(0, None, 0, len(shared), 0, iteration)]
    advantages = []
    for t in range(trajectories):
        answer = ids(f"<answer>{prompt * iteration + t % 3}</answer>")
        resp, mask = shared + answer, mask0 + [1] * len(answer)
        solved = t % 3 == 0
        trajs.append(
            Trajectory(
                t,
                resp,
                mask,
                [-0.3] * len(resp),
                [0.6 + 0.01 * t] * len(resp),
                reward=1.0 if solved else 0.0,
                finish_reason="answer",
                tool_calls=[{"tool": "python", "args": {"code": f"print({prompt} * {iteration})"}}],
                parent=None if t == 0 else 0,
                branch_point=None if t == 0 else len(shared),
                kind="initial" if t == 0 else "branch",
                node_ids=[0, t + 1],
                policy_version=iteration,
            )
        )
        nodes.append(TreeNode(t + 1, 0, len(shared), len(resp), 1, iteration))
        advantages.append([1.0 if solved else -0.5] * len(resp))
    g = Group(
        prompt,
        ids(f"Prompt {prompt}: what is {prompt} times {iteration}?"),
        trajs,
        nodes=nodes,
        policy_version=iteration,
    )
    return g, advantages


def write_folder(folder: Path, prompts: int, trajectories: int, iterations: int) -> float:
    """Write the folder with the real writer; return the seconds it took."""
    from arpo_algo.models import byte_tokenizer

    tok = byte_tokenizer()
    writer = TreeWriter(folder, lambda x: tok.decode(x))
    t0 = time.perf_counter()
    for it in range(1, iterations + 1):
        made = [make_group(tok, p, trajectories, it) for p in range(prompts)]
        writer.record(it, [g for g, _ in made], [a for _, a in made])
    return time.perf_counter() - t0


class Viewer:
    """``arpo view FOLDER`` in a subprocess on 127.0.0.1 with ``key``; stopped by :meth:`stop`."""

    def __init__(self, folder: Path, key: str, port: int) -> None:
        env = dict(os.environ, ARPO_VIEW_KEY=key, PYTHONPATH=os.getcwd())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arpo_algo.cli", "view", str(folder), "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                get_json(f"{self.url}/v1/index?since=1000000000", headers={"Authorization": f"Bearer {key}"}, timeout=5)
                return
            except HTTPJSONError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("arpo view did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def step(entries: list[dict], since: int) -> dict[str, Any]:
    """The requests after the first ``since`` entries: all of them, and the index polls among them apart."""
    from urllib.parse import urlsplit

    new = entries[since:]
    rows = [
        {
            "path": urlsplit(e["url"]).path,
            "query": urlsplit(e["url"]).query,
            "type": e["type"],
            "transfer_bytes": e["transfer"],
            "body_bytes": e["body"],
            "same_origin": e["same_origin"],
        }
        for e in new
    ]
    return {
        "requests": len(rows),
        "index_requests": sum(r["path"] == "/v1/index" for r in rows),
        "group_requests": [r["query"] for r in rows if r["path"] == "/v1/group"],
        "paths": sorted({r["path"] for r in rows}),
        "transfer_bytes": sum(r["transfer_bytes"] for r in rows),
        "all_same_origin": all(r["same_origin"] for r in rows),
        "only_allowed_paths": all(r["path"] in ALLOWED for r in rows),
        "entries": rows,
    }


def measure(url: str, key: str, *, other_prompt: int, chromium: str, chromedriver: str, profile: str) -> dict:
    """The three steps in one headless chromium; per step, what :func:`step` reports."""
    from tests.browser import WebDriver

    wd = WebDriver(chromedriver, chromium, profile)
    try:
        wd.open(f"{url}/#key={key}")
        wd.js("performance.setResourceTimingBufferSize(100000)")
        wd.wait(
            "return document.querySelectorAll('#tree .node').length > 0",
            timeout_s=120,
            what="the page never drew a tree",
        )
        first_it = int(wd.js("return document.getElementById('iteration').options[0].value"))
        last_it = int(wd.js("return [...document.getElementById('iteration').options].at(-1).value"))
        seen = wd.js(ENTRIES)
        out = {"first_load": step(seen, 0), "shown_iteration": last_it}
        n = len(seen)
        wd.js(
            f"const s = document.getElementById('iteration'); s.value = '{first_it}'; "
            "s.dispatchEvent(new Event('change'))"
        )
        wd.wait(
            f"return document.querySelector('#tree .meta').textContent.startsWith('iteration {first_it} ')",
            timeout_s=60,
        )
        seen = wd.js(ENTRIES)
        out["switch_iteration"] = {**step(seen, n), "to": first_it}
        n = len(seen)
        wd.js(f"document.querySelector('.group-item[data-group=\"{other_prompt}\"]').click()")
        wd.wait(
            f"return document.querySelector('#tree .meta').textContent.includes('prompt {other_prompt} ')", timeout_s=60
        )
        out["open_prompt"] = {**step(wd.js(ENTRIES), n), "to": other_prompt}
        return out
    finally:
        wd.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import shutil

    from tests.browser import free_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="groups per iteration")
    ap.add_argument("--trajectories", type=int, default=16, help="trajectories per group")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--folder", type=Path, default=None, help="write the trees here (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    args = ap.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        raise SystemExit("needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    with tempfile.TemporaryDirectory(prefix="arpo-viewreq-") as tmp:
        folder = args.folder or Path(tmp) / "trees"
        write_s = write_folder(folder, args.prompts, args.trajectories, args.iterations)
        disk = sum(p.stat().st_size for p in folder.iterdir())
        index_bytes = (folder / INDEX).stat().st_size
        key = secrets.token_urlsafe(24)
        viewer = Viewer(folder, key, free_port())
        try:
            steps = measure(
                viewer.url,
                key,
                other_prompt=min(5, args.prompts - 1),
                chromium=chromium,
                chromedriver=chromedriver,
                profile=str(Path(tmp) / "profile"),
            )
        finally:
            viewer.stop()
    res = {
        "prompts": args.prompts,
        "trajectories": args.trajectories,
        "iterations": args.iterations,
        "write_s": round(write_s, 2),
        "folder_bytes": disk,
        "index_bytes": index_bytes,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        **steps,
    }
    print(
        f"{args.prompts} prompts x {args.trajectories} trajectories x {args.iterations} iterations: written in "
        f"{write_s:.1f} s, {disk / 1e6:.1f} MB on disk, index {index_bytes / 1e6:.2f} MB"
    )
    for name in ("first_load", "switch_iteration", "open_prompt"):
        s = steps[name]
        print(
            f"{name}: {s['requests']} requests ({', '.join(s['paths'])}), {s['transfer_bytes'] / 1e3:.1f} kB, "
            f"groups {s['group_requests']}, index requests {s['index_requests']}, same origin: "
            f"{s['all_same_origin']}"
        )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
