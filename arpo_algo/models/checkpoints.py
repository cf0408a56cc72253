"""The training checkpoint folder layout, as far as readers of checkpoints need it.

A run folder keeps its checkpoints under ``checkpoints/iter_N/`` (``N`` zero-padded); a checkpoint is complete once
its ``arpo_checkpoint.json`` exists (it is written into a temporary folder that is renamed as a whole), and its
``policy/`` folder is a plain Hugging Face model folder. Checkpoints of an earlier arpo (RLlib's pickled layout,
marked by ``rllib_checkpoint.json``) are listed too, so a reader can refuse them by name instead of not seeing them.
The training driver writes this layout; the server and the commands that resume a run read it, so it lives here,
below both.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "iter_"
#: The file whose presence marks a finished checkpoint.
CHECKPOINT_MARKER = "arpo_checkpoint.json"
#: The marker of the former pickled layout.
LEGACY_CHECKPOINT_MARKER = "rllib_checkpoint.json"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Completed checkpoints under ``ckpt_root``, oldest first (half-written ``.tmp`` folders are ignored)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and ((p / CHECKPOINT_MARKER).is_file() or (p / LEGACY_CHECKPOINT_MARKER).is_file())]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))
