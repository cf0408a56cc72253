"""The quickstart: pull SmolLM2-135M-Instruct -> SFT on ToolMath demonstrations -> ARPO -> held-out evaluation.

    arpo quickstart [--output runs/quickstart] [--seed 0] [--sft-seed 0] [--precision native] [--sft-precision fp32]
                    [--threads N]

``--seed`` is the RL stage's seed; ``--sft-seed`` the SFT stage's, pinned to 0 by default so that every RL seed starts
from the same checkpoint (measured: the SFT stage alone lands anywhere between 0.0 and 1.0 held-out accuracy
depending on its seed, which would drown the RL stage's effect; docs/tutorial.md). ``--precision`` is the compute
precision of the RL learner, ``native`` by default: bf16 autocast where the CPU or GPU multiplies bf16 matrices in
hardware (``arpo doctor``'s ``bf16 matmul`` line), fp32 elsewhere. ``--sft-precision`` is the SFT stage's, ``fp32`` by
default. Evaluation and the rollout engine compute in fp32 either way; the summary records the resolved precisions and
the CPU's flags.

Stages (each leaves a marker ``.stage_<name>.json`` in the output folder, so a second run skips finished stages and a
killed ARPO stage resumes from its newest checkpoint):

1. ``pull``: the model into ``$ARPO_HOME/models`` (``arpo model pull smollm2-135m-instruct``).
2. ``sft``: cold-start SFT on generated ToolMath demonstrations (tool results masked) -> ``<out>/sft``.
3. ``arpo``: ARPO on ToolMath from the SFT folder with ``arpo_algo/run/recipes/quickstart.toml`` -> ``<out>/arpo``.
4. ``evaluate``: the held-out split, same settings for both: before = the SFT folder, after = the ARPO checkpoint's
   ``policy/`` folder (each loaded from disk into its own engine).
5. ``export``: the trained policy as a plain HF folder ``<out>/policy`` (transformers / vLLM / ``arpo serve``).

Before each stage the memory freed by the previous one is handed back to the OS (:func:`release_memory`), so each
stage's peak is its own. Prints a summary (both accuracies, seeds, each stage's wall and CPU time and peak resident
memory, paths, and the multi-seed distribution of docs/results/arpo-vs-grpo.md from
``recipes/quickstart_reference.json``) and writes ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
#: Cold-start SFT settings: SmolLM2-135M learns the tool format and levels 1-2 (one tool call) well, and the
#: two-call level 3 only partly; ARPO then trains on level 3, where branching after tool results matters.
#: ``rows_per_forward`` changes only the memory (same batches, loss and gradients up to float rounding): the worst
#: step peaks at 5.34 GB instead of 6.64 GB. Activation checkpointing would take it to 3.64 GB with bit-identical
#: gradients, but costs a forward per pass that 2-core machines with 6 GB to spare need not pay, so the quickstart
#: leaves it off (``python -m benchmarks.memory_profile --stage sft [--gradient-checkpointing]``,
#: docs/results/memory.md).
SFT_SETTINGS: dict[str, Any] = {
    "data": "toolmath",
    "num_examples": 192,
    "levels": [1, 2, 3],
    "epochs": 1,
    "lr": 2e-4,
    "batch_size": 8,
    "max_seq_len": 512,
    "log_every": 5,
    "rows_per_forward": 4,
    "gradient_checkpointing": False,
}


#: The quickstart's compute precision per stage unless ``--sft-precision`` / ``--precision`` say otherwise, because
#: learning wins over time (docs/results/bf16-cpu.md): after a bf16 SFT (``native`` on a CPU with AVX512-BF16) the RL
#: stage improved no seed, where fp32 improved every one, so SFT stays fp32; a bf16 learner after an fp32 SFT improved
#: all 5 seeds of ARPO (0.675 +- 0.299 against fp32's 0.725 +- 0.261) and of GRPO, so the learner computes natively.
SFT_PRECISION = "fp32"
LEARNER_PRECISION = "native"
#: ``--precision`` choices: the values of ``training.precision`` (arpo_algo.train.device_setup.PRECISIONS, which
#: imports torch; the CLI's argument parser does not).
PRECISION_CHOICES = ("native", "fp32", "bf16", "auto")

#: The quickstart's experiment file and its multi-seed reference figures, shipped with the package.
RECIPES = Path(__file__).with_name("recipes")
REFERENCE = RECIPES / "quickstart_reference.json"


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set (Linux: ``/proc/self/clear_refs`` = 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def release_memory() -> bool:
    """Hand the memory freed by the previous stage back to the OS: ``gc.collect()``, then glibc's ``malloc_trim(0)``.

    Without it the freed model, optimizer state and KV cache of a stage stay in glibc's heap (measured: 2.11 GB resident
    after an SFT run, 0.43 GB after the trim), and the next stage's peak starts from there. Returns whether memory
    was handed back (False on a system without glibc, where only the collection runs)."""
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))


def rss_gb() -> float | None:
    """Current resident memory of this process (``VmRSS``), in GB; None where unavailable."""
    return _status_gb("VmRSS:")


def peak_rss_gb() -> float | None:
    """Peak resident memory of this process since the last reset (``VmHWM``), in GB; None where unavailable."""
    return _status_gb("VmHWM:")


def _status_gb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return round(int(line.split()[1]) / 1024**2, 2)
    except OSError:
        pass
    return None


def process_cpu_s() -> float:
    """CPU seconds (user + system) this process and its finished, waited-for child processes have used: the Python
    tool's sandboxed calls and ``pip download`` count; a process still running (or not this one's child) does not."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_stage(
    out: Path, name: str, fn: Callable[[], dict[str, Any]], inputs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run ``fn`` once: its JSON result is kept in a marker file and returned again on later runs with the same
    ``inputs`` (the arguments the stage's result depends on); a later run with other inputs is refused.

    Invariant: a stage's result is reused only for the arguments that made it, so another ``--seed``, ``--set`` or a
    real run after a smoke run never reports an earlier run's numbers as its own.

    Records the stage's wall time, its CPU time (:func:`process_cpu_s`: against the wall time it says how many
    cores the stage kept busy, and it is less sensitive than the wall time to other work on the machine) and its
    peak resident memory (the memory freed by earlier stages is handed back
    and the process's peak reset before the stage, so each stage's figure is its own; ``rss_start_gb`` is what the
    stage started from; a stage skipped as done keeps the figures of the run that did it)."""
    from arpo_base.errors import ConfigError

    inputs = dict(inputs or {})
    marker = out / f".stage_{name}.json"
    if marker.is_file():
        try:
            done = json.loads(marker.read_text())
        except json.JSONDecodeError:
            done = {}
        recorded = done.get("inputs")
        if isinstance(recorded, dict):
            recorded = with_old_precisions(recorded, inputs)
        if recorded != inputs:
            raise ConfigError(
                f"{out} holds the quickstart's {name} stage done with {recorded}; this run asks for {inputs}",
                hint="give this run its own --output folder (or delete that one)",
            )
        print(f"[quickstart] {name}: done earlier with the same arguments, skipping ({marker})", flush=True)
        return done
    print(f"[quickstart] {name} ...", flush=True)
    t0, cpu0 = time.time(), process_cpu_s()
    release_memory()
    reset = reset_peak_rss()
    start_rss = rss_gb()
    result = fn()
    result["stage_time_s"] = round(time.time() - t0, 1)
    result["stage_cpu_s"] = round(process_cpu_s() - cpu0, 1)
    result["peak_rss_gb"] = peak_rss_gb() if reset else None
    result["rss_start_gb"] = start_rss
    result["inputs"] = inputs
    marker.write_text(json.dumps(result, indent=2))
    print(f"[quickstart] {name}: {result['stage_time_s']} s (CPU {result['stage_cpu_s']} s)", flush=True)
    return result


def with_old_precisions(recorded: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """A stage marker written by an earlier version, read with the precisions that version computed in.

    Invariant: a finished stage is reused exactly when it computed what this run asks for. Before ``--precision``
    existed every stage ran in fp32; before ``--sft-precision`` existed one ``--precision`` set both SFT and the
    learner, so the learner's was the recorded ``precision``."""
    old = dict(recorded)
    if "precision" in inputs and "precision" not in old:
        old["precision"] = "fp32"
    if "learner_precision" in inputs and "learner_precision" not in old:
        old["learner_precision"] = old.get("precision", "fp32")
    return old


def stage_inputs(stage: str, sft_seed: int = 0, precision: str = SFT_PRECISION) -> dict[str, Any]:
    """The arguments the ``pull`` or ``sft`` stage's result depends on (what its marker must record to be reused);
    ``precision`` is the SFT stage's."""
    from arpo_algo.run import smoke

    if stage == "pull":
        return {"model": MODEL}
    return {"model": MODEL, "sft_seed": sft_seed, "precision": precision, "smoke": smoke.smoke()}


def stage_sft(out: Path, model: str, seed: int, progress: bool, precision: str = SFT_PRECISION) -> dict[str, Any]:
    from arpo_algo.run import smoke
    from arpo_algo.train.sft import SFTConfig, run_sft

    settings = {**SFT_SETTINGS, "precision": precision}
    if smoke.smoke():
        smoke.announce("the quickstart's SFT stage")
        settings["num_examples"] = smoke.capped(settings["num_examples"], smoke.SFT_EXAMPLES)
    cfg = SFTConfig(model=model, output_dir=str(out / "sft"), seed=seed, progress=progress, **settings)
    m = run_sft(cfg)
    return {
        "path": m["output_dir"],
        "first_loss": m["first_loss"],
        "final_loss": m["final_loss"],
        "steps": m["steps"],
        "precision": m["compute"]["precision"],
    }


def load_rl_experiment(sft_dir: str, seed: int, extra: list[str]) -> Any:
    from arpo_algo.run.experiment import load_experiment

    return load_experiment("quickstart", [f"model.path={json.dumps(sft_dir)}", f"experiment.seed={seed}", *extra])


def stage_arpo(out: Path, exp: Any, progress: bool) -> dict[str, Any]:
    from arpo_algo.models.checkpoints import list_checkpoints
    from arpo_algo.run.driver import train_experiment

    run_dir = out / "arpo"
    resume = run_dir if list_checkpoints(run_dir / "checkpoints") else None
    summary = train_experiment(exp, output=run_dir, resume=resume, progress=progress)
    return {k: summary[k] for k in ("checkpoint", "policy", "learning_curve", "time_s", "final")}


def replot_with_evaluation(rl: dict[str, Any], ev: dict[str, Any], iterations: int) -> None:
    """Add the before/after held-out accuracies to the run's learning curve."""
    from arpo_algo.run.driver import EVAL_ACCURACY, plot_learning_curve, read_metrics

    history = read_metrics(Path(rl["learning_curve"]).with_name("metrics.jsonl"))
    history += [
        {"iteration": 0, EVAL_ACCURACY: ev["before"]["accuracy"]},
        {"iteration": iterations, EVAL_ACCURACY: ev["after"]["accuracy"]},
    ]
    plot_learning_curve(sorted(history, key=lambda h: h["iteration"]), Path(rl["learning_curve"]))


def stage_evaluate(exp: Any, sft_dir: str, policy_dir: str) -> dict[str, Any]:
    """Both checkpoints from disk, each in its own engine, under the experiment's evaluation settings and the
    engine settings of its ``[rollouts]`` (``--set rollouts.hf.decode=static`` decodes the evaluation that way too;
    each result records the decode path its engine took), but at a batch of one held-out chunk
    (:data:`~arpo_algo.eval.evaluation.EVAL_CHUNK` rows): greedy answers do not depend on the batch
    (``python -m benchmarks.eval_batch``; tests/benchmarks/test_eval_batch.py), so the widest batch is the
    fastest way to the same numbers."""
    from arpo_algo.algorithms.components import env_creator
    from arpo_algo.eval.evaluation import EVAL_CHUNK, eval_settings, evaluate_engine
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    cfg = exp.config
    settings = eval_settings(cfg).as_kwargs()  # the same mapping training's evaluate() uses (nothing dropped)
    split = cfg.settings.evaluation.split
    creator = env_creator(cfg, split=split)
    rollouts = cfg.settings.rollouts
    out: dict[str, Any] = {"settings": {**settings, "split": split}}
    for name, path in (("before", sft_dir), ("after", policy_dir)):
        kwargs = {**rollouts.hf.engine_kwargs(), "max_batch_size": EVAL_CHUNK}
        engine = HFEngine(path, **kwargs, device=rollouts.device, seed=cfg.seed)
        out[name] = {**evaluate_engine(engine, creator, **settings), "decode": engine.decode, "batch": EVAL_CHUNK}
        print(
            f"[quickstart]   {name}: accuracy {out[name]['accuracy']:.3f} "
            f"({out[name]['num_tasks']:.0f} held-out tasks)",
            flush=True,
        )
    return out


def stage_export(out: Path, policy_dir: str, held_out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy the policy out as a plain HF folder; its model card gets the held-out score the evaluate stage measured."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arpo_algo.models.card import rewrite_card

    dest = out / "policy"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(policy_dir, dest, ignore=shutil.ignore_patterns("trainer_state.pt"))
    rewrite_card(dest, **({"held_out": held_out} if held_out else {}))
    AutoModelForCausalLM.from_pretrained(dest)  # it must load as a plain HF folder
    AutoTokenizer.from_pretrained(dest)
    return {"path": str(dest)}


def precision_summary(settings: dict[str, str], sft: dict[str, Any], exp: Any) -> dict[str, Any]:
    """What each stage computed in (resolved on this machine from ``settings``, the ``sft`` and ``learner`` options)
    and the CPU flags that decided it."""
    import torch

    from arpo_algo.train.device_setup import cpu_capability, resolve_precision

    training = exp.config.settings.training.precision
    device = torch.device(exp.config.settings.rollouts.device)
    return {
        "setting": dict(settings),
        # None: an SFT stage done by an earlier version that did not report it
        "sft": sft.get("precision"),
        "arpo": resolve_precision(training, device),
        "evaluation": "fp32",
        "cpu": cpu_capability(),
    }


def precision_line(p: dict[str, Any]) -> str:
    flags = ", ".join(p["cpu"]["flags"]) or "unknown"
    asked = p["setting"]
    return (
        f"precision: SFT {p['sft']} (asked {asked['sft']}), ARPO learner {p['arpo']} (asked {asked['learner']}), "
        f"evaluation {p['evaluation']} (CPU flags: {flags})"
    )


def reference_line(summary: dict[str, Any]) -> str:
    """This seed's result beside the distribution over seeds of docs/results/arpo-vs-grpo.md (same recipe, SFT seed)."""
    if not REFERENCE.is_file():
        return "multi-seed reference: none recorded (arpo_algo/run/recipes/quickstart_reference.json)"
    ref = json.loads(REFERENCE.read_text())
    lines = [
        f"this seed: {summary['accuracy_after_sft']:.3f} -> {summary['accuracy_after_arpo']:.3f}; "
        f"measured in {ref.get('precision', 'fp32')} over {ref['num_seeds']} RL seeds from the SFT seed "
        f"{ref['sft_seed']} checkpoint "
        f"({ref['machine']}; {ref['command']}):"
    ]
    for name, r in ref["configurations"].items():
        lines.append(
            f"  {name:>5}: before {r['before']:.3f}, after {r['after_mean']:.3f} ± {r['after_sd']:.3f} "
            f"(sd), improved on {r['improved']} of {r.get('seeds', ref['num_seeds'])} seeds, "
            f"worse on {r['worse']}"
        )
    cfgs = ref["configurations"]
    if "arpo" in cfgs and "grpo" in cfgs:
        a, g = cfgs["arpo"], cfgs["grpo"]
        beats = a["after_mean"] - a["after_sd"] > g["after_mean"] + g["after_sd"]
        lines.append(
            f"  ARPO {'beats' if beats else 'does not beat'} GRPO at this size "
            f"({a['after_mean']:.3f} ± {a['after_sd']:.3f} against "
            f"{g['after_mean']:.3f} ± {g['after_sd']:.3f})"
        )
    if ref.get("note"):
        lines.append(f"  {ref['note']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quickstart's options (shared by ``arpo quickstart`` and ``python -m arpo_algo.run.quickstart``)."""
    parser.add_argument("--output", default="runs/quickstart", help="output folder (default runs/quickstart)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RL stage (default 0)")
    parser.add_argument(
        "--sft-seed",
        type=int,
        default=0,
        help="seed of the SFT stage (default 0: every RL seed starts from the same checkpoint)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default=LEARNER_PRECISION,
        help="compute precision of the RL learner (default native: bf16 where the CPU or GPU multiplies bf16 "
        "matrices in hardware, fp32 elsewhere; measured to learn as fp32 does; evaluation stays fp32)",
    )
    parser.add_argument(
        "--sft-precision",
        choices=PRECISION_CHOICES,
        default=SFT_PRECISION,
        help="compute precision of the SFT stage (default fp32: after a native SFT the RL stage was measured to "
        "learn nothing)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; 1 is faster on a busy machine)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a setting of the quickstart experiment (arpo_algo/run/recipes/quickstart.toml)",
    )
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Run (or finish) every stage into ``args.output`` and print the summary. User mistakes raise ArpoError."""
    import torch

    from arpo_algo.models import pull

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    t0 = time.time()
    sft_inputs = stage_inputs("sft", args.sft_seed, args.sft_precision)
    rl_inputs = {**sft_inputs, "learner_precision": args.precision, "seed": args.seed, "set": list(args.set)}
    pulled = run_stage(out, "pull", lambda: {"path": str(pull(MODEL, progress=progress))}, stage_inputs("pull"))
    make_sft = functools.partial(stage_sft, out, pulled["path"], args.sft_seed, progress, args.sft_precision)
    sft = run_stage(out, "sft", make_sft, sft_inputs)
    # the learner's precision first, so that a --set training.precision=... still has the last word
    exp = load_rl_experiment(sft["path"], args.seed, [f"training.precision={json.dumps(args.precision)}", *args.set])
    rl = run_stage(out, "arpo", functools.partial(stage_arpo, out, exp, progress), rl_inputs)
    ev = run_stage(out, "evaluate", functools.partial(stage_evaluate, exp, sft["path"], rl["policy"]), rl_inputs)
    replot_with_evaluation(rl, ev, exp.run.iterations)
    held_out = {k: ev["after"].get(k) for k in ("accuracy", "num_tasks")} | {"split": ev["settings"]["split"]}
    export = run_stage(out, "export", functools.partial(stage_export, out, rl["policy"], held_out), rl_inputs)
    stages = {"pull": pulled, "sft": sft, "arpo": rl, "evaluate": ev, "export": export}
    summary = {
        "accuracy_after_sft": ev["before"]["accuracy"],
        "accuracy_after_arpo": ev["after"]["accuracy"],
        "seed": args.seed,
        "sft_seed": args.sft_seed,
        "precision": precision_summary({"sft": args.sft_precision, "learner": args.precision}, sft, exp),
        "eval": ev["settings"],
        "before": ev["before"],
        "after": ev["after"],
        "paths": {
            "output": str(out),
            "sft": sft["path"],
            "arpo_run": str(out / "arpo"),
            "checkpoint": rl["checkpoint"],
            "policy": export["path"],
            "learning_curve": rl["learning_curve"],
        },
        "stage_times_s": {k: v["stage_time_s"] for k, v in stages.items()},
        # None: a stage done by an earlier version that did not record it
        "stage_cpu_s": {k: v.get("stage_cpu_s") for k, v in stages.items()},
        "peak_rss_gb": {k: v.get("peak_rss_gb") for k, v in stages.items()},
        "this_run_s": round(time.time() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n=== arpo quickstart ===")
    print(
        f"held-out accuracy  SFT checkpoint: {summary['accuracy_after_sft']:.3f}   "
        f"after ARPO: {summary['accuracy_after_arpo']:.3f}   "
        f"({ev['before']['num_tasks']:.0f} tasks, {ev['settings']['split']} split, "
        f"temperature {ev['settings']['temperature']})"
    )
    print(f"seed {args.seed} (SFT seed {args.sft_seed})   stage times (s): {summary['stage_times_s']}")
    print(precision_line(summary["precision"]))
    print(f"CPU time per stage (s, this process and its finished children): {summary['stage_cpu_s']}")
    print(f"peak resident memory per stage (GB): {summary['peak_rss_gb']}")
    print(reference_line(summary))
    print(f"servable policy:   {export['path']}")
    print(f"learning curve:    {rl['learning_curve']}")
    print(f"summary:           {out / 'summary.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from arpo_base.errors import ArpoError

    parser = argparse.ArgumentParser(prog="python -m arpo_algo.run.quickstart", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ArpoError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
