"""LoRA on the vLLM engine: what vLLM accepts (ranks, architectures), the exact adapter a training sync may push,
and the adapter folders the engine hands to vLLM (:class:`arpo_algo.rollout.engines.vllm.engine.VLLMEngine`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arpo_base.errors import ArpoError, ConfigError

if TYPE_CHECKING:
    from arpo_algo.models.lora import LoraSettings

ADAPTER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.default\.weight$")
NO_ROOM = (
    "raise the size of /dev/shm (Docker: --shm-size) or free disk space in the temp dir, or set "
    "transport = 'bytes' (the adapter folder then lives in the temp dir)"
)


def lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values the installed vLLM accepts (its ``MaxLoRARanks``)."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks)))


def check_lora_architecture(archs: list[str]) -> None:
    """A ConfigError when vLLM has no LoRA support for the model's architecture (vLLM would fail inside its engine
    process, after the learner loaded); resolved through vLLM's model registry, before vLLM starts."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    # vLLM 0.29 resolves an architecture to its class publicly only from a full ModelConfig (which reads the model
    # and platform); the registry's own lookup by name imports just the model's module
    classes = [c for c in (ModelRegistry._try_load_model_cls(a) for a in archs) if c is not None]
    if classes and not any(supports_lora(c) for c in classes):
        raise ConfigError(
            f"vLLM 0.29 cannot run LoRA adapters on architecture {', '.join(archs)}",
            hint="set rollouts.engine = 'hf' for LoRA on this model (or merge the adapter first: "
            "arpo export --merge, and serve the merged folder)",
        )


def check_adapter_state(
    state_dict: dict[str, Any], lora: LoraSettings, expected: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """The learner's adapter tensors under PEFT's saved names (what vLLM's loader reads), or a ConfigError unless
    they are exactly the engine's adapter: every ``lora_A`` / ``lora_B`` of the target modules, each of its full
    shape (``expected``: :func:`~arpo_algo.models.lora.adapter_shapes` of the engine's base)."""
    from arpo_algo.models.lora import PEFT_PREFIX, check_adapter_tensors

    peft = {}
    for name in state_dict:
        m = LORA_KEY.match(name)
        peft[f"{PEFT_PREFIX}{m['module']}.lora_{m['ab']}.weight" if m else name] = name
    # the learner's names (lora_A.default.weight) in the error; PEFT's saved names to vLLM
    learner_expected = {f"{k[len(PEFT_PREFIX) : -len('.weight')]}.default.weight": v for k, v in expected.items()}
    check_adapter_tensors(
        {name: tuple(t.shape) for name, t in state_dict.items()},
        learner_expected,
        f"the pushed weights are not the engine's adapter (rank {lora.rank}, target modules "
        f"{', '.join(sorted(lora.target_modules))})",
        hint="a LoRA engine takes the learner's adapter tensors only (its rollout_weights())",
    )
    return {peft_name: state_dict[name] for peft_name, name in peft.items()}


@contextlib.contextmanager
def adapter_write(folder: Path) -> Iterator[None]:
    """Around writing an adapter folder: an OSError (a full /dev/shm or disk) becomes an ArpoError with the fix, and
    the half-written folder is removed."""
    try:
        yield
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise ArpoError(f"cannot write the adapter folder {folder}: {e}", hint=NO_ROOM) from None


def write_adapter_config(folder: Path, rank: int, alpha: float, targets: list[str]) -> None:
    """The PEFT config of a plain-LoRA adapter, as :meth:`LoraSettings.peft_config` describes it (only what arpo
    applies: no bias, DoRA, rsLoRA or rank pattern)."""
    from arpo_algo.models.lora import LoraSettings

    config = LoraSettings(enabled=True, rank=int(rank), alpha=float(alpha)).peft_config(tuple(sorted(targets)))
    (folder / "adapter_config.json").write_text(
        json.dumps(config.to_dict(), indent=1, default=sorted), encoding="utf-8"
    )


class Shape:
    """A stand-in tensor that only has a shape (to check a checkpoint folder without loading it)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def check_served_adapter(
    name: str, folder: str | os.PathLike, base_fingerprint: str, linear: dict[str, tuple[int, int]]
) -> tuple[Any, tuple[str, ...]]:
    """An adapter folder to serve: a valid name, complete files, the engine's base (by ``base_fingerprint``), a
    plain-LoRA config and exactly the tensors that config implies on this base (names and shapes, from the
    safetensors header); returns its (settings, targets). No tensor is loaded."""
    from arpo_algo.models.lora import (
        adapter_file_shapes,
        adapter_settings,
        adapter_shapes,
        check_adapter_folder,
        check_adapter_tensors,
    )

    if not ADAPTER_NAME.match(name):
        raise ConfigError(f"adapter name {name!r}: letters, digits and _ only, not starting with a digit")
    path = os.fspath(folder)  # the checks below take a str or Path
    info = check_adapter_folder(path)
    if info["fingerprint"] != base_fingerprint:
        raise ConfigError(
            f"{folder}: the adapter was trained on the base with weights fingerprint "
            f"{info['fingerprint'][:12]}..., not on this engine's base "
            f"({base_fingerprint[:12]}...)",
            hint="serve adapters of another base in their own deployment, or merge it first "
            "(arpo export --merge) and serve the merged folder as a full-weight agent",
        )
    settings, targets = adapter_settings(path)
    # Invariant: vLLM loads an adapter only at its first request, in the engine process that every agent on this
    # base shares; a tensor it cannot place kills that process, and one of another shape may be served wrong.
    # So every tensor is checked against the base here, before vLLM sees the folder.
    check_adapter_tensors(
        adapter_file_shapes(path),
        adapter_shapes(linear, targets, settings.rank),
        f"{folder}: the adapter's tensors do not fit this engine's base (rank {settings.rank}, "
        f"target modules {', '.join(targets)})",
        hint="serve an adapter saved by arpo or PEFT for this base, with the rank and target "
        "modules its adapter_config.json names",
    )
    return settings, targets
