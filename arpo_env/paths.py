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
