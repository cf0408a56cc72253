"""Strict options: the one place that checks configuration keys, types and choices, and parses ``--set`` overrides.

Every config class of arpo uses these helpers (the environment's config, tool specs, TreeConfig, LearnerConfig,
ARPOConfig and its siblings, experiment files, SFTConfig), so a mistake reads the same everywhere:

* an unknown key: ``"<where>: unknown key 'budgte'"`` with the hint ``did you mean 'budget'?`` (the closest valid
  name; when nothing is close, the list of valid names), see :func:`unknown_key_error` / :func:`check_keys`;
* a wrong type: ``"<where>: lr must be float, got 'fast' (str)"``, see :func:`check_type` (types are the fields'
  annotations: ``int``, ``float`` (an int is accepted and becomes a float), ``bool``, ``str``, ``Literal[...]``,
  unions, ``X | None``, ``tuple[...]`` (a list is accepted and becomes a tuple), ``list[int]``, ``dict``);
* a value outside a fixed set: ``"<where>: lr_schedule='cosin' is not one of 'constant', 'linear', 'cosine'"`` with
  ``did you mean 'cosine'?``, see :func:`choice_error`.

Overrides (:func:`parse_override`, used by ``arpo train`` and ``arpo sft`` and meant for every command):
``--set section.key=value`` where a config has sections (experiment files), ``--set key=value`` where it has none
(SFT). The value is read as a TOML literal (``8``, ``1e-5``, ``true``, ``[1, 2]``, ``"text"``); anything that is not
valid TOML is taken as a bare string (``--set model.path=runs/sft``).

This module is pure Python (no torch, no Ray), so ``arpo_env`` and every room above it can use it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from arpo_base.errors import ConfigError

__all__ = [
    "apply_overrides",
    "check_keys",
    "check_type",
    "choice_error",
    "closest",
    "conforms",
    "dataclass_from_dict",
    "parse_override",
    "parse_value",
    "type_name",
    "unknown_key_error",
]


# ------------------------------------------------------------------------------------------------------- names


def closest(name: str, valid: Iterable[str]) -> str | None:
    """The valid name closest to ``name`` (difflib ratio >= 0.6), or None."""
    found = difflib.get_close_matches(str(name), sorted(set(map(str, valid))), n=1, cutoff=0.6)
    return found[0] if found else None


#: Hints for keys people carry over from other tools into a table that does not take them, by the table's name as
#: it appears in ``where`` (``[model.lora]``): the hint says why instead of a near-miss guess.
KEY_HINTS = {
    "[model.lora]": {
        "use_dora": "DoRA is not supported: [model.lora] trains plain LoRA adapters",
        "modules_to_save": (
            "modules_to_save is not supported: embeddings and the LM head stay frozen under [model.lora]"
        ),
        "bias": "bias training is not supported: [model.lora] trains the adapter matrices only",
    }
}


def _did_you_mean(name: str, valid: Iterable[str], label: str, where: str = "") -> str:
    valid = sorted(set(map(str, valid)))
    for table, hints in KEY_HINTS.items():
        if str(where).endswith(table) and str(name) in hints:
            return hints[str(name)]
    near = closest(name, valid)
    return f"did you mean {near!r}?" if near else f"{label}: {', '.join(valid)}"


def unknown_key_error(key: str, valid: Iterable[str], where: str, *, what: str = "key") -> ConfigError:
    """A ConfigError ``"<where>: unknown <what> '<key>'"`` with the closest valid name (or all of them) as hint."""
    return ConfigError(f"{where}: unknown {what} {key!r}", hint=_did_you_mean(key, valid, f"valid {what}s", where))


def check_keys(given: Mapping[str, Any], valid: Iterable[str], where: str, *, what: str = "key") -> None:
    """Raise :func:`unknown_key_error` for the first key of ``given`` that is not in ``valid``."""
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where} must be a table/dict, got {type(given).__name__}: {given!r}")
    valid = set(valid)
    for key in given:
        if key not in valid:
            raise unknown_key_error(key, valid, where, what=what)


def choice_error(name: str, value: Any, choices: Sequence[Any], where: str) -> ConfigError:
    """A ConfigError for a value outside a fixed set, naming the choices and the closest one."""
    listed = ", ".join(repr(c) for c in choices)
    near = closest(value, [str(c) for c in choices]) if isinstance(value, str) else None
    return ConfigError(
        f"{where}: {name}={value!r} is not one of {listed}", hint=f"did you mean {near!r}?" if near else None
    )


def check_choice(name: str, value: Any, choices: Sequence[Any], where: str) -> Any:
    """Return ``value`` if it is one of ``choices``; raise :func:`choice_error` otherwise."""
    if value not in choices or isinstance(value, bool) and not any(c is value for c in choices):
        raise choice_error(name, value, choices, where)
    return value


# ------------------------------------------------------------------------------------------------------- types


def type_name(hint: Any) -> str:
    """A readable name of a type annotation (``'a' | 'b'``, ``int | None``, ``tuple[int, ...]``)."""
    origin = get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "None"
    if origin is not None and get_args(hint):
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(hint, "__name__", str(hint))


def conforms(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits ``hint``; returns the (possibly coerced: int -> float, list -> tuple) value.

    ``bool`` is not an ``int`` here (``True`` for an int field is a mistake), and a Literal compares types too
    (``True == 1`` in Python).
    """
    origin = get_origin(hint)
    if hint is Any:
        return True, value
    if hint is type(None) or hint is None:
        return value is None, value
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(hint)), value
    if origin in (Union, types.UnionType):
        for arg in get_args(hint):
            ok, v = conforms(value, arg)
            if ok:
                return True, v
        return False, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    if origin is tuple or hint is tuple:
        if not isinstance(value, (tuple, list)):
            return False, value
        args = get_args(hint)
        if args and args[-1] is not Ellipsis and len(args) != len(value):
            return False, value
        elems = [args[0]] * len(value) if args and args[-1] is Ellipsis else list(args) or [Any] * len(value)
        out = []
        for v, h in zip(value, elems):
            ok, v2 = conforms(v, h)
            if not ok:
                return False, value
            out.append(v2)
        return True, tuple(out)
    if origin is list or hint is list:
        if not isinstance(value, list):
            return False, value
        (elem,) = get_args(hint) or (Any,)
        out = []
        for v in value:
            ok, v2 = conforms(v, elem)
            if not ok:
                return False, value
            out.append(v2)
        return True, out
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return isinstance(value, Mapping), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    raise TypeError(f"unsupported type annotation {hint!r}")


def check_type(name: str, value: Any, hint: Any, where: str, *, doc: str | None = None) -> Any:
    """Return ``value`` (coerced) if it fits ``hint``; else ConfigError ``"<where>: <name> must be <type>, got
    ..."``."""
    ok, coerced = conforms(value, hint)
    if not ok:
        raise ConfigError(
            f"{where}: {name} must be {type_name(hint)}, got {value!r} ({type(value).__name__})", hint=doc
        )
    return coerced


def dataclass_from_dict(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """``cls(**values)`` for a dataclass, after rejecting unknown keys and checking every value against its field's
    annotation (with the coercions of :func:`conforms`). The caller validates ranges and combinations."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a table/dict, got {type(values).__name__}: {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    check_keys(values, names, where)
    return cls(**{k: check_type(k, v, hints[k], where) for k, v in values.items()})


# --------------------------------------------------------------------------------------------------- overrides


def read_toml(path: Any) -> dict[str, Any]:
    """A TOML file as a dict; invalid TOML is a ConfigError naming the file."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e


def parse_value(raw: str) -> Any:
    """A TOML literal (``8``, ``1e-5``, ``true``, ``[1, 2]``, ``"s"``, ``{a = 1}``), else ``raw`` as a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_override(
    item: str, sections: Iterable[str] | None = None, *, flag: str = "--set"
) -> tuple[str | None, str, Any]:
    """Parse one override into ``(section, key, value)``.

    Args:
        item: ``section.key=value`` when ``sections`` is given (``key`` may itself be dotted for a sub-table:
            ``rollouts.hf.decode=static``), else ``key=value`` (section None).
        sections: The config's sections (an unknown one is an error with the closest name); None for a config
            without sections, where a dotted key is an error that says so.
        flag: The option's name, for messages.
    """
    if "=" not in item:
        form = "section.key=value" if sections is not None else "key=value"
        raise ConfigError(f"{flag} {item!r}: expected {form}", hint=_example(sections, flag))
    dotted, raw = (s.strip() for s in item.split("=", 1))
    value = parse_value(raw)
    if sections is None:
        if "." in dotted or not dotted:
            raise ConfigError(
                f"{flag} {item!r}: this config has no sections, so the form is key=value", hint=_example(None, flag)
            )
        return None, dotted, value
    sections = tuple(sections)
    if "." not in dotted or not all(dotted.split(".")):
        raise ConfigError(f"{flag} {item!r}: the key must be section.key", hint=_example(sections, flag))
    section, key = dotted.split(".", 1)
    if section not in sections:
        raise unknown_key_error(section, sections, f"{flag} {item!r}", what="section")
    return section, key, value


def _example(sections: Iterable[str] | None, flag: str) -> str:
    if sections is None:
        return f"e.g. {flag} lr=1e-5 (a TOML value; bare words are strings)"
    return f"e.g. {flag} tree.budget=8 (sections: {', '.join(sections)}; values are TOML, bare words are strings)"


def apply_overrides(
    values: Mapping[str, Any], items: Iterable[str], sections: Iterable[str] | None = None, *, flag: str = "--set"
) -> dict[str, Any]:
    """A copy of ``values`` (a config dict, with ``sections`` as sub-dicts if given) with the overrides applied; a
    dotted key inside a section (``rollouts.hf.decode``) lands in the sub-table it names."""
    out = copy.deepcopy(dict(values))
    sections = tuple(sections) if sections is not None else None
    for item in items:
        section, key, value = parse_override(item, sections, flag=flag)
        if section is None:
            out[key] = value
            continue
        body = out.setdefault(section, {})
        *tables, name = key.split(".")
        path = [section]
        for table in tables:
            if not isinstance(body, dict):
                break
            body = body.setdefault(table, {})
            path.append(table)
        if not isinstance(body, dict):
            raise ConfigError(f"{flag} {item!r}: {'.'.join(path)!r} is not a section in the config")
        body[name] = value
    return out


# ------------------------------------------------------------------------------------------- section dataclasses


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with its one-sentence documentation (the generated settings reference reads it)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("a mutable default needs dataclasses.field(default_factory=...)")
    return dataclasses.field(default=default, metadata={"doc": doc})


def update_dataclass(
    obj: Any, values: Mapping[str, Any], where: str, *, placeholder: Callable[[Any], bool] | None = None
) -> Any:
    """A copy of the dataclass ``obj`` with ``values`` applied, each key and type checked against its fields.

    A key that names a nested dataclass field (an engine sub-table) takes a table and updates that dataclass.
    Range and combination checks are the dataclass's own
    ``validate()``, run once the whole configuration is assembled. A value for which ``placeholder`` is true (a
    Tune search space waiting to be resolved) is stored unchecked; ``validate()`` must refuse it if it remains.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a table/dict, got {type(values).__name__}: {values!r}")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj) if f.init]
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            raise unknown_key_error(key, names, where)
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            inner = f"{where[:-1]}.{key}]" if where.endswith("]") else f"{where}.{key}"
            changes[key] = update_dataclass(current, value, inner, placeholder=placeholder)
        elif placeholder is not None and placeholder(value):
            changes[key] = value
        else:
            changes[key] = check_type(key, value, hints[key], where)
    return dataclasses.replace(obj, **changes) if changes else obj


def dataclass_rows(cls: type, prefix: str = "") -> list[tuple[str, Any, Any, dataclasses.Field]]:
    """``(dotted name, type, default, field)`` of every setting of a section dataclass, nested tables flattened."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            rows += dataclass_rows(type(default), f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", hints[f.name], default, f))
    return rows
