"""Reports of an evaluation folder: ``summary.json``, ``summary.md`` and PNG charts, all from ``samples.jsonl``.

Per model, overall and per ``source``: items, runs per item (K), pass@1 with its 95% interval, pass@k and maj@k for
every k <= K, exact match, token F1, math equivalence, mean reward, tool calls / generated tokens / wall time per run,
and the cost per correct answer (total tool calls and total generated tokens divided by the number of correct runs);
search calls that failed (offline replay: the query is not in the cache, answered by the tool's error fallback).
With two or more models: the paired difference of every model against the first one on the items both ran
(bootstrap 95% interval over items). Statistics are defined in :mod:`arpo_algo.eval.metrics`.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from arpo_algo.eval.metrics import maj_vote, mean_ci, mean_pass_at_k, paired_bootstrap

OVERALL = "all"

# The statistics of one model and source in ``summary.json`` (what :func:`summarize_rows` returns).
ITEMS = "items"
K = "k"  # runs per item used (the fewest any item has)
PASS_AT = "pass@{}"  # format with k
PASS_AT_1 = PASS_AT.format(1)
PASS_AT_1_CI95 = PASS_AT_1 + "_ci95"  # half-width of the 95% interval
MAJ_AT = "maj@{}"  # format with k
EXACT_MATCH = "exact_match"
F1 = "f1"
MATH_EQUIV = "math_equiv"
TOOL_CALLS_PER_RUN = "tool_calls_per_run"
TOKENS_PER_RUN = "tokens_per_run"
TOOL_CALLS_PER_CORRECT = "tool_calls_per_correct"  # None without a correct run
TOKENS_PER_CORRECT = "tokens_per_correct"
WALL_S_PER_ITEM = "wall_s_per_item"
WALL_S_TOTAL = "wall_s_total"


def _per_item(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    items: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        items[r["item_id"]].append(r)
    for runs in items.values():
        runs.sort(key=lambda r: r["run"])
    return items


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Statistics of one model's runs over some items (see the module docstring)."""
    items = _per_item(rows)
    if not items:
        return {ITEMS: 0}
    k_max = min(len(runs) for runs in items.values())
    correct = [[bool(r["correct"]) for r in runs[:k_max]] for runs in items.values()]
    p_item = [sum(c) / len(c) for c in correct]
    ci = mean_ci(p_item)
    runs = [r for rs in items.values() for r in rs[:k_max]]
    n_correct = sum(bool(r["correct"]) for r in runs)
    tool_calls = sum(r["num_tool_calls"] for r in runs)
    tokens = sum(r["generated_tokens"] for r in runs)
    out: dict[str, Any] = {
        ITEMS: len(items),
        K: k_max,
        "runs": len(runs),
        PASS_AT_1: ci["mean"],
        PASS_AT_1_CI95: ci["ci95"],
        **{PASS_AT.format(k): mean_pass_at_k(correct, k) for k in range(2, k_max + 1)},
        **{
            MAJ_AT.format(k): _mean(
                [
                    float(maj_vote([r.get("answer_norm") for r in rs], [bool(r["correct"]) for r in rs], k)[1])
                    for rs in items.values()
                ]
            )
            for k in range(1, k_max + 1)
        },
        EXACT_MATCH: _mean([r["exact_match"] for r in runs]),
        F1: _mean([r["f1"] for r in runs]),
        MATH_EQUIV: _mean([r["math_equiv"] for r in runs]),
        "reward": _mean([r["reward"] for r in runs]),
        "correct_runs": n_correct,
        TOOL_CALLS_PER_RUN: tool_calls / len(runs),
        TOKENS_PER_RUN: tokens / len(runs),
        WALL_S_PER_ITEM: _mean([rs[0]["wall_s"] for rs in items.values()]),
        WALL_S_TOTAL: sum(rs[0]["wall_s"] for rs in items.values()),
        "tool_calls_total": tool_calls,
        "tokens_total": tokens,
        TOOL_CALLS_PER_CORRECT: tool_calls / n_correct if n_correct else None,
        TOKENS_PER_CORRECT: tokens / n_correct if n_correct else None,
        "finish_reasons": dict(Counter(r["finish_reason"] for r in runs)),
    }
    search = [c for r in runs for c in r["tool_calls"] if c.get("tool") == "search"]
    if search:  # offline replay: a query the cache lacks gets the tool's error fallback, counted here
        out["search_calls"] = len(search)
        out["search_failed"] = sum(bool(c.get("error")) for c in search)
    judged = [r for r in runs if "judge" in r]
    if judged:
        out["judge"] = dict(Counter(r["judge"] for r in judged))
        out["unjudged"] = out["judge"].get("unjudged", 0)
    return out


def summarize(rows: list[dict[str, Any]], models: list[str], *, seed: int = 0) -> dict[str, Any]:
    """The whole ``summary.json`` body: per model per source, and paired differences against ``models[0]``."""
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    sources = sorted({r["source"] for r in rows})
    result: dict[str, Any] = {"models": {}, "paired": []}
    for m in models:
        mrows = by_model.get(m, [])
        per = {OVERALL: summarize_rows(mrows)}
        if len(sources) > 1:
            per.update({s: summarize_rows([r for r in mrows if r["source"] == s]) for s in sources})
        result["models"][m] = per
    base = models[0] if models else None
    for other in models[1:]:
        for src in [OVERALL, *(sources if len(sources) > 1 else [])]:
            a = _item_pass1(by_model.get(base, []), src)
            b = _item_pass1(by_model.get(other, []), src)
            common = sorted(set(a) & set(b))
            boot = paired_bootstrap([a[i] for i in common], [b[i] for i in common], seed=seed)
            result["paired"].append({"a": base, "b": other, "source": src, **boot})
    return result


def _item_pass1(rows: list[dict[str, Any]], source: str) -> dict[str, float]:
    items = _per_item([r for r in rows if source == OVERALL or r["source"] == source])
    return {i: sum(bool(r["correct"]) for r in rs) / len(rs) for i, rs in items.items()}


def _fmt(x: Any, pct: bool = True) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{100 * x:.1f}" if pct else f"{x:.1f}"
    return str(x)


def render_markdown(summary: dict[str, Any], header: dict[str, Any]) -> str:
    """``summary.md``: one table per source (a row per model), then the paired differences."""
    lines = [f"# arpo eval: {header.get('data', '')}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    models = list(summary["models"])
    sources = list(next(iter(summary["models"].values()), {}).keys()) if models else []
    for src in sources:
        stats = [summary["models"][m].get(src, {}) for m in models]
        k = max((s.get(K, 1) for s in stats), default=1)
        cols = [
            "model",
            "items",
            "pass@1 (95% CI)",
            *[f"pass@{j}" for j in range(2, k + 1)],
            f"maj@{k}",
            "EM",
            "F1",
            "math",
            "tool calls/run",
            "tokens/run",
            "tool calls/correct",
            "tokens/correct",
            "s/item",
        ]
        lines += ["", f"## {src}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for m, s in zip(models, stats):
            if not s.get(ITEMS):
                continue
            row = [
                m,
                str(s[ITEMS]),
                f"{_fmt(s[PASS_AT_1])} ± {_fmt(s[PASS_AT_1_CI95])}",
                *[_fmt(s.get(PASS_AT.format(j))) for j in range(2, k + 1)],
                _fmt(s.get(MAJ_AT.format(k))),
                _fmt(s[EXACT_MATCH]),
                _fmt(s[F1]),
                _fmt(s[MATH_EQUIV]),
                f"{s[TOOL_CALLS_PER_RUN]:.2f}",
                f"{s[TOKENS_PER_RUN]:.0f}",
                _fmt(s[TOOL_CALLS_PER_CORRECT], pct=False),
                _fmt(s[TOKENS_PER_CORRECT], pct=False),
                f"{s[WALL_S_PER_ITEM]:.1f}",
            ]
            lines.append("| " + " | ".join(row) + " |")
    if summary["paired"]:
        lines += [
            "",
            "## Paired difference (pass@1, b - a, same items and seeds; bootstrap 95% CI over items)",
            "",
            "| a | b | source | items | diff | 95% CI |",
            "|---|---|---|---|---|---|",
        ]
        for p in summary["paired"]:
            lines.append(
                f"| {p['a']} | {p['b']} | {p['source']} | {p['n']} | {100 * p['diff']:+.1f} | "
                f"[{100 * p['lo']:+.1f}, {100 * p['hi']:+.1f}] |"
            )
    lines.append("")
    return "\n".join(lines)


def plot_charts(rows: list[dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """``pass_at_k.png`` (pass@k against k, one panel per source, a line per model) and ``accuracy_vs_tools.png``
    (fraction of correct runs against the run's number of tool calls, a line per model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(summary["models"])
    sources = list(next(iter(summary["models"].values()), {}).keys()) if models else []
    fig, axes = plt.subplots(1, len(sources), figsize=(4 * len(sources), 3.5), squeeze=False)
    for ax, src in zip(axes[0], sources):
        for m in models:
            s = summary["models"][m].get(src, {})
            if not s.get(ITEMS):
                continue
            ks = list(range(1, s[K] + 1))
            ax.plot(ks, [s[PASS_AT.format(k)] for k in ks], "o-", label=m)
        ax.set_title(src)
        _style(ax, "k", "pass@k")
    fig.tight_layout()
    paths = [out_dir / "pass_at_k.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in models:
        groups: dict[int, list[bool]] = defaultdict(list)
        for r in rows:
            if r["model"] == m:
                groups[r["num_tool_calls"]].append(bool(r["correct"]))
        xs = sorted(groups)
        ax.plot(xs, [_mean([float(c) for c in groups[x]]) for x in xs], "o-", label=m)
    _style(ax, "tool calls in the run", "fraction correct")
    fig.tight_layout()
    paths.append(out_dir / "accuracy_vs_tools.png")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def write_reports(
    out_dir: Path, rows: list[dict[str, Any]], models: list[str], header: dict[str, Any], *, charts: bool = True
) -> dict[str, Any]:
    """Write summary.json, summary.md and the charts; returns the summary."""
    summary = summarize(rows, models, seed=int(header.get("seed", 0)))
    body = {**header, **summary}
    (out_dir / "summary.json").write_text(json.dumps(body, indent=2, default=str))
    (out_dir / "summary.md").write_text(render_markdown(summary, header))
    if charts and rows:
        plot_charts(rows, summary, out_dir)
    return body


def _style(ax, xlabel: str, ylabel: str) -> None:
    """Axes of a fraction (0..1) against ``xlabel``, with a grid and a small legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
