"""What ``arpo eval`` scores: items loaded from ToolMath, the ARPO reference sets, or any JSONL/parquet file.

``--data`` accepts:

* ``toolmath`` or ``arpo/ToolMath-v0``: the generated ToolMath split (``--split``, default ``test``);
* ``valid``, ``train_10k``, ``gaia_test``, ``hle_test``, ``hard_search_1k`` (one reference file) or
  ``arpo/Reasoning-v0`` / ``arpo/DeepSearch-v0`` (the env's split); read through ``arpo_env``'s task code from the
  shared data folder (``arpo data pull``), never copied;
* a path to a ``.jsonl``/``.json``/``.parquet`` file: a question column (``question``, ``prompt``, ``problem``,
  ``input``, or a verl-style ``prompt`` list of chat messages) and an answer column (``answer``, ``ground_truth``,
  ``solution``, ``target``, or verl's ``reward_model.ground_truth``); optional ``id`` and ``data_source``. The loader
  reports which columns it used; other columns are listed as ignored.

Every item is run in the environment the data belongs to (the same ``arpo_env`` config as training: protocol, result
template, tools, limits, reward); a file's items run in ``--env`` (default ``arpo/Reasoning-v0``). Items without a
ground truth are skipped and counted; a file where every item lacks one is an error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError, MissingDataError

#: Reference files of a train split: ``--data`` may score them, labelled "train", never as a test split.
TRAIN_SETS = ("train_10k", "hard_search_1k")
#: Reference file stem -> the environment it runs in.
REFERENCE_SETS = {
    "valid": "arpo/Reasoning-v0",
    "train_10k": "arpo/Reasoning-v0",
    "gaia_test": "arpo/DeepSearch-v0",
    "hle_test": "arpo/DeepSearch-v0",
    "hard_search_1k": "arpo/DeepSearch-v0",
}
ENV_ALIASES = {"toolmath": "arpo/ToolMath-v0", "reasoning": "arpo/Reasoning-v0", "deepsearch": "arpo/DeepSearch-v0"}
QUESTION_COLUMNS = ("question", "prompt", "problem", "input")
ANSWER_COLUMNS = ("answer", "ground_truth", "solution", "target", "reward_model")
DEFAULT_FILE_ENV = "arpo/Reasoning-v0"


@dataclasses.dataclass
class EvalData:
    """Items plus the environment they run in.

    Attributes:
        items: Task dicts (``id``, ``question``, ``ground_truth``, ``source``, optional ``system``, ``reward_kwargs``).
        env_id: Registered environment id.
        env_config: Environment config (as training would pass it).
        description: One line saying what was loaded (and which columns, for files).
        skipped: Items dropped for lack of a ground truth.
        columns: For files: role -> column used, plus ``ignored``.
    """

    items: list[dict[str, Any]]
    env_id: str
    env_config: dict[str, Any]
    description: str
    skipped: int = 0
    columns: dict[str, Any] = dataclasses.field(default_factory=dict)


class TaskList:
    """A fixed task sequence an environment can use instead of its own (``env.tasks``)."""

    def __init__(self, items: list[dict[str, Any]], system_prompt: str | None) -> None:
        self.items, self.system_prompt = items, system_prompt

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.items[index])


def make_eval_env(env_id: str, env_config: dict[str, Any], items: list[dict[str, Any]]) -> Any:
    """The training environment (same id and config) with its task list replaced by ``items`` (picklable via
    partial)."""
    import gymnasium as gym

    import arpo_env  # noqa: F401  (registers the ids)

    try:
        env = gym.make(env_id, config=dict(env_config), disable_env_checker=True).unwrapped
    except gym.error.Error as e:
        raise ConfigError(
            f"environment {env_id!r} cannot be made: {e}", hint=f"registered: {', '.join(arpo_env.ENV_IDS)}"
        ) from e
    env.tasks = TaskList(items, getattr(env.tasks, "system_prompt", None))
    return env


def _source(task: dict[str, Any], default: str) -> str:
    src = task.get("data_source") or default
    if task.get("ability"):
        src = f"{src}/{task['ability']}"
    elif task.get("level") is not None:
        src = f"{src}/level{task['level']}"
    return str(src)


def _has_truth(gt: Any) -> bool:
    if gt is None:
        return False
    if isinstance(gt, (list, tuple)):
        return any(_has_truth(g) for g in gt)
    return str(gt).strip() != ""


def _finish(
    tasks: list[dict[str, Any]],
    env_id: str,
    env_config: dict[str, Any],
    description: str,
    limit: int | None,
    columns: dict[str, Any] | None = None,
) -> EvalData:
    kept = [t for t in tasks if _has_truth(t.get("ground_truth"))]
    skipped = len(tasks) - len(kept)
    if not kept:
        raise ConfigError(
            f"{description}: none of the {len(tasks)} items has a ground truth",
            hint="give every item an answer (column 'answer' or 'ground_truth')",
        )
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {limit}")
        kept = kept[:limit]
    return EvalData(
        items=kept,
        env_id=env_id,
        env_config=env_config,
        description=description,
        skipped=skipped,
        columns=columns or {},
    )


def _env_tasks(env_id: str, env_config: dict[str, Any]) -> list[dict[str, Any]]:
    import gymnasium as gym

    import arpo_env  # noqa: F401  (registers the ids)

    try:
        raw = gym.make(env_id, config=dict(env_config), disable_env_checker=True).unwrapped
    except gym.error.Error as e:
        raise ConfigError(f"environment {env_id!r} cannot be made: {e}") from e
    default = env_id.split("/")[-1].split("-")[0].lower()
    out = []
    for i in range(raw.num_tasks):
        t = dict(raw.tasks[i])
        t["source"] = _source(t, default)
        out.append(t)
    return out


def data_env_id(data: str, env: str | None = None) -> str:
    """The environment id ``--data`` (with ``--env``, an id or an alias) is loaded and run in."""
    if data in ENV_ALIASES or data.startswith("arpo/"):
        return ENV_ALIASES.get(data, data)
    if data in REFERENCE_SETS:
        return ENV_ALIASES.get(env, env) if env else REFERENCE_SETS[data]
    return ENV_ALIASES.get(env or "", env or DEFAULT_FILE_ENV)


def load_eval_data(
    data: str,
    *,
    split: str = "test",
    limit: int | None = None,
    env: str | None = None,
    env_config: dict[str, Any] | None = None,
) -> EvalData:
    """Load ``--data`` (see the module docstring); ``limit`` keeps the first N items that have a ground truth."""
    overrides = dict(env_config or {})
    env_id = data_env_id(data, env)
    if data in ENV_ALIASES or data.startswith("arpo/"):
        cfg = {"split": split, **overrides}
        return _finish(_env_tasks(env_id, cfg), env_id, cfg, f"{env_id} split {cfg['split']!r}", limit)
    if data in REFERENCE_SETS:
        split = "train" if data in TRAIN_SETS else "test"  # a training file is scored as what it is
        if "data_files" in overrides:
            raise ConfigError(
                f"--data {data!r} is the reference file {data}.parquet, and data_files in the env "
                f"settings ({overrides['data_files']!r}) would replace it",
                hint="drop data_files, or pass the file itself as --data",
            )
        cfg = {**overrides, "data_files": {split: [f"{data}.parquet"]}, "split": split}
        return _finish(_env_tasks(env_id, cfg), env_id, cfg, f"reference set {data} ({env_id})", limit)
    path = Path(data).expanduser()
    if not path.exists():
        raise MissingDataError(
            f"--data {data!r}: no such file, and not a known set",
            hint="use toolmath, valid, gaia_test, hle_test, train_10k, hard_search_1k, an env id "
            "(arpo/ToolMath-v0), or a .jsonl/.parquet file",
        )
    rows = read_rows(path)
    tasks, columns = rows_to_tasks(rows, path)
    cols = ", ".join(f"{k}={v}" for k, v in columns.items() if k != "ignored")
    desc = f"{path.name} ({len(rows)} rows; columns {cols}" + (
        f"; ignored {', '.join(columns['ignored'])})" if columns.get("ignored") else ")"
    )
    return _finish(tasks, env_id, {"split": "test", **overrides}, desc, limit, columns)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL, JSON (a list of objects) or parquet file; malformed files raise ConfigError naming the line."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001  (pyarrow raises several types for a bad file)
            raise ConfigError(f"{path}: not a readable parquet file ({e})") from None
    if suffix not in (".jsonl", ".json"):
        raise ConfigError(f"{path}: unsupported file type {suffix!r}", hint="use .jsonl, .json or .parquet")
    text = path.read_text(encoding="utf-8", errors="replace")
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: malformed JSON ({e})") from None
        if not isinstance(rows, list):
            raise ConfigError(f"{path}: a .json file must hold a list of objects")
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
    if not rows:
        raise ConfigError(f"{path}: no rows")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ConfigError(f"{path}: row {bad + 1} is not a JSON object")
    return rows


def _pick(columns: set[str], candidates: tuple[str, ...], what: str, path: Path) -> str:
    for c in candidates:
        if c in columns:
            return c
    raise ConfigError(
        f"{path}: no {what} column (looked for {', '.join(candidates)}; found {', '.join(sorted(columns))})",
        hint=f"rename the {what} column to {candidates[0]!r}",
    )


def _question(value: Any) -> tuple[str, str | None]:
    """(user text, system prompt or None) of a question cell: a string or a list of chat messages (verl)."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        user = next((m.get("content") for m in value if m.get("role") == "user"), None)
        system = next((m.get("content") for m in value if m.get("role") == "system"), None)
        if isinstance(user, str):
            return user, system
    raise ValueError("not a string or a list of chat messages with a user message")


def _answer(value: Any) -> Any:
    if isinstance(value, dict):  # verl: reward_model = {ground_truth, style}
        value = value.get("ground_truth")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return value


def rows_to_tasks(rows: list[dict[str, Any]], path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Task dicts from file rows and the columns used (role -> name, ``ignored`` -> the rest)."""
    columns = set().union(*(r.keys() for r in rows))
    q_col = _pick(columns, QUESTION_COLUMNS, "question", path)
    a_col = _pick(columns, ANSWER_COLUMNS, "answer", path)
    used = {q_col, a_col}
    tasks = []
    for i, row in enumerate(rows):
        try:
            question, system = _question(row.get(q_col))
        except ValueError as e:
            raise ConfigError(f"{path}: row {i + 1}, column {q_col!r}: {e}") from None
        task = {
            "id": str(row.get("id", f"{path.stem}-{i}")),
            "question": question,
            "ground_truth": _answer(row.get(a_col)),
            "reward_kwargs": {},
            "source": str(row.get("data_source") or path.stem),
        }
        if system:
            task["system"] = system
        tasks.append(task)
    report = {"question": q_col, "answer": a_col}
    for extra in ("id", "data_source"):
        if extra in columns:
            report[extra] = extra
            used.add(extra)
    report["ignored"] = sorted(columns - used)
    return tasks, report
