"""Task lists over the ARPO reference parquet files (verl schema,
docs/concepts/reference-choices.md#datasets-and-cold-start)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError, MissingDataError
from arpo_env.data import find_data_file, load_reference_tasks
from arpo_env.protocol import apply_boxed_bug, fix_boxed_bug

# split -> parquet files, per task family. "test" of DeepSearch concatenates GAIA then HLE.
SPLIT_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    "reasoning": {"train": ("train_10k.parquet",), "test": ("valid.parquet",)},
    "deepsearch": {"train": ("hard_search_1k.parquet",), "test": ("gaia_test.parquet", "hle_test.parquet")},
}


def _resolved(name: str, data_dir: str | None) -> Path | str:
    """The file a name reads in ``data_dir`` (links resolved), or the normalised name where no such file exists."""
    try:
        return find_data_file(name, data_dir).resolve()
    except MissingDataError:
        return os.path.normpath(name)


def _same_file(a: Path | str, b: Path | str) -> bool:
    """One file under two names (``./valid.parquet``, a link to it) or two files with the same bytes (a copy)."""
    if a == b:
        return True
    if not isinstance(a, Path) or not isinstance(b, Path) or a.stat().st_size != b.stat().st_size:
        return False
    return hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()


def split_files(
    family: str, split: str, data_files: Mapping[str, Sequence[str]] | None, data_dir: str | None = None
) -> tuple[str, ...]:
    """The files ``split`` reads. Invariant: the test split never reads a file of the train split, whatever the
    names: files are compared as what they resolve to in ``data_dir`` (the same file, or the same bytes)."""
    defaults = SPLIT_FILES[family]
    if data_files is None:
        return defaults[split]
    if isinstance(data_files, str) or not isinstance(data_files, Mapping):
        raise ConfigError(
            f"data_files={data_files!r} names no split: every split (training and the held-out test) "
            "would read the same files",
            hint='give the files per split, e.g. data_files = {train = ["mine_train.parquet"], '
            'test = ["mine_test.parquet"]}',
        )
    unknown = sorted(set(data_files) - set(defaults))
    if unknown:
        raise ConfigError(f"data_files: unknown split {unknown[0]!r}; splits are {sorted(defaults)}")
    chosen = {name: tuple(data_files.get(name) or defaults[name]) for name in defaults}
    train = [_resolved(name, data_dir) for name in chosen["train"]]
    shared = sorted(name for name in chosen["test"] if any(_same_file(_resolved(name, data_dir), t) for t in train))
    if shared:
        raise ConfigError(
            f"data_files: {shared} would be read by both the train and the test split",
            hint="the held-out split must not contain training files",
        )
    return chosen[split]


class ReferenceTasks:
    """The rows of one or more reference parquet files as a task sequence.

    Args:
        family: "reasoning" or "deepsearch" (chooses the default files per split).
        split: "train" or "test".
        data_dir: folder holding the files (default: :func:`arpo_env.data.shared_data_dir` search order).
        data_files: explicit file names inside the data folder, per split: ``{"train": [...], "test": [...]}``
            (a split not named keeps its defaults). A plain list is refused: every split would read it, so the
            held-out split could load the training files and still call them "test".
        keep_boxed_bug: keep the released system prompt's backspace-``oxed`` instead of ``\\boxed`` (default False).
    """

    def __init__(
        self,
        family: str,
        split: str = "train",
        data_dir: str | None = None,
        data_files: Mapping[str, Sequence[str]] | None = None,
        keep_boxed_bug: bool = False,
    ) -> None:
        if split not in SPLIT_FILES[family]:
            raise ConfigError(f"split must be one of {sorted(SPLIT_FILES[family])}, got {split!r}")
        files = split_files(family, split, data_files, data_dir)
        self.split = split
        self.paths = [find_data_file(name, data_dir) for name in files]
        self._rows: list[dict[str, Any]] = []
        for path in self.paths:
            self._rows.extend(load_reference_tasks(path))
        if not self._rows:
            raise ConfigError(f"data_files: {files} hold no rows")
        self.keep_boxed_bug = keep_boxed_bug
        system = self._rows[0]["system"]
        self.system_prompt = apply_boxed_bug(system) if keep_boxed_bug else fix_boxed_bug(system)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self._rows[index]
        system = row["system"]
        return {
            "id": row["id"],
            "question": row["question"],
            "ground_truth": row["ground_truth"],
            "split": self.split,
            "ability": row["ability"],
            "data_source": row["data_source"],
            "system": apply_boxed_bug(system) if self.keep_boxed_bug else fix_boxed_bug(system),
            "reward_kwargs": {},
        }
