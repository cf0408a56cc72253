"""The quickstart: pull SmolLM2-135M-Instruct -> SFT on ToolMath demonstrations -> ARPO -> held-out evaluation.

    python -m experiments.quickstart [--output runs/quickstart] [--seed 0] [--threads N]

Stages (each leaves a marker ``.stage_<name>.json`` in the output folder, so a second run skips finished stages and a
killed ARPO stage resumes from its newest checkpoint):

1. ``pull``: the model into ``$ARPO_HOME/models`` (``arpo model pull smollm2-135m-instruct``).
2. ``sft``: cold-start SFT on generated ToolMath demonstrations (tool results masked) -> ``<out>/sft``.
3. ``arpo``: ARPO on ToolMath from the SFT folder with ``experiments/quickstart.toml`` -> ``<out>/arpo``.
4. ``evaluate``: the held-out split, same settings for both: before = the SFT folder, after = the ARPO checkpoint's
   ``policy/`` folder (each loaded from disk into its own engine).
5. ``export``: the trained policy as a plain HF folder ``<out>/policy`` (transformers / vLLM / ``arpo serve``).

Prints a summary (both accuracies, seed, paths) and writes ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
#: Cold-start SFT settings: SmolLM2-135M learns the tool format and levels 1-2 (one tool call) well, and the
#: two-call level 3 only partly; ARPO then trains on level 3, where branching after tool results matters.
SFT_SETTINGS: dict[str, Any] = {"data": "toolmath", "num_examples": 192, "levels": [1, 2, 3], "epochs": 1,
                                "lr": 2e-4, "batch_size": 8, "max_seq_len": 512, "log_every": 5}


def run_stage(out: Path, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn`` once: its JSON result is kept in a marker file and returned again on later runs."""
    marker = out / f".stage_{name}.json"
    if marker.is_file():
        print(f"[quickstart] {name}: done earlier, skipping ({marker})", flush=True)
        return json.loads(marker.read_text())
    print(f"[quickstart] {name} ...", flush=True)
    t0 = time.time()
    result = fn()
    result["stage_time_s"] = round(time.time() - t0, 1)
    marker.write_text(json.dumps(result, indent=2))
    print(f"[quickstart] {name}: {result['stage_time_s']} s", flush=True)
    return result


def stage_sft(out: Path, model: str, seed: int, progress: bool) -> dict[str, Any]:
    from arpo_algo.train.sft import SFTConfig, run_sft

    cfg = SFTConfig(model=model, output_dir=str(out / "sft"), seed=seed, progress=progress, **SFT_SETTINGS)
    m = run_sft(cfg)
    return {"path": m["output_dir"], "first_loss": m["first_loss"], "final_loss": m["final_loss"], "steps": m["steps"]}


def load_rl_experiment(sft_dir: str, seed: int, extra: list[str]) -> Any:
    from arpo_algo.run.experiment import load_experiment

    return load_experiment("quickstart", [f"model.path={json.dumps(sft_dir)}", f"experiment.seed={seed}", *extra])


def stage_arpo(out: Path, exp: Any, progress: bool) -> dict[str, Any]:
    from arpo_algo.run.driver import list_checkpoints, train_experiment

    run_dir = out / "arpo"
    resume = run_dir if list_checkpoints(run_dir / "checkpoints") else None
    summary = train_experiment(exp, output=run_dir, resume=resume, progress=progress)
    return {k: summary[k] for k in ("checkpoint", "policy", "learning_curve", "time_s", "final")}


def replot_with_evaluation(rl: dict[str, Any], ev: dict[str, Any], iterations: int) -> None:
    """Add the before/after held-out accuracies to the run's learning curve."""
    from arpo_algo.run.driver import plot_learning_curve

    metrics = Path(rl["learning_curve"]).with_name("metrics.jsonl")
    history = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    history += [{"iteration": 0, "evaluation/accuracy": ev["before"]["accuracy"]},
                {"iteration": iterations, "evaluation/accuracy": ev["after"]["accuracy"]}]
    plot_learning_curve(sorted(history, key=lambda h: h["iteration"]), Path(rl["learning_curve"]))


def stage_evaluate(exp: Any, sft_dir: str, policy_dir: str) -> dict[str, Any]:
    """Both checkpoints from disk, each in its own engine, under the experiment's evaluation settings."""
    from arpo_algo.algorithms.components import env_creator
    from arpo_algo.eval.evaluation import eval_settings, evaluate_engine
    from arpo_algo.rollout.engines.hf import HFEngine

    cfg = exp.config
    settings = eval_settings(cfg).as_kwargs()  # the same mapping training's evaluate() uses (nothing dropped)
    creator = env_creator(cfg, split=cfg.eval_split)
    out: dict[str, Any] = {"settings": {**settings, "split": cfg.eval_split}}
    for name, path in (("before", sft_dir), ("after", policy_dir)):
        engine = HFEngine(path, max_batch_size=cfg.max_batch_size, seed=cfg.seed)
        out[name] = evaluate_engine(engine, creator, **settings)
        print(f"[quickstart]   {name}: accuracy {out[name]['accuracy']:.3f} "
              f"({out[name]['num_tasks']:.0f} held-out tasks)", flush=True)
    return out


def stage_export(out: Path, policy_dir: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = out / "policy"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(policy_dir, dest, ignore=shutil.ignore_patterns("trainer_state.pt"))
    AutoModelForCausalLM.from_pretrained(dest)  # it must load as a plain HF folder
    AutoTokenizer.from_pretrained(dest)
    return {"path": str(dest)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/quickstart", help="output folder (default runs/quickstart)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is faster on a busy machine)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a setting of experiments/quickstart.toml")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from arpo_algo.models import pull
    from arpo_env.errors import ArpoError

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    t0 = time.time()
    try:
        pulled = run_stage(out, "pull", lambda: {"path": str(pull(MODEL, progress=progress))})
        sft = run_stage(out, "sft", functools.partial(stage_sft, out, pulled["path"], args.seed, progress))
        exp = load_rl_experiment(sft["path"], args.seed, args.set)
        rl = run_stage(out, "arpo", functools.partial(stage_arpo, out, exp, progress))
        ev = run_stage(out, "evaluate", functools.partial(stage_evaluate, exp, sft["path"], rl["policy"]))
        replot_with_evaluation(rl, ev, exp.run.iterations)
        export = run_stage(out, "export", functools.partial(stage_export, out, rl["policy"]))
    except ArpoError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 2
    summary = {
        "accuracy_before_sft": ev["before"]["accuracy"], "accuracy_after_arpo": ev["after"]["accuracy"],
        "seed": args.seed, "eval": ev["settings"], "before": ev["before"], "after": ev["after"],
        "paths": {"output": str(out), "sft": sft["path"], "arpo_run": str(out / "arpo"),
                  "checkpoint": rl["checkpoint"], "policy": export["path"], "learning_curve": rl["learning_curve"]},
        "stage_times_s": {k: v["stage_time_s"] for k, v in
                          (("pull", pulled), ("sft", sft), ("arpo", rl), ("evaluate", ev), ("export", export))},
        "this_run_s": round(time.time() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n=== arpo quickstart ===")
    print(f"held-out accuracy  SFT checkpoint: {summary['accuracy_before_sft']:.3f}   "
          f"after ARPO: {summary['accuracy_after_arpo']:.3f}   "
          f"({ev['before']['num_tasks']:.0f} tasks, {ev['settings']['split']} split, "
          f"temperature {ev['settings']['temperature']})")
    print(f"seed {args.seed}   stage times (s): {summary['stage_times_s']}")
    print(f"servable policy:   {export['path']}")
    print(f"learning curve:    {rl['learning_curve']}")
    print(f"summary:           {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
