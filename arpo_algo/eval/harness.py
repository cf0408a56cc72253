"""The ``arpo eval`` harness: models (or an endpoint) x items x K runs -> ``samples.jsonl`` -> reports.

:func:`run_eval` is what the command calls. The output folder holds ``eval_config.json`` (the protocol), and
``samples.jsonl``; a rerun with the same folder and protocol skips the items each model already finished (more items,
``--limit``, or more models may be added); a different protocol (K, temperature, top-p, seed, budget, data,
environment, judge rule) is refused, so one folder never mixes protocols.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from arpo_algo.eval import report as R
from arpo_algo.eval.data import EvalData, make_eval_env
from arpo_algo.eval.evaluation import EvalSettings
from arpo_algo.eval.report import summarize_rows, write_reports
from arpo_algo.eval.runner import (
    SAMPLES_FILE,
    done_items,
    read_samples,
    recorded_runs,
    repair_tail,
    run_engine,
    unique_runs,
)
from arpo_base.errors import ArpoError, ConfigError

CONFIG_FILE = "eval_config.json"
PROTOCOL_KEYS = (
    "data",
    "env_id",
    "env_config",
    "samples",
    "temperature",
    "top_p",
    "seed",
    "max_response_tokens",
    "judge_rule",
)
#: What an endpoint run's response budget counts: an endpoint evaluation is not resumed in a folder whose endpoint
#: runs were counted by another rule (before this one: the generated tokens only, and no such key).
ENDPOINT_BUDGET = "generated tokens and tool results"


def resolve_model(spec: str) -> tuple[str, Path]:
    """``[LABEL=]PATH_OR_NAME`` -> (label, HF folder). A training checkpoint gives its ``policy/``; a run folder its
    newest checkpoint's ``policy/``; a registered name its pulled folder. The label defaults to the folder's (or the
    checkpoint's) name as given."""
    from arpo_algo.models import resolve_model_path

    label, sep, target = spec.partition("=")
    if not sep or Path(spec).expanduser().exists():
        label, target = "", spec
    given = Path(target).expanduser()
    folder = resolve_model_path(target)  # a run folder, a checkpoint or a model folder, told apart by their files
    if not label:
        label = (given.parent.name if given.name == "policy" else given.name) if given.exists() else target
    return label, Path(folder)


def build_engine(kind: str, path: Path, *, max_batch_size: int, device: str, seed: int) -> Any:
    """The engine of ``--engine`` (a registered engine), given those of these options its constructor takes (vLLM
    schedules its own batches and places itself, so it takes the seed only)."""
    from arpo_algo.rollout.engines import build_engine as factory
    from arpo_algo.rollout.engines import engine_spec

    spec = engine_spec(kind, where="--engine")
    given = {"max_batch_size": max_batch_size, "device": device, "seed": seed}
    takes = spec.keywords()
    return factory(kind, model_or_path=str(path), **{k: v for k, v in given.items() if k in takes})


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a model folder or registered name (``--tokenizer``: the served model's)."""
    from transformers import AutoTokenizer

    from arpo_algo.models import resolve_model_path

    path = Path(spec).expanduser()
    if not path.is_dir():  # a registered name (an unknown one is a ConfigError naming the choices)
        path = resolve_model_path(spec)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"--tokenizer {spec!r}: no tokenizer loads from {path} ({str(e).splitlines()[0]})",
            hint="name the served model's folder (it holds tokenizer.json or tokenizer_config.json) "
            "or its registered name",
        ) from None


def tree_writer(out: Path, label: str, tok: Any) -> Any:
    """The rollout-tree writer of one model's runs: ``out/trees/LABEL`` (a label is one path component)."""
    from arpo_algo.eval.trees import FOLDER, TreeWriter

    if not label or label in (".", "..") or "/" in label or "\\" in label:
        raise ConfigError(
            f"the model label {label!r} cannot name its tree folder",
            hint="give a plain label: LABEL=PATH, or --no-trees",
        )
    return TreeWriter(out / FOLDER / label, lambda ids: tok.decode(ids, skip_special_tokens=False), source="eval")


def _check_protocol(out: Path, record: dict[str, Any]) -> None:
    cfg_file = out / CONFIG_FILE
    if cfg_file.is_file():
        old = json.loads(cfg_file.read_text())
        diff = [
            k
            for k in PROTOCOL_KEYS
            if json.dumps(old.get(k), sort_keys=True) != json.dumps(record.get(k), sort_keys=True)
        ]
        if (
            old.get("endpoint")
            and record.get("endpoint")
            and old.get("endpoint_budget") != record.get("endpoint_budget")
        ):
            diff.append("endpoint_budget")  # a local model beside an endpoint in one folder stays allowed
        if diff and (out / SAMPLES_FILE).is_file():
            raise ArpoError(
                f"{out} holds an evaluation with a different protocol ({', '.join(diff)} differ)",
                hint="use a new --output folder, or the same settings to resume",
            )
    out.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(json.dumps(record, indent=2, default=str))


class Progress:
    """A progress bar with the running accuracy (tqdm on stderr), or nothing."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.bar = None
        self.correct = self.runs = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="item", file=sys.stderr)

    def __call__(self, records: list[dict[str, Any]]) -> None:
        self.correct += sum(bool(r["correct"]) for r in records)
        self.runs += len(records)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(pass1=f"{self.correct / max(self.runs, 1):.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_eval(
    models: list[str],
    data: EvalData,
    settings: EvalSettings,
    out: Path,
    *,
    data_name: str,
    engine: str = "hf",
    endpoint: str | None = None,
    endpoint_model: str | None = None,
    tokenizer: str | None = None,
    judge: Any = None,
    items_per_call: int = 1,
    max_batch_size: int = 16,
    device: str = "cpu",
    progress: bool = True,
    charts: bool = True,
    record_trees: bool = True,
    log=print,
) -> dict[str, Any]:
    """Evaluate every model (or the endpoint) on ``data`` and write the reports; returns ``summary.json``'s body.
    With ``record_trees`` each local model's runs are recorded as rollout trees in ``out/trees/LABEL``
    (:mod:`arpo_algo.eval.trees`; ``arpo view``); an endpoint returns text, not tokens, so it records none."""
    from arpo_algo.eval.endpoint import EndpointAgent, run_endpoint, runs_tools_itself, served_models

    if endpoint and models:
        raise ConfigError("give model folders or --endpoint, not both")
    if not endpoint and not models:
        raise ConfigError("nothing to evaluate", hint="name at least one model/checkpoint, or --endpoint URL")
    if tokenizer and not endpoint:
        raise ConfigError(
            "--tokenizer is for --endpoint (a local model brings its own tokenizer)",
            hint="drop --tokenizer, or evaluate through --endpoint URL",
        )
    entries = served_models(endpoint) if endpoint else []
    served = [m.get("id", "") for m in entries]
    specs = [resolve_model(m) for m in models]
    agent = None
    if endpoint:
        name = endpoint_model or (served[0] if served else "default")
        specs = [(f"{name}@endpoint", None)]
        # built before anything is written: an endpoint it cannot budget like a local run is refused up front
        agent = EndpointAgent(
            endpoint,
            name,
            settings,
            server_tools=runs_tools_itself(entries, name),
            tokenizer=load_tokenizer(tokenizer) if tokenizer else None,
        )
    labels = [s[0] for s in specs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"two models share the label {labels}", hint="name them: LABEL=PATH")
    record = {
        "data": data_name,
        "data_description": data.description,
        "env_id": data.env_id,
        "env_config": data.env_config,
        **dataclasses.asdict(settings),
        "judge_rule": getattr(judge, "rule", None),
        "models": labels,
        "endpoint": endpoint,
        "endpoint_budget": ENDPOINT_BUDGET if endpoint else None,
    }
    _check_protocol(out, record)
    log(
        f"[eval] data: {data.description}; {len(data.items)} items"
        + (f" ({data.skipped} skipped: no ground truth)" if data.skipped else "")
    )
    creator = functools.partial(make_eval_env, data.env_id, data.env_config, data.items)
    samples = out / SAMPLES_FILE
    repair_tail(samples)
    score = judge.score if judge is not None else None
    times: dict[str, float] = {}
    for label, path in specs:
        rows = read_samples(samples, log if label == labels[0] else None)  # a damaged line is named once
        skip = done_items(rows, label, settings.samples) & {it["id"] for it in data.items}
        recorded = recorded_runs(rows, label)
        if skip:
            log(f"[eval] {label}: {len(skip)} items already done (resume), {len(data.items) - len(skip)} to run")
        bar = Progress(len(data.items) - len(skip), label, progress)
        t0 = time.perf_counter()
        try:
            if agent is not None:
                run_endpoint(
                    agent,
                    creator,
                    data.items,
                    model=label,
                    out_file=samples,
                    skip=skip,
                    recorded=recorded,
                    score=score,
                    on_item=bar,
                )
            elif len(skip) < len(data.items):
                eng = build_engine(engine, path, max_batch_size=max_batch_size, device=device, seed=settings.seed)
                try:
                    run_engine(
                        eng,
                        creator,
                        data.items,
                        settings,
                        model=label,
                        out_file=samples,
                        skip=skip,
                        items_per_call=items_per_call,
                        recorded=recorded,
                        score=score,
                        on_item=bar,
                        trees=tree_writer(out, label, eng.tokenizer) if record_trees else None,
                    )
                finally:
                    close = getattr(eng, "close", None)
                    if close:
                        close()
        finally:
            bar.close()
        times[label] = round(time.perf_counter() - t0, 1)
    ids = {it["id"] for it in data.items}
    rows, dropped = unique_runs([r for r in read_samples(samples) if r["model"] in labels and r["item_id"] in ids])
    if dropped:
        log(
            f"[eval] {samples} records {dropped} run(s) twice (same model, item and run); the first record of each "
            "is counted, the later ones are ignored"
        )
    header = {
        **record,
        "items": len(data.items),
        "skipped_no_ground_truth": data.skipped,
        "columns": data.columns,
        "wall_s_this_run": times,
    }
    if judge is not None:
        header["judge"] = judge.stats()
    body = write_reports(out, rows, labels, header, charts=charts)
    for label in labels:
        s = summarize_rows([r for r in rows if r["model"] == label])
        if s.get(R.ITEMS):
            k = s[R.K]
            log(
                f"[eval] {label}: pass@1 {s[R.PASS_AT_1]:.3f} ± {s[R.PASS_AT_1_CI95]:.3f}  "
                + (f"pass@{k} {s[R.PASS_AT.format(k)]:.3f}  " if k > 1 else "")
                + f"tool calls/run {s[R.TOOL_CALLS_PER_RUN]:.2f}  tokens/run {s[R.TOKENS_PER_RUN]:.0f}"
            )
    log(f"[eval] reports: {out / 'summary.md'}")
    return body
