"""The ARPO reference datasets: where they are, how to read them, how to fetch them.

Location order (:func:`shared_data_dir`): ``$ARPO_DATA``, then ``<repo>/../shared/data/arpo`` (only when running
from a source checkout, see :func:`arpo_base.paths.source_checkout`), then ``$ARPO_HOME/data/arpo`` (where
``arpo data pull`` writes). Files are read with pyarrow, never copied into the repo.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from arpo_base.errors import ArpoError, MissingDataError
from arpo_base.http import download
from arpo_base.paths import data_dir, source_checkout

# file -> download URL. The parquet files are published on the Hugging Face hub; the search cache lives in the
# reference GitHub repository (ARPO/search_cache/).
HF_REASONING = "https://huggingface.co/datasets/dongguanting/ARPO-RL-Reasoning-10K/resolve/main"
HF_DEEPSEARCH = "https://huggingface.co/datasets/dongguanting/ARPO-RL-DeepSearch-1K/resolve/main"
GITHUB_RAW = "https://raw.githubusercontent.com/dongguanting/ARPO/main/ARPO"
REFERENCE_FILES: dict[str, str] = {
    "train_10k.parquet": f"{HF_REASONING}/train_10k.parquet",
    "valid.parquet": f"{HF_REASONING}/valid.parquet",
    "hard_search_1k.parquet": f"{HF_DEEPSEARCH}/hard_search_1k.parquet",
    "gaia_test.parquet": f"{GITHUB_RAW}/rl_datasets/gaia_test.parquet",
    "hle_test.parquet": f"{GITHUB_RAW}/rl_datasets/hle_test.parquet",
    "search_cache.json": f"{GITHUB_RAW}/search_cache/search_cache.json",
}
PULL_HINT = "run `arpo data pull` (with internet) or `arpo data pull --from DIR` (a folder holding the files)"


def _candidates() -> list[Path]:
    out = []
    if os.environ.get("ARPO_DATA"):
        out.append(Path(os.environ["ARPO_DATA"]).expanduser())
    checkout = source_checkout()
    if checkout is not None:
        out.append(checkout.parent / "shared" / "data" / "arpo")
    out.append(data_dir())
    return out


def shared_data_dir() -> Path | None:
    """The first folder holding the reference data (``valid.parquet`` present), or None."""
    for cand in _candidates():
        if (cand / "valid.parquet").is_file():
            return cand
    return None


def find_data_file(name: str, data_dir_override: str | os.PathLike | None = None) -> Path:
    """Path of one reference file; raises MissingDataError naming the searched paths and the fetch command."""
    folders = [Path(data_dir_override).expanduser()] if data_dir_override else _candidates()
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    searched = ", ".join(str(f / name) for f in folders)
    raise MissingDataError(f"data file {name} not found (looked at {searched})", hint=PULL_HINT)


@functools.lru_cache(maxsize=16)
def _read_rows(path: str, mtime: float) -> tuple[dict[str, Any], ...]:
    import pyarrow.parquet as pq

    return tuple(pq.read_table(path).to_pylist())


def load_reference_tasks(path: Path) -> list[dict[str, Any]]:
    """Rows of a verl-style parquet file as task dicts (cached per file; read-only use).

    Each task: ``id``, ``question`` (the user message), ``system`` (the file's system prompt, unmodified),
    ``ground_truth``, ``split``, ``ability``, ``data_source``.
    """
    rows = _read_rows(str(path), path.stat().st_mtime)
    tasks = []
    for i, row in enumerate(rows):
        prompt = list(row["prompt"])
        system = next((m["content"] for m in prompt if m["role"] == "system"), "")
        user = next(m["content"] for m in prompt if m["role"] == "user")
        extra = row.get("extra_info") or {}
        tasks.append(
            {
                "id": f"{path.stem}-{extra.get('index', i)}",
                "question": user,
                "system": system,
                "ground_truth": row["reward_model"]["ground_truth"],
                "split": extra.get("split"),
                "ability": row.get("ability"),
                "data_source": row.get("data_source"),
            }
        )
    return tasks


# ------------------------------------------------------------------------------------------------------ pull


def _download(url: str, dest: Path, timeout: float) -> None:
    download(url, str(dest), timeout=timeout, headers={"User-Agent": "arpo-data-pull"})


def _check_online(url: str, timeout: float) -> None:
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ArpoError(
            f"cannot reach {host}:{port} ({e.__class__.__name__}: {e}); this machine looks offline",
            hint="download the files elsewhere and run `arpo data pull --from DIR`",
        ) from None


def _urls(mirror: str | None) -> dict[str, str]:
    """Download URL per file: the published locations, or ``<mirror>/<file>`` for a mirror (``ARPO_DATA_MIRROR``)."""
    mirror = mirror or os.environ.get("ARPO_DATA_MIRROR") or None
    if mirror:
        return {name: f"{mirror.rstrip('/')}/{name}" for name in REFERENCE_FILES}
    return dict(REFERENCE_FILES)


def _commit_dir(staging: Path, dest: Path) -> None:
    # Move every file into place with os.replace (atomic per file, same filesystem as the staging dir).
    dest.mkdir(parents=True, exist_ok=True)
    for f in staging.iterdir():
        os.replace(f, dest / f.name)


def pull(
    dest: Path | None = None, from_dir: Path | None = None, timeout: float = 5.0, mirror: str | None = None
) -> Path:
    """Fetch the reference files into ``dest`` (default ``$ARPO_HOME/data/arpo``) and return that folder.

    Args:
        dest: target folder.
        from_dir: import from a local folder instead of downloading; every expected file must be there.
        timeout: seconds per network connection attempt (offline machines fail fast with a clear message).
        mirror: base URL serving the six files by name (default: ``$ARPO_DATA_MIRROR``, else the published URLs).

    Raises:
        MissingDataError: ``from_dir`` lacks some expected file (all missing names are listed).
        ArpoError: the network is unreachable or a download fails.
    """
    dest = Path(dest) if dest is not None else data_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if from_dir is not None:
        src = Path(from_dir).expanduser()
        missing = [n for n in REFERENCE_FILES if not (src / n).is_file()]
        if missing:
            raise MissingDataError(f"{src} lacks {', '.join(missing)}", hint=f"expected: {', '.join(REFERENCE_FILES)}")
    urls = _urls(mirror)
    if from_dir is None:
        _check_online(next(iter(urls.values())), timeout)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
        staging = Path(tmp)
        for name, url in urls.items():
            if from_dir is not None:
                shutil.copyfile(Path(from_dir).expanduser() / name, staging / name)
                continue
            try:
                _download(url, staging / name, timeout)
            except OSError as e:
                raise ArpoError(f"download of {name} failed ({e})", hint=f"URL: {url}") from None
        _commit_dir(staging, dest)
    return dest
