"""Every TOML arpo writes reads back through tomllib as the same values, the awkward ones included."""

from __future__ import annotations

import math
import tomllib

import pytest

from arpo_algo.run.tomlw import to_toml, toml_literal

AWKWARD = {
    "newline": "two\nlines",
    "quotes": 'say "hi" \\ done',
    "unicode": "naïve – 数",
    "tab": "a\tb",
    "inf": math.inf,
    "big": 10**18,
    "flag": False,
    "empty": "",
    "list": [1, "x", [2.5]],
}


def test_a_file_round_trips_with_awkward_strings_keys_and_nested_tables():
    sections = {
        "experiment": {**AWKWARD, "unset": None, "ключ é": 1, "dotted.key": 2},
        "env": {"table": {"inner": None, "k": [True], "deep": {"x": "y\n"}}},
    }
    back = tomllib.loads(to_toml(sections, "header line one\nline two"))
    want = {
        "experiment": {**AWKWARD, "ключ é": 1, "dotted.key": 2},  # None is left out: TOML has no null
        "env": {"table": {"k": [True], "deep": {"x": "y\n"}}},
    }
    assert back == want


@pytest.mark.parametrize("value", [*AWKWARD.values(), {"a b": {"c": [1, 2]}}, -0.5])
def test_an_override_literal_is_one_line_and_reads_back(value):
    literal = toml_literal(value)
    assert "\n" not in literal
    assert tomllib.loads(f"v = {literal}")["v"] == value


def test_null_inside_a_list_is_refused():
    with pytest.raises(ValueError, match="no null"):
        to_toml({"s": {"k": [1, None]}})
