"""A policy folder's record of the environment it was trained in (``arpo_policy.json``), so the folder alone is
served as it was trained.

Every policy folder arpo writes (a checkpoint's ``policy/``, and so ``arpo train``'s final policy and any copy of it,
the quickstart's exported ``policy/`` included) holds, beside the Hugging Face files::

    {"arpo_policy_format": 1, "arpo_version": "...",
     "env": "arpo/ToolMath-v0", "env_config": {...},            # the checkpoint's own environment record
     "served_defaults": {"system_prompt": "...", "max_tool_calls": 3, "protocol": "arpo"},
     "base_model": {"name": "smollm2-135m-instruct", "hub_id": "...", "path": "...", "fingerprint": "<sha256>"}}

``env`` and ``env_config`` are the checkpoint's ``config.env`` / ``config.env_config``, unchanged. ``served_defaults``
are what that environment resolves them to (what ``arpo serve`` applies when its flags do not set them): resolved at
training time because the system prompt may come from the training dataset, which a serving machine need not have.
Plain JSON: reading it executes nothing. A folder without it (a base model, an ``arpo sft`` output) records no
environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from arpo_algo import __version__
from arpo_base.errors import ConfigError

POLICY_ENV_FILE = "arpo_policy.json"
#: Bumped whenever the keys of :data:`POLICY_ENV_FILE` change incompatibly; a reader refuses any other format.
POLICY_ENV_FORMAT = 1
#: The session settings a training environment decides for a served agent, unless the command line does.
SERVED_KEYS = ("system_prompt", "max_tool_calls", "protocol")

_HINT = (
    "the file was edited or written by another tool: copy it again from the checkpoint's policy/ folder, or "
    f"delete {POLICY_ENV_FILE} and pass --system-prompt, --max-tool-calls and --protocol"
)


def served_defaults(env: Any) -> dict[str, Any]:
    """The system prompt, tool-call limit and protocol an agent trained in ``env`` (an unwrapped ``ToolTextEnv``)
    saw: the prompt of a task that brings none of its own, and the environment's resolved limit and protocol."""
    return {
        "system_prompt": env.default_system_prompt(),
        "max_tool_calls": int(env.config["max_tool_calls"]),
        "protocol": env.config["protocol"],
    }


def write_policy_env(
    policy_dir: str | Path,
    env_id: str,
    env_config: dict[str, Any],
    defaults: dict[str, Any],
    base_model: dict[str, Any] | None = None,
) -> Path:
    """Write ``policy_dir/arpo_policy.json`` (the folder exists); returns its path. ``base_model``: the model the run
    started from (:func:`arpo_algo.models.card.base_model_record`: registered name, Hub id, folder, fingerprint)."""
    record = {
        "arpo_policy_format": POLICY_ENV_FORMAT,
        "arpo_version": __version__,
        "env": env_id,
        "env_config": dict(env_config),
        "served_defaults": {k: defaults[k] for k in SERVED_KEYS},
    }
    if base_model is not None:
        record["base_model"] = dict(base_model)
    path = Path(policy_dir) / POLICY_ENV_FILE
    path.write_text(json.dumps(record, indent=1, default=_plain), encoding="utf-8")
    return path


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays in an env_config
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")


def read_policy_env(policy_dir: str | Path) -> dict[str, Any] | None:
    """The record of ``policy_dir``, or None when it has none (a plain Hugging Face folder).

    Invariant: a record is either applied whole or refused; one that this arpo cannot read (another format, damaged,
    hand-edited to values a session refuses) is a :class:`ConfigError` naming the file, never skipped, because
    serving on without it would silently give the agent settings it was not trained with.
    """
    path = Path(policy_dir) / POLICY_ENV_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}", hint=_HINT) from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(record).__name__}", hint=_HINT)
    fmt = record.get("arpo_policy_format")
    if fmt != POLICY_ENV_FORMAT:
        raise ConfigError(
            f"{path} has format {fmt!r} (written by arpo {record.get('arpo_version', '?')}); this arpo "
            f"({__version__}) reads format {POLICY_ENV_FORMAT}",
            hint="serve it with the arpo version that wrote it, or delete the file and pass "
            "--system-prompt, --max-tool-calls and --protocol",
        )
    defaults = record.get("served_defaults")
    if not isinstance(record.get("env"), str) or not isinstance(defaults, dict):
        raise ConfigError(f"{path} lacks 'env' (a string) or 'served_defaults' (an object)", hint=_HINT)
    _check_defaults(path, defaults)
    return record


def _check_defaults(path: Path, defaults: dict[str, Any]) -> None:
    from arpo_env.session import SESSION_CHOICES

    missing = [k for k in SERVED_KEYS if k not in defaults]
    if missing:
        raise ConfigError(f"{path}: served_defaults lacks {', '.join(missing)}", hint=_HINT)
    prompt, limit, protocol = (defaults[k] for k in SERVED_KEYS)
    if not isinstance(prompt, str):
        raise ConfigError(f"{path}: served_defaults.system_prompt must be a string, got {prompt!r}", hint=_HINT)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"{path}: served_defaults.max_tool_calls must be an integer >= 0, got {limit!r}", hint=_HINT)
    if protocol not in SESSION_CHOICES["protocol"]:
        raise ConfigError(
            f"{path}: served_defaults.protocol must be one of {', '.join(SESSION_CHOICES['protocol'])}"
            f", got {protocol!r}",
            hint=_HINT,
        )
