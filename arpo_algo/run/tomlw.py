"""A small TOML writer for the value types experiment files use (str, int, float, bool, lists, inline tables)."""

from __future__ import annotations

import math
from typing import Any


def toml_literal(value: Any) -> str:
    """A TOML literal for a value (used for overrides and best.toml)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_literal(v)}" for k, v in value.items()) + "}"
    return str(value)


def toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else toml_literal(key)


def to_toml(sections: dict[str, dict[str, Any]], header: str = "") -> str:
    """Sections as a TOML file (None values are left out: TOML has no null)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, body in sections.items():
        lines += ["", f"[{section}]"]
        lines += [f"{toml_key(k)} = {toml_literal(v)}" for k, v in body.items() if v is not None]
    return "\n".join(lines).lstrip("\n") + "\n"
