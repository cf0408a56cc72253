"""Run K agent runs per item for one model and append one JSON line per run to ``samples.jsonl`` (resumable).

The runs go through the training rollout code itself: :func:`arpo_algo.rollout.agent_loop.run_agents` (the agent
loop the tree sampler, eval and serve share) over the training environment's session (same protocol, stop strings,
result template, tool limits) and its reward. Run r of item i is seeded by ``(seed, step 0, item index, r, request)``
exactly as trajectory r of that prompt in a GRPO-mode sampler step, and its persistent interpreters draw from the seed
that trajectory's do, so it has the same tokens and tool outputs as in training (tested), two models see the same
seeds, and a rerun gives the same tokens.

Resume: an item is done for a model when its K runs are in ``samples.jsonl``; done items are not run again. The runs of
``items_per_call`` items are sampled together and written as soon as that call returns, so a crash loses at most
those items (1 by default). A crash in the middle of an item's write leaves some of its runs and a torn line: the
torn tail is cut before anything is appended (:func:`repair_tail`) and only the runs not recorded are run (each run
has its own seed, so they are the runs an uninterrupted evaluation makes). A (model, item, run) recorded twice is
counted once, the first record (:func:`unique_runs`).
"""

from __future__ import annotations

import json
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arpo_algo.eval.evaluation import EvalSettings
from arpo_algo.rollout.metrics import is_correct
from arpo_base.errors import ArpoError
from arpo_env.rewards import exact_match, extract_answer, f1, math_equiv, normalize_answer, parse_number

if TYPE_CHECKING:
    from arpo_algo.rollout.engines.base import RolloutEngine

SAMPLES_FILE = "samples.jsonl"


def read_samples(path: Path, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows of ``samples.jsonl``; a line that is not JSON (a write cut short by a crash) is dropped, and named to
    ``log`` unless it is the last line (:func:`repair_tail` cuts that one before a resume appends)."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if log is not None and n < len(lines):
                log(f"[eval] {path} line {n} is not JSON (a write cut short); ignored, its runs run again")
    return rows


def repair_tail(path: Path) -> None:
    """Cut a torn last line (a crash mid-write) so the next append starts on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def recorded_runs(rows: Iterable[dict[str, Any]], model: str) -> dict[str, set[int]]:
    """The run indices recorded per item id for ``model``."""
    runs: dict[str, set[int]] = {}
    for r in rows:
        if r.get("model") == model:
            runs.setdefault(r["item_id"], set()).add(int(r["run"]))
    return runs


def done_items(rows: Iterable[dict[str, Any]], model: str, k: int) -> set[str]:
    """Item ids with all K runs recorded for ``model``."""
    return {i for i, rs in recorded_runs(rows, model).items() if rs >= set(range(k))}


def unique_runs(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``(rows, dropped)``: the first record of each (model, item, run) in file order and how many later ones
    were dropped. Invariant: every statistic sees one record per run, whatever a file holds."""
    seen: set[tuple[str, str, int]] = set()
    out = []
    for r in rows:
        key = (r["model"], r["item_id"], int(r["run"]))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out, len(rows) - len(out)


def vote_key(answer: str | None) -> str | None:
    """The answer's key in a majority vote: a plain number by its value (``-6,000,000`` and ``-6000000`` vote
    together; ``-6000000`` and ``6000000`` do not), anything else by the reference QA normalisation. Invariant: two
    answers share a key only when the scorers could call them the same (the QA normalisation drops punctuation, so
    it would merge a number with its negation or ``261.20`` with ``2612.0``)."""
    if answer is None:
        return None
    number = parse_number(answer)
    return f"number:{number:.12g}" if number is not None else normalize_answer(answer)


def rule_scores(text: str, ground_truth: Any, reward_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Exact match, token F1 and math equivalence of a response's extracted answer (arpo_env's scorers)."""
    answer = extract_answer(text)
    return {
        "answer": answer,
        "answer_norm": vote_key(answer),
        "exact_match": float(exact_match(text, ground_truth)[0] >= 1.0),
        "f1": max(0.0, float(f1(text, ground_truth)[0])),
        "math_equiv": float(math_equiv(text, ground_truth, **reward_kwargs)[0] >= 1.0),
    }


def make_record(
    model: str,
    item: dict[str, Any],
    index: int,
    run: int,
    *,
    text: str,
    reward: float,
    reward_info: dict[str, Any],
    correct: bool,
    finish_reason: str,
    tool_calls: list[dict[str, Any]],
    generated_tokens: int,
    response_tokens: int,
    wall_s: float,
    **extra: Any,
) -> dict[str, Any]:
    """One line of ``samples.jsonl``: trajectory, tool calls, scores and costs of one run."""
    scores = rule_scores(text, item["ground_truth"], item.get("reward_kwargs") or {})
    return {
        "model": model,
        "item_id": item["id"],
        "index": index,
        "run": run,
        "source": item.get("source", ""),
        "question": item["question"],
        "ground_truth": item["ground_truth"],
        "response": text,
        "finish_reason": finish_reason,
        "reward": float(reward),
        "reward_info": reward_info,
        "correct_rule": bool(correct),
        "correct": bool(correct),
        **scores,
        "tool_calls": [
            {k: c.get(k) for k in ("tool", "args", "output", "error", "latency_s", "cache_hit")} for c in tool_calls
        ],
        "num_tool_calls": len(tool_calls),
        "generated_tokens": int(generated_tokens),
        "response_tokens": int(response_tokens),
        "wall_s": round(wall_s, 4),
        **extra,
    }


def missing_runs(recorded: dict[str, set[int]] | None, item_id: str, k: int) -> list[int]:
    """The run indices of ``item_id`` still to run. Invariant: a resume never writes a (model, item, run) that is
    already recorded."""
    have = (recorded or {}).get(item_id, set())
    return [r for r in range(k) if r not in have]


def _chunks(seq: list[int], n: int) -> Iterable[list[int]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _seed(base: int, index: int, run: int, n: int) -> int:
    """Request n of run ``run`` of item ``index``: the seed the GRPO sampler gives trajectory ``run`` at step 0."""
    from arpo_algo.core.tree import derive_seed

    return derive_seed(base, 0, index, run, n)


def _fit_prompt(ids: list[int], limit: int | None, settings: EvalSettings, item: dict[str, Any]) -> list[int]:
    """The sampler's prompt-overflow rule (``prompt_overflow``: error or left_truncate)."""
    if limit is None or len(ids) <= limit:
        return ids
    if settings.prompt_overflow == "error":
        raise ArpoError(
            f"the prompt of item {item['id']} has {len(ids)} tokens, more than the {limit} allowed "
            f"(context minus max_response_tokens={settings.max_response_tokens})",
            hint="lower --max-response-tokens, or use an experiment with prompt_overflow='left_truncate'",
        )
    return ids[-limit:]


def env_reward(env: Any, item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The environment's reward of its (finished) conversation, as ``ToolTextEnv`` computes it at the end."""
    kwargs = {**(item.get("reward_kwargs") or {}), **env.config["reward_kwargs"]}
    score, breakdown = env.reward_fn(env.response, item["ground_truth"], **kwargs)
    return float(score), {"reward_name": env.config["reward"], "score": float(score), **breakdown}


def run_engine(
    engine: RolloutEngine,
    env_creator: Callable[[], Any],
    items: list[dict[str, Any]],
    settings: EvalSettings,
    *,
    model: str,
    out_file: Path,
    skip: set[str],
    items_per_call: int = 1,
    recorded: dict[str, set[int]] | None = None,
    score: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    on_item: Callable[[list[dict[str, Any]]], None] | None = None,
    trees: Any = None,
) -> int:
    """Run ``settings.samples`` conversations of every item not in ``skip`` and append their records; returns the
    number of items run.

    The conversations go through :func:`arpo_algo.rollout.agent_loop.run_agents` (the loop training's sampler, eval
    and serve share) over the environment's own :class:`~arpo_env.session.ToolSession` (one reset env per item, cloned
    per run), with the training token layout and per-run seeds; the reward is the environment's.

    Args:
        engine: A RolloutEngine over the model.
        env_creator: Zero-argument factory of the evaluation environment whose tasks are ``items``.
        items: The items (their index in this list seeds their runs).
        settings: Protocol settings (samples = K, temperature, top_p, response budget, tool workers, overflow, seed).
        model: The model's label in the records.
        out_file: ``samples.jsonl`` (appended per item).
        skip: Item ids already done.
        items_per_call: Items whose runs are batched together; a crash loses at most these.
        recorded: Run indices already in ``out_file`` per item id (a resume after a crash mid-item): not run again.
        score: Optional post-scoring of a record (the LLM judge); returns the updated record.
        on_item: Called with each item's records (progress).
        trees: A :class:`~arpo_algo.eval.trees.TreeWriter` that records each item's runs as "iteration" index + 1
            (:func:`~arpo_algo.eval.trees.eval_group`), or None.
    """
    import functools

    from arpo_algo.core.tree import tools_seed
    from arpo_algo.rollout import layout
    from arpo_algo.rollout.agent_loop import run_agents
    from arpo_algo.rollout.engines.base import SamplingParams

    todo = [i for i, it in enumerate(items) if it["id"] not in skip]
    tok = engine.tokenizer
    context = getattr(engine, "max_context", None)
    limit = context - settings.max_response_tokens if context else None
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    for chunk in _chunks(todo, max(1, items_per_call)):
        t0 = time.perf_counter()
        envs, prompts, seeds, where = [], [], [], []
        for idx in chunk:
            env = env_creator()
            _, info = env.reset(options={"task_index": idx})
            ids = _fit_prompt(layout.prompt_ids(tok, info["messages"]), limit, settings, items[idx])
            for n, run in enumerate(missing_runs(recorded, items[idx]["id"], settings.samples)):
                run_env = env if n == 0 else env.clone()
                run_env.session.seed_tools(tools_seed(settings.seed, 0, idx, run))  # training's draws for this run
                envs.append(run_env)
                prompts.append(ids)
                seeds.append(functools.partial(_seed, settings.seed, idx, run))
                where.append((idx, run))
        traces = run_agents(
            engine,
            [e.session for e in envs],
            prompts,
            sampling,
            max_response_tokens=settings.max_response_tokens,
            seeds=seeds,
            tool_workers=settings.tool_workers,
        )
        wall = (time.perf_counter() - t0) / len(chunk)
        by_item: dict[int, list[dict[str, Any]]] = {}
        runs_of: dict[int, list[tuple[int, Any, tuple[float, dict[str, Any]]]]] = {}
        for (idx, run), env, tr in zip(where, envs, traces):
            reward, info = env_reward(env, items[idx])
            runs_of.setdefault(idx, []).append((run, tr, (reward, info)))
            if tr.error:
                info["engine_error"] = tr.error
            rec = make_record(
                model,
                items[idx],
                idx,
                run,
                text=tr.text,
                reward=reward,
                reward_info=info,
                correct=is_correct(types.SimpleNamespace(reward_info=info)),
                finish_reason=tr.finish_reason,
                tool_calls=tr.tool_calls,
                generated_tokens=sum(tr.trained_mask),
                response_tokens=len(tr.response_ids),
                wall_s=wall,
                prompt_tokens=len(tr.prompt_ids),
            )
            by_item.setdefault(idx, []).append(score(rec) if score else rec)
        for env in envs:  # scored: their persistent interpreters (if any) end here
            env.close()
        for idx in chunk:
            records = by_item.get(idx, [])
            with out_file.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, default=str) + "\n" for r in records))
            if trees is not None and idx in runs_of:  # after its samples: a crash never leaves a tree without them
                from arpo_algo.eval.trees import eval_group

                run, trs, rw = zip(*runs_of[idx])
                trees.record(idx + 1, [eval_group(idx, items[idx], list(run), list(trs), list(rw))])
            if on_item:
                on_item(records)
    return len(todo)
