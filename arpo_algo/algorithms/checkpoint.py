"""Checkpoints that hold data, never code: reading one executes nothing from it.

A checkpoint folder (``arpo train`` writes them as ``<run>/checkpoints/iter_N/``; Tune and ``Algorithm.save_to_path``
write the same layout)::

    arpo_checkpoint.json   format, arpo version, algorithm, iteration, data position, metrics, the settings (JSON)
    policy/                a plain Hugging Face folder (safetensors weights, config, tokenizer, chat template)
    policy/README.md       the model card (the Hub's metadata block; :mod:`arpo_algo.models.card`)
    policy/arpo_policy.json  the environment it was trained in and what it resolves the served agent's system
                           prompt, tool-call limit and protocol to (:mod:`arpo_algo.models.policy_env`), so the
                           folder is served as trained even when copied out of the checkpoint
    policy/trainer_state.pt  optimizer, scheduler, step counters and RNG states: tensors and plain values only,
                           read with ``torch.load(weights_only=True)``

A folder without ``arpo_checkpoint.json`` is refused, whatever else it holds: nothing in it is unpickled. Writers
fsync every file and folder before the rename that publishes a checkpoint, so a crash leaves either the previous
checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from arpo_algo import __version__
from arpo_algo.models.card import base_model_record, write_model_card
from arpo_algo.models.checkpoints import CHECKPOINT_MARKER
from arpo_algo.models.policy_env import write_policy_env
from arpo_base.errors import ArpoError, ConfigError
from arpo_base.paths import fsync_dir

#: Bumped whenever the checkpoint layout or state keys change incompatibly.
CHECKPOINT_FORMAT = 2
POLICY_DIR = "policy"
TRAINER_STATE_FILE = "trainer_state.pt"


# ------------------------------------------------------------------------------------------------ tensor-safe state


def to_tensor_safe(obj: Any) -> Any:
    """``obj`` with numpy arrays and scalars replaced by values ``torch.load(weights_only=True)`` accepts."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_tensor_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_tensor_safe(v) for v in obj)
    return obj


def from_tensor_safe(obj: Any) -> Any:
    """The inverse of :func:`to_tensor_safe`."""
    import numpy as np

    if isinstance(obj, dict):
        if set(obj) == {"__ndarray__", "dtype"}:
            return np.array(obj["__ndarray__"], dtype=obj["dtype"])
        return {k: from_tensor_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_tensor_safe(v) for v in obj)
    return obj


def save_trainer_state(state: dict[str, Any], path: Path) -> None:
    import torch

    torch.save(to_tensor_safe(state), path)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state, read without unpickling arbitrary objects."""
    import pickle

    import torch

    try:
        return from_tensor_safe(torch.load(path, weights_only=True))
    except pickle.UnpicklingError as e:
        raise ArpoError(
            f"{path} holds objects other than tensors and plain values; it was not loaded",
            hint="a checkpoint arpo wrote never does: the file was replaced or written by other code",
        ) from e


# -------------------------------------------------------------------------------------------------------- writing


def _json_value(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy and torch scalars and arrays
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)) or type(value).__name__ == "deque":
        return list(value)
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (and ``root``), so a rename after it publishes durable data."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def _write_state(path: Path, config: Any, **state: Any) -> None:
    """The checkpoint's JSON (format, version, ``state`` and the settings it was trained with), then fsync the
    whole folder: the one writer of the marker, for new checkpoints and converted ones alike."""
    state = {
        "arpo_checkpoint_format": CHECKPOINT_FORMAT,
        "arpo_version": __version__,
        **state,
        "config": {
            "env": config.env,
            "env_config": dict(config.env_config),
            "seed": config.seed,
            "settings": config.settings.sections(),
        },
    }
    text = json.dumps(state, indent=1, default=_json_value, allow_nan=True)
    (path / CHECKPOINT_MARKER).write_text(text, encoding="utf-8")
    fsync_tree(path)


def write_checkpoint(algo: Any, path: Path) -> Path:
    """Write ``algo``'s checkpoint into ``path`` (created; must not hold another checkpoint) and fsync it."""
    if not isinstance(algo.config.env, str):  # a checkpoint is data: it names its environment, it holds no code
        raise ConfigError(
            f"a checkpoint records its environment by name; this run's env is {algo.config.env!r}",
            hint="register it, tune.register_env('my_env', creator), and pass the name to .environment('my_env')",
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    algo.policy.save_to_path(path / POLICY_DIR)
    base = policy_base(algo)
    write_policy_env(path / POLICY_DIR, algo.config.env, algo.config.env_config, algo.served_defaults, base)
    write_policy_card(algo, path / POLICY_DIR, base)
    _write_state(
        path,
        algo.config,
        algorithm=type(algo).__name__,
        iteration=algo.iteration,
        prompts=algo.data_position(),
        records=algo.records.get_state() if getattr(algo, "records", None) is not None else None,
        metrics_logger=algo.metrics.get_state(),
    )
    return path


def policy_base(algo: Any) -> dict[str, Any]:
    """The model ``algo`` started from (registered name, Hub id, folder, weights fingerprint), worked out once per
    Algorithm: hashing the base's weights at every checkpoint would cost a pass over them each time."""
    base = getattr(algo, "_policy_base", None)
    if base is None:
        base = base_model_record(algo.config.settings.model.path)
        algo._policy_base = base
    return base


def write_policy_card(algo: Any, folder: Path, base: dict[str, Any]) -> Path:
    """The policy folder's model card (:mod:`arpo_algo.models.card`): algorithm, environment, base, the newest
    held-out score of this run if one was measured, and the command that made it."""
    from arpo_env import ENV_IDS

    env = algo.config.env if isinstance(algo.config.env, str) else getattr(algo.config.env, "__name__", None)
    task = dict(algo.config.env_config).get("task") or ENV_IDS.get(env or "", {}).get("task")
    last = getattr(algo, "_last_eval", None) or {}
    held_out = None
    if "accuracy" in last:
        held_out = {
            "accuracy": float(last["accuracy"]),
            "split": algo.config.settings.evaluation.split,
            "num_tasks": int(last["num_tasks"]) if "num_tasks" in last else None,
            "iteration": algo.iteration,
        }
    adapter = bool(algo.config.settings.model.lora.enabled)
    return write_model_card(
        folder, base=base, algorithm=type(algo).__name__, env=env, task=task, held_out=held_out, adapter=adapter
    )


# -------------------------------------------------------------------------------------------------------- reading


def read_checkpoint_state(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON state of a checkpoint of this format; anything else is refused with what to do."""
    path = Path(getattr(path, "path", path))
    marker = path / CHECKPOINT_MARKER
    if not marker.is_file():
        raise ArpoError(
            f"{path} is not an arpo checkpoint (no {CHECKPOINT_MARKER})",
            hint="pass a folder like <run>/checkpoints/iter_000010",
        )
    try:
        state = json.loads(marker.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArpoError(f"{marker} is not valid JSON: {e}", hint="the checkpoint is damaged; use an earlier one") from e
    fmt = state.get("arpo_checkpoint_format")
    if fmt != CHECKPOINT_FORMAT:
        raise ArpoError(
            f"incompatible checkpoint: {path} has format {fmt!r} (arpo {state.get('arpo_version')}), "
            f"this arpo ({__version__}) reads format {CHECKPOINT_FORMAT}",
            hint="resume with the arpo version that wrote it, or start a new run from its policy/ folder",
        )
    return state


def restore_checkpoint(algo: Any, path: str | os.PathLike) -> None:
    """Load a checkpoint into a built Algorithm of the same class: weights in place, trainer state, iteration, data
    position and metrics."""
    path = Path(getattr(path, "path", path))
    state = read_checkpoint_state(path)
    if state["algorithm"] != type(algo).__name__:
        raise ArpoError(
            f"{path} was written by {state['algorithm']}, not {type(algo).__name__}",
            hint=f"resume it with [experiment] algorithm = {state['algorithm'].lower()!r}",
        )
    algo.policy.restore_from_path(path / POLICY_DIR)  # the engine is synced before its next use, as after updates
    algo.metrics.set_state(state["metrics_logger"])
    algo._iteration = int(state["iteration"])
    algo.prompts.set_state(state["prompts"])
    if getattr(algo, "records", None) is not None:  # the recorded episodes trained on up to these weights
        if state.get("records") is None:
            raise ArpoError(f"{path} holds no position in recorded episodes", hint="resume without training.records")
        algo.records.set_state(state["records"])


#: Python tool settings that name code to run or weaken its sandbox: a folder's files never set them (its reader's
#: own settings do), so reading a folder someone else wrote can never pick the interpreter, image or sandbox.
CODE_SETTINGS = {
    "python_executable": "the interpreter the model's code runs in",
    "docker_image": "the Docker image the model's code runs in",
    "backend": "the sandbox backend",
    "scratch_root": "where the sandbox's scratch folders go",
    "allow_unisolated_python": "the unisolated opt-in",
    "namespaces": "the sandbox's namespaces",
    "uid_base": "the uids the model's code runs as (every process of such a uid is killed after a call)",
}
#: Settings of the other tools that send secrets or write files where a record says: refused from a folder likewise
#: (None: the whole section).
WRITE_SETTINGS = {
    ("search", "url"): "the search endpoint the key is sent to",
    ("search", "api_key_env"): "the variable whose secret is sent as the search key",
    ("search", "index_dir"): "a folder the search index is written to",
    ("cache", None): "a file the tool cache writes",
}


def refuse_code_references(env_id: Any, env_config: Any, where: str, *, flags: dict[str, str]) -> None:
    """Refuse (:class:`ArpoError`) an environment record read from a folder that names code: an environment id with a
    module part (``module:Name`` makes gymnasium import that module) or a Python tool setting of
    :data:`CODE_SETTINGS`. ``flags`` says how the reader sets such a value itself: ``flags["env"]`` for the id,
    ``flags["tool"]`` (formatted with ``key``) for a tool setting, ``flags["allow_unisolated_python"]`` for the
    opt-in. Runs before anything of the record is built.

    Invariant: a folder's files are data; what runs, and in which sandbox, is chosen by whoever reads it."""
    if not isinstance(env_id, str) or ":" in env_id:
        raise ArpoError(
            f"{where}: the recorded environment id {env_id!r} names a module to import; a folder's files "
            "may not choose code to run",
            hint=f"registered ids only; {flags['env']}",
        )
    tools = env_config.get("tools") if isinstance(env_config, dict) else None
    tools = tools if isinstance(tools, dict) else {}
    refused = [(("python", key), what) for key, what in CODE_SETTINGS.items()] + list(WRITE_SETTINGS.items())
    for (tool, key), what in refused:
        table = tools.get(tool)
        if isinstance(table, dict) and (key is None or key in table):
            name = tool if key is None else f"{tool}.{key}"
            flag = flags.get(key) or flags["tool"].format(key=name)
            raise ArpoError(
                f"{where}: the recorded setting tools.{name} ({what}) is refused: a folder's files may "
                "not choose the code that runs, its sandbox, where secrets go or where files are written",
                hint=f"set it yourself if you mean it: {flag}",
            )


#: How ``from_checkpoint``'s caller sets what a checkpoint may not (:func:`refuse_code_references`).
RESTORE_FLAGS = {
    "env": "build the Algorithm from your own config (the experiment file's [env] id, or --set env.id=ID) "
    "and restore the checkpoint into it (arpo train EXPERIMENT --resume RUN)",
    "tool": "--set env.tools.{key}=VALUE (or the same key under [env.tools] in the experiment file), "
    "then arpo train EXPERIMENT --resume RUN",
    "allow_unisolated_python": "arpo train EXPERIMENT --resume RUN --allow-unisolated-python",
}


def config_from_state(state: dict[str, Any], config_cls: type, where: str = "checkpoint") -> Any:
    """The Algorithm config a checkpoint was trained with (from its JSON, nothing executed); a record that names code
    (:func:`refuse_code_references`) is refused."""
    c = state["config"]
    refuse_code_references(c["env"], c["env_config"], where, flags=RESTORE_FLAGS)
    config = config_cls().environment(env=c["env"], env_config=c["env_config"]).debugging(seed=c["seed"])
    return config.update_settings(c["settings"], "checkpoint config")
