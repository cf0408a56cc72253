"""The repository passes ``ruff check`` with the settings in pyproject.toml (line length 120 included): a finding
anywhere in the checked packages fails this test with ruff's own report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Everything the project's Python lives in.
CHECKED = ("arpo_base", "arpo_env", "arpo_algo", "serve", "benchmarks", "studies", "examples", "tests")


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *CHECKED],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"ruff check found problems:\n{proc.stdout}{proc.stderr}", pytrace=False)


def test_the_code_is_formatted():
    """Every Python file is as ``ruff format`` writes it (one formatter, settings in pyproject.toml): a file that is not
    fails this test with the diff ruff would apply."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--no-cache", "--check", "--diff", *CHECKED],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"ruff format would change files (run `ruff format .`):\n{proc.stdout}{proc.stderr}", pytrace=False)
