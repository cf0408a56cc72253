"""The vLLM engine family: :class:`~arpo_algo.rollout.engines.vllm.engine.VLLMEngine`, its LoRA request handling
(``lora``) and the checks of the installed vLLM (``support``). ``VLLMEngine`` is imported on first use, so importing
this package does not import vLLM."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VLLMEngine"]
