"""ARPO's claim F1 at small scale: token entropy rises right after tool results (the paper's Figure 1 left).

    python -m studies.entropy_after_tools runs/compare/compare_grpo/seed_0/trees/iter_000001.jsonl [more] \
        --window 30 --output runs/f1
    python -m studies.entropy_after_tools --sample runs/quickstart/sft --prompts 8 --budget 4 --output runs/f1
    python -m studies.entropy_after_tools --sample runs/quickstart/sft --data valid --prompts 16 --output runs/f1v

Reads rollout trees, one group per line: a run's recorded chunks (``trees/iter_*.jsonl``, recorded by default) or
the file ``--sample`` writes (the entropies are the rollout policy's, per sampled token)
and, around every tool result of every trajectory, takes the sampled tokens' entropies at positions -window..-1
(the tokens before the call's result, i.e. the end of the call) and 0..window-1 (the first tokens after the result).
Each shared prefix counts once (branches' inherited tokens are skipped). Writes ``f1.json`` (mean, sd, n per offset;
mean over the first turn as a baseline; ``paper_rule_rise_rate``: the fraction of tool results after which the
paper rule (k = 20) sees an entropy rise, i.e. would branch) and ``f1_entropy_vs_position.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from arpo_algo.rollout import metrics as MK


def windows(trajectory: dict, window: int, start: int) -> dict[int, list[float]]:
    """Entropies by offset from each tool result's end (0 = first sampled token after it), own tokens only."""
    ent, mask = trajectory["entropies"], trajectory["trained_mask"]
    out: dict[int, list[float]] = {}
    n = len(mask)
    for i in range(1, n):
        if mask[i] == 1 and mask[i - 1] == 0:  # a result ends at i
            j = i - 1
            while j >= 0 and mask[j] == 0:
                j -= 1
            before = [k for k in range(j, -1, -1) if mask[k] == 1][:window]  # sampled tokens before the result
            for d, k in enumerate(before):
                if k >= start:
                    out.setdefault(-(d + 1), []).append(ent[k])
            after = [k for k in range(i, n) if mask[k] == 1][:window]
            for d, k in enumerate(after):
                if k >= start:
                    out.setdefault(d, []).append(ent[k])
    return out


def paper_rule_rises(trajectory: dict, k: int = 20) -> list[bool]:
    """Per tool result of an own (non-branch) trajectory, whether the paper rule sees an entropy rise: the mean
    entropy of the first k sampled tokens after the result exceeds that of the first k tokens of the first turn."""
    ent, mask = trajectory["entropies"], trajectory["trained_mask"]
    sampled = [i for i, m in enumerate(mask) if m]
    if not sampled:
        return []
    first_end = mask.index(0) if 0 in mask else len(mask)
    init = [ent[i] for i in sampled if i < first_end][:k]
    h_init = sum(init) / len(init) if init else 0.0
    out = []
    for i in range(1, len(mask)):
        if mask[i] == 1 and mask[i - 1] == 0:
            seg = [ent[j] for j in range(i, len(mask)) if mask[j]][:k]
            out.append(sum(seg) / len(seg) > h_init if seg else False)
    return out


def collect(paths: list[Path], window: int, iterations: set[int] | None) -> tuple[dict[int, list[float]], list[float]]:
    by_off: dict[int, list[float]] = {}
    first_turn: list[float] = []
    for p in paths:
        for line in p.read_text().splitlines():
            g = json.loads(line)
            if iterations is not None and int(g.get("metrics", {}).get(MK.GROUP_STEP, -1)) not in iterations:
                continue
            for t in g["trajectories"]:
                start = t["branch_point"] or 0 if t.get("parent") is not None else 0
                for k, v in windows(t, window, start).items():
                    by_off.setdefault(k, []).extend(v)
                if start == 0:
                    m = t["trained_mask"]
                    end = m.index(0) if 0 in m else len(m)
                    first_turn.extend(t["entropies"][:end])
    return by_off, first_turn


def env_factory(data: str, prompts: int) -> Any:
    """ToolMath level 3 (``data = "toolmath"``), or the first ``prompts`` items of an ``arpo eval --data`` set (e.g.
    the ARPO ``valid`` file) in the environment that set belongs to, with its tools, protocol and reward."""
    import functools

    from arpo_algo.eval.data import load_eval_data, make_eval_env
    from arpo_env.core import ToolTextEnv

    if data == "toolmath":
        return lambda: ToolTextEnv(task="toolmath", levels=[3], max_tool_calls=3)
    loaded = load_eval_data(data, limit=prompts)
    return functools.partial(make_eval_env, loaded.env_id, loaded.env_config, loaded.items)


def sample_dump(
    model: str, prompts: int, budget: int, tokens: int, out: Path, seed: int, data: str = "toolmath"
) -> Path:
    """Sample GRPO groups (independent trajectories, temperature 1) with ``model`` on ``data`` and dump them."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.models import resolve_model_path
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.sampler import TreeSampler

    make_env = env_factory(data, prompts)
    out.mkdir(parents=True, exist_ok=True)
    dump = out / "trees.jsonl"
    dump.unlink(missing_ok=True)
    engine = HFEngine(str(resolve_model_path(model)), seed=seed)
    s = TreeSampler(
        engine,
        make_env,
        TreeConfig.grpo(budget),
        SamplingParams(temperature=1.0),
        max_response_tokens=tokens,
        seed=seed,
    )
    groups, _ = s.sample(list(range(prompts)), step=0)
    s.close()
    dump.write_text("".join(g.to_json() + "\n" for g in groups), encoding="utf-8")
    return dump


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dumps", nargs="*", type=Path, help="trees.jsonl files")
    ap.add_argument("--sample", metavar="MODEL", help="first sample fresh GRPO groups with MODEL on ToolMath level 3")
    ap.add_argument(
        "--data",
        default="toolmath",
        help="with --sample: toolmath (level 3, default) or an `arpo eval --data` set such as valid",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--max-response-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, nargs="*", default=None, help="only these sampler steps")
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--output", type=Path, default=Path("runs/f1"))
    args = ap.parse_args(argv)
    if args.sample:
        args.dumps.append(
            sample_dump(
                args.sample, args.prompts, args.budget, args.max_response_tokens, args.output, args.seed, args.data
            )
        )
    by_off, first = collect(args.dumps, args.window, set(args.iterations) if args.iterations is not None else None)
    if not by_off:
        print("error: no tool results in these dumps", file=sys.stderr)
        return 2
    rows = {}
    for k in sorted(by_off):
        xs = by_off[k]
        m = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1))
        rows[k] = {"mean": m, "sd": sd, "n": len(xs)}
    rises = [
        r
        for p in args.dumps
        for line in p.read_text().splitlines()
        for t in json.loads(line)["trajectories"]
        if t.get("parent") is None
        for r in paper_rule_rises(t)
    ]
    base = sum(first) / len(first) if first else math.nan
    before = [r["mean"] for k, r in rows.items() if -10 <= k < 0]
    after = [r["mean"] for k, r in rows.items() if 0 <= k < 10]
    res = {
        "offsets": rows,
        "first_turn_mean": base,
        "mean_10_before": sum(before) / max(len(before), 1),
        "mean_10_after": sum(after) / max(len(after), 1),
        "dumps": [str(p) for p in args.dumps],
        "iterations": args.iterations,
        "tool_results": len(rises),
        "paper_rule_rise_rate": sum(rises) / len(rises) if rises else math.nan,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "f1.json").write_text(json.dumps(res, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ks = sorted(rows)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(ks, [rows[k]["mean"] for k in ks], marker=".")
        ax.axvline(-0.5, color="grey", ls="--", label="tool result inserted")
        ax.axhline(base, color="green", ls=":", label="first turn mean")
        ax.set_xlabel("sampled-token position relative to the end of a tool result")
        ax.set_ylabel("token entropy (nats)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.output / "f1_entropy_vs_position.png", dpi=100)
        plt.close(fig)
    except ImportError:
        pass
    print(
        json.dumps(
            {
                k: res[k]
                for k in ("first_turn_mean", "mean_10_before", "mean_10_after", "tool_results", "paper_rule_rise_rate")
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
