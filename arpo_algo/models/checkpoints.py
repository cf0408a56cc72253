"""The training checkpoint folder layout, as far as readers of checkpoints need it.

A run folder keeps its checkpoints under ``checkpoints/iter_N/`` (``N`` zero-padded); a checkpoint is complete once
its ``arpo_checkpoint.json`` exists (it is written into a temporary folder that is renamed as a whole), and its
``policy/`` folder is a plain Hugging Face model folder. The training driver writes this layout; the server and the
commands that resume a run read it, so it lives here, below both. :func:`policy_source` is how every command that
takes a model tells a run folder, a checkpoint and a model folder apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from arpo_base.errors import ConfigError

CHECKPOINT_PREFIX = "iter_"
#: The file whose presence marks a finished checkpoint.
CHECKPOINT_MARKER = "arpo_checkpoint.json"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Completed checkpoints under ``ckpt_root``, oldest first (half-written ``.tmp`` folders are ignored)."""
    if not ckpt_root.is_dir():
        return []
    found = [
        p
        for p in ckpt_root.iterdir()
        if _checkpoint_number(p.name) is not None and p.is_dir() and (p / CHECKPOINT_MARKER).is_file()
    ]
    return sorted(found, key=lambda p: _checkpoint_number(p.name))


def _checkpoint_number(name: str) -> int | None:
    """The iteration of a checkpoint folder's name (``iter_`` and ASCII digits only), or None for any other name: a
    folder someone else named ``iter_x`` (or ``iter_٣``) is not a checkpoint, never a crash."""
    digits = name[len(CHECKPOINT_PREFIX) :]
    if not name.startswith(CHECKPOINT_PREFIX) or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits)


#: The keys of the ``config.json`` that ``arpo train`` writes into a run folder (the resolved experiment).
RUN_RECORD_KEYS = frozenset({"experiment", "settings", "arpo_version"})
#: What a folder given as a model source must be, said in every refusal.
EXPECTED = (
    "a model folder (config.json with a model_type, as save_pretrained writes it), a training checkpoint "
    "(arpo_checkpoint.json and policy/) or a run folder (the config.json and checkpoints/ arpo train writes)"
)


@dataclass(frozen=True)
class PolicySource:
    """A folder given as a model source, resolved to the Hugging Face folder that holds the policy.

    Attributes:
        kind: ``"model"``, ``"adapter"`` (a LoRA adapter folder), ``"checkpoint"`` or ``"run"``: what the given
            folder was recognised as.
        folder: The policy folder: the model folder itself, a checkpoint's ``policy/``, a run's newest checkpoint's.
        name: The name it goes by: the run's folder name for a run or one of its checkpoints, else the folder's.
    """

    kind: str
    folder: Path
    name: str


def _json_keys(path: Path) -> set[str]:
    """The top-level keys of a JSON object file; empty when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    return set(data) if isinstance(data, dict) else set()


def policy_source(path: Path) -> PolicySource:
    """Recognise ``path`` (an existing folder) by what it holds and return its policy folder.

    A run folder is recognised by the ``config.json`` that ``arpo train`` writes (its keys, :data:`RUN_RECORD_KEYS`),
    a checkpoint by ``arpo_checkpoint.json``, a model folder by a ``config.json`` that names a ``model_type``. Raises
    :class:`~arpo_base.errors.ConfigError` for a folder that is none of them or more than one, and for a run or
    checkpoint with no finished policy in it."""
    config_keys = _json_keys(path / "config.json")
    kinds = [
        kind
        for kind, found in (
            ("run", RUN_RECORD_KEYS <= config_keys),
            ("checkpoint", (path / CHECKPOINT_MARKER).is_file()),
            ("model", "model_type" in config_keys),
            ("adapter", _is_adapter(path)),
        )
        if found
    ]
    if len(kinds) != 1:
        what = f"looks like both a {' and a '.join(kinds)}" if kinds else "is not a model source"
        raise ConfigError(f"{path} {what}", hint=f"pass {EXPECTED}")
    if kinds == ["model"]:
        return PolicySource("model", path, path.name)
    if kinds == ["adapter"]:
        _check_adapter(path)
        return PolicySource("adapter", path, path.name)
    if kinds == ["run"]:
        found = list_checkpoints(path / "checkpoints")
        if not found:
            raise ConfigError(
                f"{path} is a run folder with no finished checkpoint under checkpoints/",
                hint="let the run write one (experiment.checkpoint_every), or pass a model folder",
            )
        return PolicySource("run", _checkpoint_policy(found[-1]), path.name)
    run = path.parent.parent if path.parent.name == "checkpoints" else path
    return PolicySource("checkpoint", _checkpoint_policy(path), run.name)


def _is_adapter(path: Path) -> bool:
    """A LoRA adapter folder (:mod:`arpo_algo.models.lora`; its readers check it against its base)."""
    return any(
        (path / name).is_file() for name in ("arpo_adapter.json", "adapter_config.json", "adapter_model.safetensors")
    )


def _check_adapter(path: Path) -> None:
    """Refuse an adapter folder whose config or base is missing or whose base's weights changed, before anything
    loads."""
    from arpo_algo.models.lora import check_adapter_folder

    check_adapter_folder(path)


def _checkpoint_policy(checkpoint: Path) -> Path:
    policy = checkpoint / "policy"
    if _is_adapter(policy):
        _check_adapter(policy)
        return policy
    if "model_type" not in _json_keys(policy / "config.json"):
        raise ConfigError(
            f"{checkpoint} is a checkpoint without a model in policy/",
            hint="the checkpoint is damaged; use an earlier one",
        )
    return policy
