"""The quickstart's SFT checkpoint against its ARPO checkpoint with ``arpo eval`` (docs/howto/evaluation.md).

    python -m benchmarks.eval_quickstart --quickstart runs/quickstart --output runs/eval_quickstart [--k 4]
        [--toolmath-limit 32] [--valid-limit 50] [--models sft,arpo] [--arpo LABEL=PATH] [--threads 1]
        [--items-per-call 4] [--data toolmath,valid] [--table-only]

Runs two ``arpo eval`` commands (printed first, so they can be rerun by hand; a rerun resumes):

* ToolMath test, the quickstart's evaluation environment (``--experiment quickstart``: level 3, 3 tool calls,
  192 response tokens), the first ``--toolmath-limit`` items;
* the first ``--valid-limit`` items of the ARPO reference ``valid`` set (same budget);

both with K runs per item at temperature 0.6 / top-p 0.95 (the reference evaluation's sampling), then prints, per
data set and model: wall time, pass@1 ± 95% CI, pass@K, tool calls and generated tokens per correct answer, and the
paired difference.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from arpo_algo.eval import report as R


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    q = Path(args.quickstart)
    specs = {"sft": f"sft={q / 'sft'}", "arpo": args.arpo or f"arpo={q / 'arpo'}"}
    models = [specs[m] for m in args.models.split(",")]
    common = [
        "--experiment",
        "quickstart",
        "--set",
        f"model.path={json.dumps(str(q / 'sft'))}",
        "--k",
        str(args.k),
        "--temperature",
        "0.6",
        "--top-p",
        "0.95",
        "--items-per-call",
        str(args.items_per_call),
        "--no-progress",
    ] + (["--threads", str(args.threads)] if args.threads else [])
    out = Path(args.output)
    return {
        "toolmath": [
            "eval",
            *models,
            "--data",
            "toolmath",
            "--limit",
            str(args.toolmath_limit),
            *common,
            "--output",
            str(out / "toolmath"),
        ],
        "valid": [
            "eval",
            *models,
            "--data",
            "valid",
            "--limit",
            str(args.valid_limit),
            *common,
            "--output",
            str(out / "valid"),
        ],
    }


def table(out: Path) -> str:
    lines = [
        "| data | model | items x K | wall time | pass@1 ± 95% CI | pass@K | tool calls / correct | tokens / correct |",
        "|---|---|---|---|---|---|---|---|",
    ]
    paired = []
    for name in ("toolmath", "valid"):
        f = out / name / "summary.json"
        if not f.is_file():
            continue
        s = json.loads(f.read_text())
        for model, per in s["models"].items():
            a = per[R.OVERALL]
            if not a.get(R.ITEMS):
                continue
            k = a[R.K]
            per_correct = (
                ("n/a", "n/a")
                if a[R.TOOL_CALLS_PER_CORRECT] is None
                else (f"{a[R.TOOL_CALLS_PER_CORRECT]:.2f}", f"{a[R.TOKENS_PER_CORRECT]:.0f}")
            )
            lines.append(
                f"| {name} | {model} | {a[R.ITEMS]} x {k} | {a[R.WALL_S_TOTAL] / 60:.1f} min | "
                f"{a[R.PASS_AT_1]:.3f} ± {a[R.PASS_AT_1_CI95]:.3f} | {a[R.PASS_AT.format(k)]:.3f} | "
                f"{per_correct[0]} | {per_correct[1]} |"
            )
        paired += [
            f"{name}: {p['b']} - {p['a']} = {p['diff']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] ({p['n']} items)"
            for p in s["paired"]
            if p["source"] == "all"
        ]
    return "\n".join(lines + [""] + paired)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eval_quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--quickstart", default="runs/quickstart", help="the quickstart's output folder")
    parser.add_argument("--output", default="runs/eval_quickstart")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--toolmath-limit", type=int, default=32)
    parser.add_argument("--valid-limit", type=int, default=50)
    parser.add_argument("--models", default="sft,arpo", help="comma list of sft, arpo")
    parser.add_argument("--arpo", help="LABEL=PATH of the ARPO checkpoint (default arpo=<quickstart>/arpo, its newest)")
    parser.add_argument("--data", default="toolmath,valid", help="comma list of toolmath, valid")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--items-per-call", type=int, default=4)
    parser.add_argument("--table-only", action="store_true", help="print the table of finished runs")
    args = parser.parse_args(argv)
    from arpo_algo.cli.main import main as arpo

    if not args.table_only:
        for name, cmd in commands(args).items():
            if name not in args.data.split(","):
                continue
            print("$ arpo " + shlex.join(cmd), flush=True)
            rc = arpo(cmd)
            if rc:
                return rc
    print(table(Path(args.output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
