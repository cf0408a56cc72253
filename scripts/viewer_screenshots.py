"""The documentation's screenshots of ``arpo view`` (docs/howto/view-trees.md), taken in headless chromium.

    python scripts/viewer_screenshots.py [--run TREES] [--learner TREES] [--compare EVAL_A EVAL_B --item N]
        [--out docs/figures]

TREES are trees/ folders of training runs, EVAL_A and EVAL_B two tree folders of one evaluation (``E/trees/LABEL``).
Writes view-trees.png (the branch point with the largest entropy jump, one after a tool result first, its node
open), view-trees-learner.png (the longest node with a tool result, its tokens coloured by the learner's log-prob)
and view-trees-compare.png (one item of A beside B), each quantized to a palette PNG to keep it small. Needs
chromium and chromedriver.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arpo_algo.eval.trees import TreeReader  # noqa: E402
from arpo_base.http import HTTPJSONError, get_json  # noqa: E402
from tests.browser import WebDriver, find_browser, free_port  # noqa: E402

KEY = "screenshot-key-0123456789"


def serve(*folders: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo_algo.cli", "view", *map(str, folders), "--port", str(port)],
        env=dict(os.environ, ARPO_API_KEY=KEY),
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            get_json(f"{url}/v1/index", headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
            return proc, url
        except HTTPJSONError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the viewer did not start")


def branch_after_tool(folder: Path) -> tuple[int, int, int]:
    """(iteration, group, node) of a branch point whose path holds a tool result, the largest entropy jump first."""
    reader = TreeReader(folder)
    reader.refresh()
    best, where = None, None
    for it in sorted(reader.iterations):
        for g in range(len(reader.iterations[it]["groups"])):
            rec = reader.group(it, g)
            nodes = {n["id"]: n for n in rec["nodes"]}
            for n in rec["nodes"]:
                if "branch" not in n:
                    continue
                path, p = [], n
                while p is not None:
                    path.append(p)
                    p = nodes.get(p["parent"])
                tool = any(r[0] == "tool" for x in path for r in x["text"])
                jump = max((a or 0) for a in n["branch"]["entropy_after"]) - (n["branch"]["entropy_before"] or 0)
                key = (tool, jump)
                if best is None or key > best:
                    best, where = key, (it, g, n["id"])
    if where is None:
        raise SystemExit(f"{folder} has no branch point")
    return where


def save(png: bytes, out: Path) -> None:
    from PIL import Image

    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64).save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a run's trees/: its largest entropy jump at a branch point")
    ap.add_argument("--learner", type=Path, help="a run's trees/ with learner log-probs: a node coloured by them")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("EVAL_A", "EVAL_B"))
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    ap.add_argument("--item", type=int, default=None, help="the evaluation item to show (default: the first)")
    args = ap.parse_args()
    chromium, driver = find_browser()
    wd = WebDriver(driver, chromium, f"/tmp/arpo-shots-{os.getpid()}", size="1400,800")
    try:
        if args.run:
            where = branch_after_tool(args.run)
            shoot_node(wd, args.run, where, args.out / "view-trees.png")
        if args.learner:
            shoot_node(
                wd,
                args.learner,
                longest_tool_node(args.learner),
                args.out / "view-trees-learner.png",
                "learner_logprob",
            )
        if args.compare:
            shoot_compare(wd, args)
    finally:
        wd.close()


def shoot_node(wd: WebDriver, run: Path, where: tuple[int, int, int], out: Path, colour: str | None = None) -> None:
    """The page of ``run`` with node ``where`` = (iteration, group, node) open, its tokens coloured by ``colour``."""
    it, g, n = where
    proc, url = serve(run)
    try:
        wd.open("about:blank")
        wd.open(f"{url}/#key={KEY}&it={it}&g={g}&n={n}")
        wd.wait(
            f"return document.querySelector('#detail h3') && "
            f"document.querySelector('#detail h3').textContent === 'node {n}'"
        )
        if colour:
            wd.js(
                f"const c = document.getElementById('colour'); c.value = '{colour}'; "
                "c.dispatchEvent(new Event('change'))"
            )
        time.sleep(0.5)
        save(wd.screenshot(), out)
    finally:
        proc.terminate()
        proc.wait(10)


def longest_tool_node(folder: Path) -> tuple[int, int, int]:
    """(iteration, group, node) of the longest node holding a tool result, in the last recorded iteration."""
    reader = TreeReader(folder)
    reader.refresh()
    it = max(reader.iterations)
    cands = [
        (n["end"] - n["start"], g, n["id"])
        for g in range(len(reader.iterations[it]["groups"]))
        for n in reader.group(it, g)["nodes"]
        if any(r[0] == "tool" for r in n["text"])
    ]
    _, g, n = max(cands)
    return it, g, n


def shoot_compare(wd: WebDriver, args: argparse.Namespace) -> None:
    proc, url = serve(*args.compare)
    try:
        item = 1 if args.item is None else args.item + 1
        wd.open("about:blank")
        wd.open(f"{url}/#key={KEY}&it={item}&g=0")
        wd.wait("return document.querySelectorAll('#tree-b .node').length > 0")
        wd.js("const l = document.querySelectorAll('#tree-b .node'); l[l.length - 1].click()")
        time.sleep(0.5)
        save(wd.screenshot(), args.out / "view-trees-compare.png")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
