"""The repository passes ``ruff check`` with the settings in pyproject.toml (line length 120 included): a finding
anywhere in the checked packages fails this test with ruff's own report. The typed packages pass mypy (settings in
pyproject.toml's ``[tool.mypy]``, unannotated bodies checked) with zero errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Everything the project's Python lives in.
CHECKED = ("arpo_base", "arpo_env", "arpo_algo", "serve", "benchmarks", "studies", "examples", "tests")
#: The packages mypy checks; each must stay at zero errors.
TYPED = ("arpo_env", "arpo_algo.core", "arpo_algo.rollout")


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


def test_mypy_finds_nothing():
    """One mypy run over the typed packages (about a minute); its cache lives in a temporary folder so the run writes
    nothing into the repository and starts from the same state each time."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the dev extra: pip install -e '.[dev]')")
    packages = [arg for name in TYPED for arg in ("-p", name)]
    with tempfile.TemporaryDirectory(prefix="arpo-mypy-") as cache:
        proc = subprocess.run(
            [sys.executable, "-m", "mypy", "--cache-dir", cache, *packages],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if proc.returncode != 0:
        pytest.fail(f"mypy found problems:\n{proc.stdout}{proc.stderr}", pytrace=False)
