"""The transformers engine family: :class:`~arpo_algo.rollout.engines.hf.engine.HFEngine` and its decode paths.

``engine`` is the engine; ``decode_mode`` picks a decode path (``static_decode``'s fixed-shape steps, eager or replayed
as CUDA graphs, and the experimental ``compiled_step``); ``kv_cache``, ``slot_prefill``, ``adapters`` and
``linear_layout`` are its caches, prefill, named LoRA adapters and weight layout. ``HFEngine`` is imported on first
use, so importing this package (or a pure helper in it) does not build anything.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "HFEngine":
        from arpo_algo.rollout.engines.hf.engine import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HFEngine"]
