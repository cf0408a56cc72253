"""Task lists over the ARPO reference parquet files (verl schema,
docs/concepts/reference-choices.md#datasets-and-cold-start)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arpo_base.errors import ConfigError
from arpo_env.data import find_data_file, load_reference_tasks
from arpo_env.protocol import apply_boxed_bug, fix_boxed_bug

# split -> parquet files, per task family. "test" of DeepSearch concatenates GAIA then HLE.
SPLIT_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    "reasoning": {"train": ("train_10k.parquet",), "test": ("valid.parquet",)},
    "deepsearch": {"train": ("hard_search_1k.parquet",), "test": ("gaia_test.parquet", "hle_test.parquet")},
}


class ReferenceTasks:
    """The rows of one or more reference parquet files as a task sequence.

    Args:
        family: "reasoning" or "deepsearch" (chooses the default files per split).
        split: "train" or "test".
        data_dir: folder holding the files (default: :func:`arpo_env.data.shared_data_dir` search order).
        data_files: explicit file names inside the data folder (overrides the split's defaults).
        keep_boxed_bug: keep the released system prompt's backspace-``oxed`` instead of ``\\boxed`` (default False).
    """

    def __init__(
        self,
        family: str,
        split: str = "train",
        data_dir: str | None = None,
        data_files: Sequence[str] | None = None,
        keep_boxed_bug: bool = False,
    ) -> None:
        if split not in SPLIT_FILES[family]:
            raise ConfigError(f"split must be one of {sorted(SPLIT_FILES[family])}, got {split!r}")
        files = tuple(data_files) if data_files else SPLIT_FILES[family][split]
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
