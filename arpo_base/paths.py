"""Where arpo keeps models, data and caches: ``$ARPO_HOME`` (default ``~/.cache/arpo``)."""

from __future__ import annotations

import os
from pathlib import Path


def arpo_home() -> Path:
    """The root cache directory. ``ARPO_HOME`` overrides the default ``~/.cache/arpo``."""
    return Path(os.environ.get("ARPO_HOME") or Path.home() / ".cache" / "arpo").expanduser()


def models_dir() -> Path:
    return arpo_home() / "models"


def data_dir() -> Path:
    """Where ``arpo data pull`` puts the ARPO reference datasets."""
    return arpo_home() / "data" / "arpo"


def cache_dir() -> Path:
    """Default location of the on-disk tool-result caches."""
    return arpo_home() / "tool_cache"


def source_checkout(package_dir: Path | None = None) -> Path | None:
    """The repository root when arpo runs from a source checkout (editable install or ``PYTHONPATH``), else None.

    A wheel install puts the packages in ``site-packages``, where there is no ``experiments/`` folder and no
    ``../shared`` beside them: paths derived from the package location are only meaningful in a checkout, which is
    recognised by the ``pyproject.toml`` of project ``arpo`` next to the package.
    """
    root = (package_dir or Path(__file__).resolve().parent).parent
    pyproject = root / "pyproject.toml"
    try:
        if pyproject.is_file() and 'name = "arpo"' in pyproject.read_text(encoding="utf-8"):
            return root
    except OSError:
        pass
    return None


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries durable (a file created, linked or renamed in it survives a crash once this returns)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
