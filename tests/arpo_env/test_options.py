"""The strict-options helper every config class uses: types, unknown keys with the closest name, overrides."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Literal

import pytest

from arpo_base.errors import ConfigError
from arpo_base.options import (
    apply_overrides,
    check_choice,
    check_keys,
    check_type,
    conforms,
    dataclass_from_dict,
    parse_override,
    type_name,
    unknown_key_error,
)


def test_conforms_types_and_coercions():
    assert conforms(3, float) == (True, 3.0) and type(conforms(3, float)[1]) is float
    assert conforms(True, int)[0] is False and conforms(True, float)[0] is False  # bool is not a number here
    assert conforms(1, Literal[True, 1])[0] and not conforms(True, Literal[1, 2])[0]
    assert conforms([1, 2], tuple[int, ...]) == (True, (1, 2))
    assert not conforms([1, "2"], tuple[int, ...])[0] and not conforms((1, 2, 3), tuple[int, int])[0]
    assert conforms([1, 2], list[int]) == (True, [1, 2]) and not conforms([1, "2"], list[int])[0]
    assert conforms(None, int | None)[0] and not conforms(None, int)[0]
    assert conforms({"a": 1}, dict)[0] and not conforms([], dict)[0]
    assert type_name(Literal["a", "b"] | None) == "'a' | 'b' | None"
    assert type_name(list[int] | None) == "list[int] | None" and type_name(tuple[int, ...]) == "tuple[int, ...]"


def test_errors_name_the_key_and_the_closest_valid_name():
    with pytest.raises(ConfigError, match=r"^where: lr must be float, got 'fast' \(str\)$"):
        check_type("lr", "fast", float, "where")
    err = unknown_key_error("budgte", ["budget", "initial"], "tree")
    assert err.message == "tree: unknown key 'budgte'" and err.hint == "did you mean 'budget'?"
    err = unknown_key_error("zzz", ["budget", "initial"], "tree")
    assert err.hint == "valid keys: budget, initial"  # nothing close: list them all
    with pytest.raises(ConfigError, match="unknown key 'lr_shedule'") as e:
        check_keys({"lr": 1, "lr_shedule": "x"}, ["lr", "lr_schedule"], "learner")
    assert e.value.hint == "did you mean 'lr_schedule'?"
    with pytest.raises(ConfigError, match="must be a table/dict"):
        check_keys(["lr"], ["lr"], "learner")
    with pytest.raises(ConfigError, match="x: mode='arpoo' is not one of 'arpo', 'grpo'") as e:
        check_choice("mode", "arpoo", ("arpo", "grpo"), "x")
    assert e.value.hint == "did you mean 'arpo'?"
    with pytest.raises(ConfigError, match="flag=True is not one of 1, 2"):
        check_choice("flag", True, (1, 2), "x")  # True == 1, but it is not a choice


@dataclasses.dataclass
class _Settings:
    lr: float = 1e-3
    levels: list[int] | None = None
    mode: Literal["a", "b"] = "a"


def test_dataclass_from_dict():
    s = dataclass_from_dict(_Settings, {"lr": 2, "levels": [1, 2]}, "demo")
    assert s == _Settings(lr=2.0, levels=[1, 2]) and type(s.lr) is float
    with pytest.raises(ConfigError, match="demo: unknown key 'lvels'"):
        dataclass_from_dict(_Settings, {"lvels": [1]}, "demo")
    with pytest.raises(ConfigError, match="demo: mode must be 'a' | 'b', got 'c'"):
        dataclass_from_dict(_Settings, {"mode": "c"}, "demo")


def test_override_parser_sections_and_flat():
    sections = ("tree", "training")
    assert parse_override("tree.budget=8", sections) == ("tree", "budget", 8)
    assert parse_override("training.lr = 1e-5", sections) == ("training", "lr", 1e-5)
    assert parse_override("tree.levels=[1, 2]", sections) == ("tree", "levels", [1, 2])
    assert parse_override('tree.rule="paper"', sections) == ("tree", "rule", "paper")
    assert parse_override("tree.path=runs/sft", sections) == ("tree", "path", "runs/sft")  # bare string
    assert parse_override("bf16=true") == (None, "bf16", True)  # no sections: key=value
    with pytest.raises(ConfigError, match="unknown section 'tre'") as e:
        parse_override("tre.budget=8", sections)
    assert e.value.hint == "did you mean 'tree'?"
    with pytest.raises(ConfigError, match="the key must be section.key"):
        parse_override("budget=8", sections)
    with pytest.raises(ConfigError, match="no sections, so the form is key=value"):
        parse_override("sft.lr=1e-5")
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override("lr")
    base = {"tree": {"budget": 4}, "model": {"path": "m"}}
    out = apply_overrides(base, ["tree.budget=8", "training.lr=1e-5"], ("tree", "training", "model"))
    assert out == {"tree": {"budget": 8}, "model": {"path": "m"}, "training": {"lr": 1e-5}}
    assert base["tree"]["budget"] == 4  # the input is not modified
    assert apply_overrides({"lr": 1.0}, ["lr=2e-4", "levels=[1]"]) == {"lr": 2e-4, "levels": [1]}


def test_options_import_without_torch_or_ray():
    code = "import sys, arpo_base.options; print(any(m in sys.modules for m in ('torch', 'ray')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_checkout_paths_only_in_a_checkout(tmp_path, monkeypatch):
    """Bug: the shared-data and experiments paths were derived from the package location even in a wheel install
    (site-packages/../shared/...). They now count only when the package sits in an arpo source checkout."""
    from pathlib import Path

    import arpo_env.data as data
    from arpo_base.paths import source_checkout

    repo = Path(__file__).resolve().parents[2]
    assert source_checkout() == repo
    wheel = tmp_path / "site-packages" / "arpo_env"
    wheel.mkdir(parents=True)
    assert source_checkout(wheel) is None
    (tmp_path / "site-packages" / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert source_checkout(wheel) is None
    monkeypatch.delenv("ARPO_DATA", raising=False)
    monkeypatch.setattr(data, "source_checkout", lambda: None)
    assert data._candidates() == [data.data_dir()]
