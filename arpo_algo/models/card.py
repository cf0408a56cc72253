"""Model cards: the ``README.md`` the Hugging Face Hub reads, in every policy and export folder arpo writes.

A card opens with the Hub's YAML metadata block and then says, for a reader, what the folder is::

    ---
    base_model: HuggingFaceTB/SmolLM2-135M-Instruct   # only when the base has a Hub id (a registered model's)
    library_name: transformers                        # "peft" for a LoRA adapter folder
    pipeline_tag: text-generation
    tags: [arpo, reinforcement-learning, tool-use, arpo-algorithm, ...]
    arpo: {algorithm, env, task, base_model_name, base_model_path, base_fingerprint, held_out, command}
    ---

Invariant: ``base_model`` is a Hub id or absent, never a local path (the Hub rejects a card whose ``base_model`` is no
model there); the local folder and the sha256 fingerprint of its weights (:func:`base_model_record`) are in the
``arpo`` block, as in the policy record (``arpo_policy.json``). A base that is itself a folder arpo wrote (RL after
SFT) passes its own card's Hub id and registered name on, so a chain of runs keeps naming the model it started from.
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
from pathlib import Path
from typing import Any

CARD_FILE = "README.md"
CARD_TAGS = ("arpo", "reinforcement-learning", "tool-use", "text-generation")


def base_model_record(model: str | os.PathLike[str]) -> dict[str, Any]:
    """The base a run trains from: its registered name (or None), Hub id (or None), resolved folder and the sha256
    fingerprint of its weights (:func:`arpo_algo.models.lora.weights_fingerprint`)."""
    from arpo_algo.models.store import REGISTRY, model_dir, resolve_model_path

    text = str(model)
    path = resolve_model_path(text).resolve()
    name = text if text in REGISTRY else next((n for n in REGISTRY if model_dir(n).resolve() == path), None)
    hub_id = (REGISTRY[name].hub_id or None) if name else None
    if name is None:  # a folder arpo wrote from a registered model passes its name on
        inherited = read_card(path)
        if inherited:
            name = (inherited.get("arpo") or {}).get("base_model_name")
            hub_id = inherited.get("base_model")
    return {"name": name, "hub_id": hub_id, "path": str(path), "fingerprint": _fingerprint(path)}


def _fingerprint(path: Path) -> str:
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in path.iterdir() if f.is_file()))
    return _cached_fingerprint(str(path), stamp)


@functools.lru_cache(maxsize=16)
def _cached_fingerprint(path: str, _stamp: tuple) -> str:
    # keyed by the folder's file names, times and sizes: a checkpoint every few steps does not re-hash the base
    from arpo_algo.models.lora import weights_fingerprint

    return weights_fingerprint(path)


def invoking_command() -> str:
    """The command line of this process as a user would retype it: an installed program by its name (``arpo train
    x.toml``), a script or module through ``python``."""
    argv = list(sys.argv) or [""]
    first = argv[0]
    if first.endswith(".py") or first in ("", "-c", "-m"):
        head = ["python", first] if first.endswith(".py") else ["python"]
    else:
        head = [Path(first).name]
    return " ".join(shlex.quote(a) for a in [*head, *argv[1:]])


def write_model_card(
    folder: str | os.PathLike[str],
    *,
    base: dict[str, Any],
    algorithm: str | None,
    env: str | None,
    task: str | None = None,
    held_out: dict[str, Any] | None = None,
    command: str | None = None,
    adapter: bool = False,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``folder/README.md`` (see the module docstring); returns its path.

    Args:
        base: :func:`base_model_record` of the model the run started from.
        algorithm: the algorithm's name ("ARPO", "AEPO", "GRPO", "SFT").
        env: the Gymnasium id trained in; task: its task name.
        held_out: the held-out score if one was measured (``{"accuracy": ..., "split": ..., "num_tasks": ...}``).
        command: the command that made the folder (default: this process's command line).
        adapter: the folder is a LoRA adapter (PEFT) rather than full weights (transformers).
        extra: more ``arpo`` fields (an export's ``merged_from`` and ``exported_by``).
    """
    import yaml

    folder = Path(folder)
    command = command if command is not None else invoking_command()
    tags = [*CARD_TAGS, *([algorithm.lower()] if algorithm else []), *(["lora"] if adapter else [])]
    meta: dict[str, Any] = {}
    if base.get("hub_id"):
        meta["base_model"] = base["hub_id"]
    meta.update({"library_name": "peft" if adapter else "transformers", "pipeline_tag": "text-generation"})
    meta["tags"] = tags
    meta["arpo"] = {
        "algorithm": algorithm,
        "env": env,
        "task": task,
        "base_model_name": base.get("name"),
        "base_model_path": base.get("path"),
        "base_fingerprint": base.get("fingerprint"),
        "held_out": dict(held_out) if held_out else None,
        "command": command,
        **(extra or {}),
    }
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1000)
    (folder / CARD_FILE).write_text(f"---\n{header}---\n\n{_body(meta, adapter)}", encoding="utf-8")
    return folder / CARD_FILE


def _body(meta: dict[str, Any], adapter: bool) -> str:
    a = meta["arpo"]
    base = a["base_model_name"] or a["base_model_path"]
    if meta.get("base_model"):
        base = f"{base} ([{meta['base_model']}](https://huggingface.co/{meta['base_model']}))"
    held = a["held_out"]
    score = "not measured"
    if held and held.get("accuracy") is not None:
        where = ", ".join(f"{k} {held[k]}" for k in ("split", "num_tasks") if held.get(k) is not None)
        score = f"accuracy {float(held['accuracy']):.3f}" + (f" ({where})" if where else "")
    load = (
        "from peft import AutoPeftModelForCausalLM\n\nmodel = AutoPeftModelForCausalLM.from_pretrained(FOLDER)"
        if adapter
        else "from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained(FOLDER)"
    )
    rows = [
        ("algorithm", a["algorithm"] or "unknown"),
        ("environment", f"`{a['env']}`" + (f" (task `{a['task']}`)" if a["task"] else "") if a["env"] else "unknown"),
        ("base model", base),
        ("base weights sha256", f"`{a['base_fingerprint']}`"),
        ("held-out score", score),
        ("made by", f"`{a['command']}`"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    kind = "a LoRA adapter (PEFT) over its base model" if adapter else "a Hugging Face causal LM folder"
    return (
        f"# {a['algorithm'] or 'arpo'} policy\n\nA tool-using agent trained with arpo; this folder is {kind}.\n\n"
        f"| | |\n|---|---|\n{table}\n\n## Load\n\n```python\n{load}\n```\n\n"
        "`arpo serve FOLDER` serves it with the system prompt, tools and tool-call limit it was trained with "
        "(`arpo_policy.json`).\n"
    )


def read_card(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The YAML metadata of ``folder/README.md``, or None when the folder has no card with a metadata block."""
    import yaml

    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return None
    head, sep, _ = text[4:].partition("\n---\n")
    if not sep:
        return None
    try:
        meta = yaml.safe_load(head)
    except yaml.YAMLError:
        return None
    return meta if isinstance(meta, dict) else None


def rewrite_card(folder: str | os.PathLike[str], src: str | os.PathLike[str] | None = None, **changes: Any) -> Path:
    """Write ``folder``'s card from the card of ``src`` (default: ``folder`` itself) with some fields changed:
    ``arpo`` fields (``held_out``, ``command``, ``merged_from``, ...) or ``adapter``. A source without an arpo card
    (written before cards existed) gives a card from its adapter record and policy record, so an export always has
    one."""
    source = Path(src if src is not None else folder)
    meta = read_card(source) or {}
    a = dict(meta.get("arpo") or {})
    if not a:
        a = _fields_from_records(source)
    a.update({k: v for k, v in changes.items() if k != "adapter"})
    base = {
        "name": a.pop("base_model_name", None),
        "hub_id": meta.get("base_model"),
        "path": a.pop("base_model_path", None),
        "fingerprint": a.pop("base_fingerprint", None),
    }
    named = ("algorithm", "env", "task", "held_out", "command")
    return write_model_card(
        folder,
        base=base,
        **{k: a.pop(k, None) for k in named},
        adapter=changes.get("adapter", meta.get("library_name") == "peft"),
        extra=a,
    )


def _fields_from_records(folder: Path) -> dict[str, Any]:
    """The card's ``arpo`` fields a folder's own records give (its policy record, its adapter's base record)."""
    import json

    fields: dict[str, Any] = {}
    for name, read in (("arpo_policy.json", ("env", "base_model")), ("arpo_adapter.json", ("base", "fingerprint"))):
        path = folder / name
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        if "env" in read and isinstance(record.get("env"), str):
            fields["env"] = record["env"]
        base = record.get("base_model") if "base_model" in read else None
        if isinstance(base, dict):
            fields.update(base_model_name=base.get("name"), base_model_path=base.get("path"))
            fields["base_fingerprint"] = base.get("fingerprint")
        if "base" in read and "base_model_path" not in fields:
            fields.update(base_model_path=record.get("base"), base_fingerprint=record.get("fingerprint"))
    return fields
