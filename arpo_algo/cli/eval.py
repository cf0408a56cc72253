"""``arpo eval``: K runs per item with the training protocol; pass@1 ± CI, pass@k, maj@k, costs, paired tables.

See :mod:`arpo_algo.eval.harness` (the run and resume), :mod:`arpo_algo.eval.data` (``--data``),
:mod:`arpo_algo.eval.metrics` (definitions), :mod:`arpo_algo.eval.judge` (``--judge``) and
:mod:`arpo_algo.eval.endpoint` (``--endpoint``).

Settings come from, in order: the command line, ``--experiment`` (its evaluation settings through
:func:`arpo_algo.eval.evaluation.eval_settings`, and its environment config when the data runs in the same
environment), then the defaults below (the reference evaluation's sampling,
docs/concepts/reference-choices.md#evaluation-protocol).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from arpo_algo.rollout.engines import engine_names

DEFAULTS = {
    "k": 4,
    "temperature": 0.6,
    "top_p": 0.95,
    "seed": 0,
    "max_response_tokens": 512,
    "tool_workers": 8,
    "prompt_overflow": "error",
}


def _env_overrides(items: list[str]) -> dict[str, Any]:
    """``--env-set key=value`` items (the shared override syntax, no sections) as an env config dict."""
    from arpo_base.options import apply_overrides

    return apply_overrides({}, items, flag="--env-set")


def data_env_config(
    data: str, env: str | None, exp_env: dict[str, Any], exp_env_id: str | None, overrides: dict[str, Any]
) -> dict[str, Any]:
    """The environment settings ``--data`` is loaded with: the ``--experiment``'s ``[env]`` when it is the same
    environment (its split aside: ``--split`` chooses), then ``--env-set``. A reference set names its own file, so
    the experiment's ``data_files`` (its training or test files) never replaces it."""
    from arpo_algo.eval.data import REFERENCE_SETS, data_env_id

    if not (exp_env_id and exp_env_id == data_env_id(data, env)):
        return overrides
    dropped = {"split", "data_files"} if data in REFERENCE_SETS else {"split"}
    return {**{k: v for k, v in exp_env.items() if k not in dropped}, **overrides}


def resolve_settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str | None]:
    """(EvalSettings, env config from the experiment, the experiment's env id) from flags > experiment > defaults."""
    from arpo_algo.eval.evaluation import EvalSettings, eval_settings

    base = dict(DEFAULTS)
    exp_env: dict[str, Any] = {}
    exp_env_id = None
    if args.experiment:
        from arpo_algo.run.experiment import load_experiment

        cfg = load_experiment(args.experiment, args.set or []).config
        s = eval_settings(cfg)
        base.update(
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            max_response_tokens=s.max_response_tokens,
            tool_workers=s.tool_workers,
            prompt_overflow=s.prompt_overflow,
        )
        exp_env, exp_env_id = dict(cfg.env_config), cfg.env
    flags = {
        "k": args.k,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "max_response_tokens": args.max_response_tokens,
        "tool_workers": args.tool_workers,
    }
    base.update({k: v for k, v in flags.items() if v is not None})
    from arpo_base.errors import ConfigError

    if base["k"] < 1:
        raise ConfigError(f"--k must be >= 1, got {base['k']}")
    if base["temperature"] < 0 or not 0 < base["top_p"] <= 1:
        raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    from arpo_algo.run import smoke

    settings = EvalSettings(
        num_prompts=None,
        samples=base["k"],
        temperature=base["temperature"],
        # under ARPO_SMOKE an evaluation's responses are as short as an experiment's, with or without --experiment
        max_response_tokens=smoke.capped(base["max_response_tokens"], smoke.RESPONSE_TOKENS),
        top_p=base["top_p"],
        tool_workers=base["tool_workers"],
        prompt_overflow=base["prompt_overflow"],
        seed=base["seed"],
    )
    return settings, exp_env, exp_env_id


def cmd_eval(args: argparse.Namespace) -> int:
    """Handler of ``arpo eval``."""
    from arpo_algo.eval.data import load_eval_data
    from arpo_algo.eval.harness import run_eval

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    settings, exp_env, exp_env_id = resolve_settings(args)
    overrides = data_env_config(args.data, args.env, exp_env, exp_env_id, _env_overrides(args.env_set or []))
    from arpo_algo.run import smoke

    if smoke.smoke():
        smoke.announce("arpo eval")
    limit = smoke.capped(args.limit, smoke.EVAL_ITEMS)
    data = load_eval_data(args.data, split=args.split, limit=limit, env=args.env, env_config=overrides)
    out = Path(args.output or Path("runs") / "eval" / f"{Path(args.data).stem.replace('/', '_')}-k{settings.samples}")
    judge = None
    if args.judge:
        from arpo_algo.eval.judge import Judge

        out.mkdir(parents=True, exist_ok=True)
        judge = Judge(
            args.judge, model=args.judge_model, cache_dir=out, rule=args.judge_rule, retries=args.judge_retries
        )
    if settings.temperature == 0 and settings.samples > 1:
        print(f"[eval] note: greedy decoding (temperature 0) makes the {settings.samples} runs of an item identical")
    run_eval(
        args.models,
        data,
        settings,
        out,
        data_name=args.data,
        engine=args.engine,
        endpoint=args.endpoint,
        endpoint_model=args.endpoint_model,
        tokenizer=args.tokenizer,
        judge=judge,
        items_per_call=args.items_per_call,
        max_batch_size=args.max_batch_size,
        device=args.device,
        progress=not args.no_progress,
        charts=not args.no_charts,
        record_trees=not args.no_trees,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo eval``."""
    p = sub.add_parser(
        "eval",
        help="evaluate models or an endpoint: pass@1 ± CI, pass@k, maj@k, costs",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="[LABEL=]model folder, training checkpoint, run folder or registered name (several: a table "
        "side by side and paired differences against the first)",
    )
    p.add_argument(
        "--data",
        required=True,
        help="toolmath | valid | gaia_test | hle_test | train_10k | hard_search_1k | an env id | a "
        ".jsonl/.json/.parquet file with question/prompt and answer columns",
    )
    p.add_argument("--split", default="test", help="split of toolmath / an env id (default test)")
    p.add_argument("--k", type=int, help=f"runs per item (default {DEFAULTS['k']})")
    p.add_argument("--limit", type=int, help="first N items (with a ground truth)")
    p.add_argument("--temperature", type=float, help=f"default {DEFAULTS['temperature']} (reference evaluation)")
    p.add_argument("--top-p", type=float, help=f"default {DEFAULTS['top_p']}")
    p.add_argument("--seed", type=int, help="base seed of the runs (default 0)")
    p.add_argument(
        "--max-response-tokens", type=int, help=f"budget per run (default {DEFAULTS['max_response_tokens']})"
    )
    p.add_argument("--tool-workers", type=int, help="threads for tool calls")
    p.add_argument("--experiment", help="take sampling, budget and env settings from this experiment file")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override an --experiment setting")
    p.add_argument("--env", help="environment for a data file (default arpo/Reasoning-v0; e.g. arpo/ToolMath-v0)")
    p.add_argument("--env-set", action="append", metavar="KEY=VALUE", help="environment config key (TOML value)")
    p.add_argument("--output", help="output folder (default runs/eval/<data>-k<K>); a rerun resumes it")
    p.add_argument("--engine", default="hf", choices=engine_names(), help="rollout engine (default hf)")
    p.add_argument("--device", default="cpu", help="device of the HF engine")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is faster on a busy machine)")
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded at once")
    p.add_argument(
        "--items-per-call", type=int, default=1, help="items sampled together (faster; a crash loses at most these)"
    )
    p.add_argument("--endpoint", metavar="URL", help="evaluate an OpenAI-compatible server instead of a model")
    p.add_argument("--endpoint-model", help="model name to request from --endpoint (default: its first model)")
    p.add_argument(
        "--tokenizer",
        metavar="MODEL",
        help="the --endpoint model's tokenizer (folder or registered name): tool results run here count "
        "against --max-response-tokens as in a local run",
    )
    p.add_argument("--judge", metavar="URL", help="LLM judge: an OpenAI-compatible server")
    p.add_argument("--judge-model", help="judge model name (default: the judge server's first model)")
    p.add_argument(
        "--judge-rule",
        default="reference",
        choices=("reference", "judge"),
        help="reference: string equivalence OR judge says correct (default); judge: the judge alone",
    )
    p.add_argument("--judge-retries", type=int, default=3, help="retries with backoff before a run is unjudged")
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    p.add_argument(
        "--no-trees",
        action="store_true",
        help="do not record the runs as rollout trees (default: OUTPUT/trees/LABEL, for arpo view)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)
