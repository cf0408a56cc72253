"""Render one iteration's dumped rollout trees (``trees.jsonl``) as one self-contained HTML page.

    python -m arpo_algo.eval.render_trees runs/quickstart/arpo --iteration 3 --tokenizer runs/quickstart/sft \
        --output trees_3.html

Each prompt is a tree: every shared prefix is drawn once (the sampler's tree nodes), tool results in grey, each
branch point with the entropy before it (mean of the k sampled tokens before the point) and after it (per child: mean
of its first k sampled tokens), each leaf with its reward, finish reason and tool calls. Without ``--tokenizer`` the
tokens are shown as ids. No scripts, no external files: the page opens anywhere.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

from arpo_algo.rollout import metrics as MK

K = 10  # tokens per entropy window shown at branch points


def load_groups(path: Path, iteration: int | None) -> tuple[int, list[dict[str, Any]]]:
    """The groups of ``iteration`` (the sampler's step; default: the last one in the file)."""
    f = path / "trees.jsonl" if path.is_dir() else path
    if not f.is_file():
        raise SystemExit(f"error: no trees.jsonl at {f} (train with tree dumps on: arpo train writes them)")
    groups = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    steps = sorted({int(g.get("metrics", {}).get(MK.GROUP_STEP, 0)) for g in groups})
    if not steps:
        raise SystemExit(f"error: {f} holds no trees")
    step = steps[-1] if iteration is None else iteration
    chosen = [g for g in groups if int(g.get("metrics", {}).get(MK.GROUP_STEP, 0)) == step]
    if not chosen:
        raise SystemExit(f"error: iteration {step} not in {f}; it holds {steps}")
    return step, chosen


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _text(ids: list[int], mask: list[int], decode) -> str:
    """Token runs as HTML: sampled text plain, inserted tool results grey."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        body = html.escape(decode(ids[i:j]))
        out.append(body if mask[i] else f'<span class="obs">{body}</span>')
        i = j
    return "".join(out)


def render_group(g: dict[str, Any], decode) -> str:
    trajs = {t["traj_id"]: t for t in g["trajectories"]}
    nodes = {n["node_id"]: n for n in g["nodes"]}
    children: dict[int | None, list[int]] = {}
    for n in g["nodes"]:
        children.setdefault(n["parent"], []).append(n["node_id"])
    through: dict[int, list[int]] = {}
    for t in g["trajectories"]:
        for nid in t["node_ids"]:
            through.setdefault(nid, []).append(t["traj_id"])

    def node_html(nid: int) -> str:
        n, owner = nodes[nid], trajs[through[nid][0]]
        ids, mask = owner["response_ids"][n["start"]:n["end"]], owner["trained_mask"][n["start"]:n["end"]]
        parts = [f'<div class="seg">{_text(ids, mask, decode)}</div>' if ids else ""]
        kids = children.get(nid, [])
        if len(kids) > 1:
            ent, m = owner["entropies"][:n["end"]], owner["trained_mask"][:n["end"]]
            before = [e for e, k in zip(ent, m) if k][-K:]
            after = []
            for c in kids:
                t = trajs[through[c][0]]
                s = nodes[c]["start"]
                after.append(_mean([e for e, k in zip(t["entropies"][s:], t["trained_mask"][s:]) if k][:K]))
            parts.append(f'<div class="bp">branch point at token {n["end"]}: H before {_mean(before):.2f} &rarr; '
                         f'after {", ".join(f"{a:.2f}" for a in after)}</div>')
        if kids:
            parts.append("<ul>" + "".join(f"<li>{node_html(c)}</li>" for c in kids) + "</ul>")
        if not kids:
            for tid in through[nid]:
                if trajs[tid]["node_ids"][-1] != nid:
                    continue
                t = trajs[tid]
                calls = "; ".join(f'{c.get("tool")}({html.escape(json.dumps(c.get("args", {}))[:80])})'
                                  f'{" ERROR" if c.get("error") else ""}' for c in t["tool_calls"])
                cls = "good" if t["reward"] > 0 else "bad"
                parts.append(f'<div class="leaf {cls}">trajectory {tid} ({t["kind"]}): reward {t["reward"]:.3f}, '
                             f'{t["finish_reason"]}, {len(t["tool_calls"])} tool calls{": " + calls if calls else ""}'
                             f'</div>')
        return "".join(parts)

    roots = children.get(None, [])
    rewards = [t["reward"] for t in g["trajectories"]]
    head = (f'<h2>prompt {g["prompt_index"]}: {len(rewards)} trajectories, rewards '
            f'{", ".join(f"{r:.2f}" for r in rewards)}{" (all equal: no signal)" if len(set(rewards)) == 1 else ""}'
            f'</h2><div class="prompt">{html.escape(decode(g["prompt_ids"])[-400:])}</div>')
    return head + "<ul>" + "".join(f"<li>{node_html(r)}</li>" for r in roots) + "</ul>"


CSS = """body{font-family:sans-serif;margin:1em}ul{list-style:none;border-left:2px solid #bbb;padding-left:1em}
.seg{font-family:monospace;white-space:pre-wrap;font-size:12px}.obs{color:#888;background:#f2f2f2}
.bp{color:#a50;font-size:12px;margin:2px 0}.leaf{font-size:12px;margin:2px 0 8px}.good{color:#070}.bad{color:#a00}
.prompt{font-family:monospace;white-space:pre-wrap;font-size:11px;color:#555}"""


def render(groups: list[dict[str, Any]], step: int, decode) -> str:
    body = "".join(f"<section>{render_group(g, decode)}</section>" for g in groups)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>rollout trees, iteration {step}</title>"
            f"<style>{CSS}</style></head><body><h1>Rollout trees, iteration {step}</h1>{body}</body></html>")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path, help="a run folder or a trees.jsonl file")
    ap.add_argument("--iteration", type=int, default=None, help="the sampler step to draw (default: the last)")
    ap.add_argument("--tokenizer", default=None, help="a model folder or name whose tokenizer decodes the ids")
    ap.add_argument("--output", type=Path, default=None, help="HTML file (default: <path>/trees_<iteration>.html)")
    args = ap.parse_args(argv)
    step, groups = load_groups(args.path, args.iteration)
    if args.tokenizer:
        from transformers import AutoTokenizer

        from arpo_algo.models import resolve_model_path

        tok = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer))

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=False)
    else:
        def decode(ids: list[int]) -> str:
            return " ".join(map(str, ids))
    out = args.output or ((args.path if args.path.is_dir() else args.path.parent) / f"trees_{step}.html")
    out.write_text(render(groups, step, decode), encoding="utf-8")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
