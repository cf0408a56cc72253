"""The tables and figures of the powered comparison, computed from its records (``studies/study.py``).

Per arm: final held-out accuracy (mean, sd, 95% t-interval over seeds), seeds improved / worse than the shared start;
paired by seed against GRPO: the difference (mean, sd, 95% t-interval), better / worse / equal and the exact two-sided
Wilcoxon signed-rank p-value; the iteration, tool calls and generated tokens each seed needed to first reach GRPO's
mean final accuracy over the same seeds (means and 95% t-intervals over the seeds that reach it, how many do);
branches per group; the clip fraction.
"""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path
from typing import Any

from studies.compare import stats, wilcoxon

BASELINE = "grpo"


def _ci(xs: list[float]) -> str:
    s = stats(xs)
    if not xs:
        return "-"
    ci = f", 95% t-interval {s['mean'] - s['ci95']:+.3f} .. {s['mean'] + s['ci95']:+.3f}" if len(xs) > 1 else ""
    return f"{s['mean']:.3f} ± {s['sd']:.3f}{ci}"


def _first_reach(curve: list[list[float]], target: float) -> tuple[float, float, float] | None:
    """(iteration, cumulative tool calls, cumulative generated tokens) at the first evaluation at or above
    ``target``; None when no evaluation of the run reaches it."""
    for it, calls, tokens, acc in curve:
        if acc >= target - 1e-9:
            return it, calls, tokens
    return None


def by_arm(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    arms: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        arms.setdefault(r["arm"], {})[r["seed"]] = r  # a later record of the same (arm, seed) replaces it
    return {a: dict(sorted(s.items())) for a, s in arms.items()}


def power_mde(n: int, sd: float, alpha: float = 0.05, power: float = 0.8, sims: int = 400) -> float:
    """The smallest mean paired difference (normal differences with this sd) that the exact Wilcoxon test at
    ``alpha`` detects with ``power``, by simulation on a grid of 0.01 (seeded, so the plan prints one number)."""
    rng = random.Random(0)
    for step in range(1, 101):
        delta = step / 100
        hits = sum(wilcoxon([rng.gauss(delta, sd) for _ in range(n)])[0] < alpha for _ in range(sims))
        if hits / sims >= power:
            return delta
    return math.inf


def _null_counts(n: int) -> list[int]:
    """counts[w]: the number of the 2^n sign patterns of the ranks 1..n whose positive rank sum is w."""
    total = n * (n + 1) // 2
    counts = [1] + [0] * total
    for r in range(1, n + 1):
        for s in range(total, r - 1, -1):
            counts[s] += counts[s - r]
    return counts


def hodges_lehmann(diffs: list[float], alpha: float = 0.05) -> tuple[float, float, float, float]:
    """(estimate, low, high, coverage): the Hodges-Lehmann estimate of the paired shift (the median of the n(n+1)/2
    Walsh averages (d_i + d_j) / 2, i <= j, zeros included) and its exact confidence interval by inverting the
    signed-rank test: [W_(c+1), W_(M-c)] of the sorted Walsh averages, c the largest rank sum with
    P(W+ <= c) <= alpha / 2 under the null distribution of untied ranks; ``coverage`` is that interval's exact level,
    1 - 2 P(W+ <= c), at or above 1 - alpha."""
    n = len(diffs)
    if n == 0:
        raise ValueError("no differences")
    walsh = sorted((diffs[i] + diffs[j]) / 2 for i in range(n) for j in range(i, n))
    m = len(walsh)
    est = statistics.median(walsh)
    counts, c, cum = _null_counts(n), -1, 0
    while cum + counts[c + 1] <= alpha / 2 * 2**n:
        c += 1
        cum += counts[c]
    if c < 0:  # too few pairs for any interval at this level
        return est, -math.inf, math.inf, 1.0
    return est, walsh[c], walsh[m - 1 - c], 1 - 2 * cum / 2**n


def power(draw: Any, n: int, alpha: float = 0.05, sims: int = 2000, seed: int = 0) -> float:
    """The fraction of ``sims`` simulated studies of ``n`` pairs, each difference ``draw(rng)``, in which the exact
    Wilcoxon test rejects at ``alpha`` (seeded, so a report prints one number)."""
    rng = random.Random(seed)
    return sum(wilcoxon([draw(rng) for _ in range(n)])[0] < alpha for _ in range(sims)) / sims


def planned_test(
    records: list[dict[str, Any]],
    pairs: int,
    alpha: float,
    effect: float,
    sd: float,
    planned_pairs: int,
    aepo_seeds: int,
    planned_aepo: int,
    sims: int = 2000,
) -> str:
    """The study's primary test, ARPO - GRPO on the final held-out accuracy of the first ``pairs`` seeds recorded
    in both arms, as the plan fixes it, with the Hodges-Lehmann estimate, its exact interval and the power the test
    had: at the planned effect (normal differences of mean ``effect`` and sd ``sd``) and by resampling the observed
    differences; ``planned_pairs`` is the plan's n before its deviation."""
    arms = by_arm(records)
    arpo, grpo = arms.get("arpo", {}), arms.get("grpo", {})
    seeds = sorted(s for s in arpo if s in grpo)[:pairs]
    aepo = len(arms.get("aepo", {}))
    lines = [
        f"Primary test (the plan at n = {pairs} pairs after its recorded deviation; planned {planned_pairs}): "
        f"two-sided exact Wilcoxon signed-rank, ARPO - GRPO, final held-out accuracy, alpha = {alpha}"
    ]
    if len(seeds) < pairs:
        return "\n".join(lines + [f"not run: {len(seeds)} of {pairs} pairs recorded"])
    d = [arpo[s]["after"] - grpo[s]["after"] for s in seeds]
    p, nz = wilcoxon(d)
    ranks_tied = len({abs(x) for x in d if abs(x) > 1e-12}) < nz
    est, lo, hi, cov = hodges_lehmann(d, alpha)
    at_plan = power(lambda rng: rng.gauss(effect, sd), pairs, alpha, sims)
    at_plan_full = power(lambda rng: rng.gauss(effect, sd), planned_pairs, alpha, sims)
    resampled = power(lambda rng: rng.choice(d), pairs, alpha, sims)
    lines += [
        f"seeds {seeds[0]}-{seeds[-1]}: {sum(x > 0 for x in d)} ARPO better, {sum(x < 0 for x in d)} worse, "
        f"{len(d) - nz} equal (zero differences dropped: {len(d) - nz}; tied |differences|: "
        f"{'yes, average ranks' if ranks_tied else 'none'})",
        f"exact two-sided p = {p:.4f} over {nz} non-zero pairs: "
        f"{'significant' if p < alpha else 'not significant'} at alpha = {alpha}",
        f"Hodges-Lehmann estimate of ARPO - GRPO: {est:+.4f}; exact {cov:.1%} interval (Walsh averages) "
        f"{lo:+.4f} .. {hi:+.4f}",
        f"power of this test at n = {pairs} (exact Wilcoxon, {sims} seeded simulations): {at_plan:.2f} at the "
        f"planned effect (normal differences, mean {effect}, sd {sd}; {at_plan_full:.2f} at the planned "
        f"n = {planned_pairs}); {resampled:.2f} when the {pairs} observed differences are resampled with replacement",
        f"AEPO: {aepo} of {planned_aepo} planned seeds run"
        + (" (not run)" if aepo == 0 else "")
        + (f"; the deviation fixes {aepo_seeds}" if aepo_seeds != planned_aepo else ""),
    ]
    return "\n".join(lines)


def report(records: list[dict[str, Any]], figures: Path | None = None, baseline: str = BASELINE) -> str:
    if not records:
        return "no records yet"
    arms = by_arm(records)
    lines = [
        f"records: {len(records)}; code {records[0]['code']} (commit {records[0]['commit'][:10]}), SFT "
        f"{records[0]['sft']}, {records[0]['cpu']}, torch {records[0]['torch']}",
        "",
        "| arm | seeds | before | final (mean ± sd, 95% t-interval) | improved / worse | branches per group | "
        "clip fraction | tool calls per run | wall time per run |",
        "|" + "---|" * 9,
    ]
    for arm, seeds in arms.items():
        rs = list(seeds.values())
        lines.append(
            f"| {arm} | {len(rs)} | {rs[0]['before']:.3f} | {_ci([r['after'] for r in rs])} | "
            f"{sum(r['after'] > r['before'] for r in rs)} / {sum(r['after'] < r['before'] for r in rs)} | "
            f"{stats([r['branches_per_group'] for r in rs])['mean']:.2f} | "
            f"{stats([r['clip_frac'] for r in rs])['mean']:.4f} | "
            f"{stats([sum(r['tool_calls']) for r in rs])['mean']:.0f} | "
            f"{stats([r['time_s'] for r in rs])['mean']:.0f} s |"
        )
    base = arms.get(baseline, {})
    if base:
        name = baseline.upper()
        lines += [
            "",
            f"Paired by seed against {name} (final accuracy difference). Reach: the first evaluation at "
            f"or above {name}'s mean final accuracy over the same seeds (the target); tool calls and tokens "
            "are means ± sd over the seeds that reach it, the iteration a median; the {name} row is measured "
            "against its own mean.".replace("{name}", name),
            "",
            "| arm | pairs | difference (mean ± sd, 95% t-interval) | better / worse / equal | Wilcoxon p (non-zero "
            "pairs) | target | reach it | iteration (median) | tool calls to reach | tokens to reach |",
            "|" + "---|" * 10,
        ]
        for arm, seeds in arms.items():
            # The target and the reach are taken over the same seeds: the paired ones (all of the baseline's for
            # its own row), so an arm with fewer seeds is not measured against other seeds' accuracy.
            common = sorted(seeds) if arm == baseline else sorted(s for s in seeds if s in base)
            if not common:
                continue
            target = stats([base[s]["after"] for s in common])["mean"]
            got = [x for x in (_first_reach(seeds[s]["curve"], target) for s in common) if x is not None]
            its, calls, toks = [x[0] for x in got], [x[1] for x in got], [x[2] for x in got]
            if arm == baseline:
                diff = pairs = tally = wil = "-"
            else:
                d = [seeds[s]["after"] - base[s]["after"] for s in common]
                diff, pairs = _ci(d), str(len(common))
                tally = f"{sum(x > 0 for x in d)} / {sum(x < 0 for x in d)} / {sum(x == 0 for x in d)}"
                p, nz = wilcoxon(d)
                wil = f"{p:.4f} ({nz})"
            lines.append(
                f"| {arm} | {pairs} | {diff} | {tally} | {wil} | {target:.3f} | {len(got)} of "
                f"{len(common)} | {statistics.median(its) if its else '-'} | "
                f"{_ci(calls) if calls else '-'} | {_ci(toks) if toks else '-'} |"
            )
    lines += ["", "Held-out accuracy per seed after each iteration:", "", "| arm | seed | curve |", "|---|---|---|"]
    for arm, seeds in arms.items():
        for s, r in seeds.items():
            lines.append(f"| {arm} | {s} | {' '.join(f'{a:.3f}'.lstrip('0') for *_, a in r['curve'])} |")
    if figures is not None:
        plot(arms, figures)
    return "\n".join(lines)


def plot(arms: dict[str, dict[int, dict[str, Any]]], folder: Path) -> None:
    """Accuracy against cumulative tool calls and against iteration: a thin line per seed, the mean bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    for xi, label, name in (
        (1, "cumulative tool calls", "study_accuracy_vs_tool_calls.png"),
        (0, "iteration", "study_accuracy_vs_iteration.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k, (arm, seeds) in enumerate(arms.items()):
            color = f"C{k}"
            curves = [r["curve"] for r in seeds.values()]
            for c in curves:
                ax.plot([p[xi] for p in c], [p[3] for p in c], color=color, alpha=0.25, linewidth=0.7)
            n = min(len(c) for c in curves)
            ax.plot(
                [sum(c[i][xi] for c in curves) / len(curves) for i in range(n)],
                [sum(c[i][3] for c in curves) / len(curves) for i in range(n)],
                color=color,
                linewidth=2.2,
                marker="o",
                label=f"{arm.upper()} (mean of {len(curves)} seeds)",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (128 test tasks)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
