"""Writing TOML: every TOML file and ``--set`` literal arpo writes goes through ``tomli_w``, so what it writes reads
back through ``tomllib`` as the same values (strings with newlines or quotes, non-ASCII keys, nested tables)."""

from __future__ import annotations

from typing import Any

import tomli_w


def _without_none(value: Any, where: str) -> Any:
    """``value`` with None dropped from tables (TOML has no null: an unset key is absent); None in a list is
    refused."""
    if isinstance(value, dict):
        return {str(k): _without_none(v, f"{where}.{k}") for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        if any(v is None for v in value):
            raise ValueError(f"{where}: TOML has no null, and a list cannot leave an element out")
        return [_without_none(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _key(key: str) -> str:
    return tomli_w.dumps({key: 0}).rstrip("\n").removesuffix(" = 0")


def toml_literal(value: Any) -> str:
    """The TOML literal of one value on one line (an override's right-hand side; tables and arrays inline):
    ``tomllib.loads(f"v = {toml_literal(x)}")["v"] == x``. Scalars and keys are formatted by ``tomli_w``."""
    value = _without_none(value, "value")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).rstrip("\n").removeprefix("v = ")


def to_toml(sections: dict[str, dict[str, Any]], header: str = "") -> str:
    """Sections as a TOML file, each line of ``header`` a comment on top (None values are left out)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    body = tomli_w.dumps(_without_none(sections, "toml"))
    return f"{comment}\n{body}" if comment else body
