"""The sweep's reports: ``results.csv``/``results.md`` (one row per trial), ``summary.md`` (per configuration over
seeds: mean, sd, 95% CI; the Pareto front of the metric against tool calls), PNG plots, ``best.toml``, ``summary.json``.

Per trial, the metric is its value at the trial's last iteration (what Tune's ``get_best_result`` ranks by); tool
calls are the held-out ``evaluation/tool_calls_per_traj`` when the sweep evaluates, else the training
``tool_calls_per_traj``; tokens are the trajectory tokens sampled over all iterations.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from arpo_algo.rollout import metrics as MK
from arpo_algo.run.sweep import Sweep
from arpo_algo.run.tomlw import to_toml


def seed_stats(values: list[float]) -> dict[str, float | int | None]:
    """n, mean, sample sd (n-1) and the two-sided 95% Student-t confidence interval of the mean."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "ci_low": None, "ci_high": None}
    mean = sum(values) / n
    if n < 2:
        return {"n": 1, "mean": mean, "sd": None, "ci_low": None, "ci_high": None}
    from scipy.stats import t

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci_low": mean - half, "ci_high": mean + half}


def pareto_front(points: list[tuple[float, float]], mode: str = "max") -> list[int]:
    """Indices of the points (metric, tool calls) no other point beats on both: better-or-equal metric (per
    ``mode``) with fewer-or-equal tool calls, strictly better in one. Sorted by tool calls."""
    sign = 1.0 if mode == "max" else -1.0
    front = []
    for i, (m, c) in enumerate(points):
        dominated = any(
            sign * m2 >= sign * m and c2 <= c and (sign * m2 > sign * m or c2 < c)
            for j, (m2, c2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][1], -sign * points[i][0]))


def trial_rows(sweep: Sweep, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per trial, sorted by the metric (failed trials last)."""
    s = sweep.settings
    rows = []
    for t in trials:
        last, hist = t["last"], t["history"]
        iters = int(last.get("training_iteration", 0) or 0)
        calls = last.get(MK.EVALUATION + MK.TOOL_CALLS_PER_TRAJ, last.get(MK.TOOL_CALLS_PER_TRAJ))
        row = {
            "trial": Path(t["path"]).name,
            "algorithm": t["algorithm"],
            **{k: t["knobs"].get(k) for k in _knob_keys(sweep)},
            "status": "error" if t["error"] else ("stopped" if iters < s.iterations else "done"),
            "iterations": iters,
            "stopped_early": bool(not t["error"] and iters < s.iterations),
            s.metric: last.get(s.metric),
            "tool_calls": calls,
            "tokens": sum(float(h.get(MK.TOKENS_SAMPLED, 0) or 0) for h in hist),
            "train_reward": _mean([h.get(MK.REWARD_MEAN) for h in hist]),
            "wall_s": round(float(last.get("time_total_s", 0) or 0), 1),
            "error": t["error"] or "",
        }
        for extra in sweep.objectives:
            row.setdefault(extra, last.get(extra))
        rows.append(row)
    sign = -1.0 if s.mode == "max" else 1.0
    # a tie on the metric (a held-out accuracy over a few dozen tasks ties often) goes to the trial that earned more
    # reward while training, over all its iterations
    rows.sort(
        key=lambda r: (
            r["status"] == "error",
            r[s.metric] is None,
            sign * r[s.metric] if isinstance(r[s.metric], (int, float)) else 0.0,
            -r["train_reward"] if r["train_reward"] is not None else math.inf,
        )
    )
    return rows


def _mean(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


def _knob_keys(sweep: Sweep) -> list[str]:
    return [k.key for k in sweep.knobs if k.key != "experiment.algorithm"]


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    cols = columns or (list(rows[0]) if rows else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def config_summary(sweep: Sweep, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (algorithm + knobs except ``experiment.seed``): the metric over seeds, and tool calls."""
    s = sweep.settings
    keys = [k for k in _knob_keys(sweep) if k != "experiment.seed"]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["status"] != "error" and isinstance(r[s.metric], (int, float)):
            groups[(r["algorithm"], *[repr(r[k]) for k in keys])].append(r)
    out = []
    for members in groups.values():
        stats = seed_stats([float(r[s.metric]) for r in members])
        calls = [float(r["tool_calls"]) for r in members if isinstance(r["tool_calls"], (int, float))]
        out.append(
            {
                "algorithm": members[0]["algorithm"],
                **{k: members[0][k] for k in keys},
                "seeds": stats["n"],
                "mean": stats["mean"],
                "sd": stats["sd"],
                "ci95_low": stats["ci_low"],
                "ci95_high": stats["ci_high"],
                "tool_calls_mean": sum(calls) / len(calls) if calls else None,
            }
        )
    sign = -1.0 if s.mode == "max" else 1.0
    return sorted(out, key=lambda r: sign * r["mean"])


def best_row(sweep: Sweep, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if r["status"] != "error" and isinstance(r[sweep.settings.metric], (int, float))]
    return ok[0] if ok else None


def write_best_toml(sweep: Sweep, row: dict[str, Any], path: Path) -> Path:
    """The best configuration as a complete experiment file (``arpo train best.toml`` runs it unchanged)."""
    point = {k: row[k] for k in _knob_keys(sweep) if k in row and row[k] is not None}
    sections = sweep.sections_for(row["algorithm"], point)
    sections["experiment"]["name"] = f"{sweep.settings.name}_best"
    sections["experiment"].pop("output", None)
    header = (
        f"Best configuration of sweep {sweep.source} (trial {row['trial']}: {sweep.settings.metric} = "
        f"{_cell(row[sweep.settings.metric])} after {row['iterations']} iterations).\n"
        f"Base experiment: {sweep.base_path}. Train it: arpo train {path}"
    )
    path.write_text(to_toml(sections, header), encoding="utf-8")
    return path


def write_reports(sweep: Sweep, trials: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Write every report into the sweep folder; returns summary.json's content."""
    s, root = sweep.settings, sweep.output_dir
    rows = trial_rows(sweep, trials)
    if rows:
        with (root / "results.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    columns = list(rows[0]) if rows else []
    (root / "results.md").write_text(
        f"# Sweep {s.name}: {len(rows)} trials, sorted by {s.metric} ({s.mode})\n\n" + markdown_table(rows, columns)
    )
    configs = config_summary(sweep, rows)
    ok = [
        r
        for r in rows
        if r["status"] != "error"
        and isinstance(r[s.metric], (int, float))
        and isinstance(r["tool_calls"], (int, float))
    ]
    front = [ok[i] for i in pareto_front([(float(r[s.metric]), float(r["tool_calls"])) for r in ok], s.mode)]
    best = best_row(sweep, rows)
    knob_cols = ["trial", "algorithm", *_knob_keys(sweep)]
    text = [
        f"# Sweep {s.name}",
        "",
        f"Base experiment `{sweep.base_path.name}`; metric `{s.metric}` ({s.mode}); "
        f"{len(rows)} trials ({sum(r['stopped_early'] for r in rows)} stopped early by ASHA, "
        f"{sum(r['status'] == 'error' for r in rows)} failed); wall time {wall_s:.0f} s.",
        "",
        "## Per configuration over seeds (mean, sample sd, 95% Student-t CI)",
        "",
        markdown_table(configs) if configs else "(no finished trial)",
        "",
        f"## Pareto front: {s.metric} against tool calls per problem",
        "",
        markdown_table(front, [*knob_cols, s.metric, "tool_calls"]) if front else "(no finished trial)",
    ]
    if sweep.notes:
        text += ["", "## Notes", "", *[f"- {n}" for n in sweep.notes]]
    best_path = write_best_toml(sweep, best, root / "best.toml") if best else None
    if best:
        text += [
            "",
            "## Best trial",
            "",
            markdown_table([best], [*knob_cols, s.metric, "tool_calls", "iterations"]),
            f"`arpo train {best_path}` trains it.",
        ]
    (root / "summary.md").write_text("\n".join(text) + "\n")
    plots = _plots(sweep, rows, trials, root)
    summary = {
        "name": s.name,
        "output": str(root),
        "metric": s.metric,
        "mode": s.mode,
        "wall_s": round(wall_s, 1),
        "trials": len(rows),
        "stopped_early": sum(r["stopped_early"] for r in rows),
        "failed": sum(r["status"] == "error" for r in rows),
        "best": best,
        "best_toml": str(best_path) if best_path else None,
        "plots": plots,
        "notes": sweep.notes,
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _plots(sweep: Sweep, rows: list[dict[str, Any]], trials: list[dict[str, Any]], root: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, out = sweep.settings, []
    ok = [r for r in rows if isinstance(r[s.metric], (int, float))]
    keys = [k for k in _knob_keys(sweep)]
    if keys and ok:
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for alg in sorted({r["algorithm"] for r in ok}):
                pts = [(r[key], r[s.metric]) for r in ok if r["algorithm"] == alg and r[key] is not None]
                xs = [p[0] if isinstance(p[0], (int, float)) else str(p[0]) for p in pts]
                ax.scatter(xs, [p[1] for p in pts], label=alg, alpha=0.8)
            if any(k.key == key and k.dist == "loguniform" for k in sweep.knobs):
                ax.set_xscale("log")
            ax.set_xlabel(key)
            ax.set_ylabel(s.metric)
            ax.grid(alpha=0.3)
        if len({r["algorithm"] for r in ok}) > 1:
            axes[0][0].legend(loc="best")
        fig.tight_layout()
        fig.savefig(root / "metric_vs_knobs.png", dpi=90)
        plt.close(fig)
        out.append("metric_vs_knobs.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = 0
    for t in trials:
        pts = [
            (h.get("training_iteration"), h.get(s.metric))
            for h in t["history"]
            if isinstance(h.get(s.metric), (int, float)) and not math.isnan(h.get(s.metric))
        ]
        if pts:
            ax.plot(*zip(*pts), "o-", label=Path(t["path"]).name, alpha=0.8)
            plotted += 1
    ax.set_xlabel("training iteration")
    ax.set_ylabel(s.metric)
    ax.grid(alpha=0.3)
    if 0 < plotted <= 12:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(root / "metric_vs_iteration.png", dpi=90)
    plt.close(fig)
    out.append("metric_vs_iteration.png")
    if s.search == "optuna":
        imp = _importances(sweep, ok)
        if imp:
            fig, ax = plt.subplots(figsize=(6, 0.5 + 0.5 * len(imp)))
            ax.barh(list(imp), list(imp.values()))
            ax.set_xlabel(f"Optuna fANOVA importance for {s.metric}")
            fig.tight_layout()
            fig.savefig(root / "param_importances.png", dpi=90)
            plt.close(fig)
            out.append("param_importances.png")
    return out


def _importances(sweep: Sweep, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Optuna's parameter importances, from a study rebuilt out of the finished trials (works after --resume)."""
    try:
        import optuna
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        dists = {}
        for k in sweep.knobs:
            if k.key == "experiment.algorithm":
                continue
            if k.dist in ("uniform", "loguniform", "quniform"):
                dists[k.key] = FloatDistribution(k.args[0], k.args[1], log=k.dist == "loguniform")
            elif k.dist == "randint":
                dists[k.key] = IntDistribution(k.args[0], k.args[1])
            else:
                dists[k.key] = CategoricalDistribution(k.args)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", module="optuna")
        study = optuna.create_study(direction="maximize" if sweep.settings.mode == "max" else "minimize")
        for r in rows:
            params = {k: r[k] for k in dists if r.get(k) is not None}
            if len(params) == len(dists):
                study.add_trial(
                    optuna.trial.create_trial(params=params, distributions=dists, value=float(r[sweep.settings.metric]))
                )
        if len(study.trials) < 2:
            return {}
        return dict(optuna.importance.get_param_importances(study))
    except Exception:  # noqa: BLE001 - importances are a nicety (e.g. a constant metric); the tables stand alone
        return {}
