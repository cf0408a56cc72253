"""The learner's device-dependent choices: compute precision, tree attention kernel, and the deterministic switch.

The config names what the user wants (``"auto"`` allowed); :class:`~arpo_algo.train.learner.Learner` resolves it here
against the device it runs on, once, before the model is loaded, so a choice the device cannot honour fails with a
:class:`ConfigError` before any work starts.

* **Precision.** ``"auto"``: bf16 autocast on a CUDA GPU with native bfloat16 (compute capability 8.0+: A100, H100,
  ...), fp32 everywhere else, CPU included (fp32 stays the CPU default the tests pin). ``"bf16"`` on a GPU without
  native bfloat16 is refused (torch would emulate it, slowly); on CPU it is allowed (CPU autocast to bfloat16).
  In every case the weights, gradients and AdamW state stay fp32: autocast only runs matmuls and attention in bf16.
  Whether a CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX) is detected by :func:`cpu_capability`,
  shown by ``arpo doctor`` and recorded in every run folder with the resolved precision (:func:`compute_record`); it
  does not change what ``"auto"`` picks. ``"native"`` (the quickstart's choice) follows it: bf16 autocast where the
  device multiplies bf16 matrices in hardware (such a CPU or GPU), fp32 elsewhere.
* **Tree attention.** ``"auto"``: FlexAttention on CUDA when the model uses SDPA and ``deterministic`` is off, the
  dense mask otherwise. ``"flex"`` on CPU is refused: torch 2.13's FlexAttention has no backward pass on CPU.
* **Deterministic.** :func:`make_deterministic` (see there for what it covers).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from arpo_base.errors import ConfigError

__all__ = [
    "BF16_CPU_FLAGS",
    "PRECISIONS",
    "TREE_ATTENTIONS",
    "bf16_capability",
    "compute_record",
    "cpu_capability",
    "make_deterministic",
    "resolve_precision",
    "resolve_tree_attention",
]

#: ``training.precision`` values.
PRECISIONS = ("auto", "fp32", "bf16", "native")
#: ``training.tree_attention`` values.
TREE_ATTENTIONS = ("auto", "dense", "flex")
#: CPU flags of hardware bfloat16 matrix products: AVX512-BF16's dot-product instructions, AMX's bf16 tiles.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
#: The cuBLAS workspace settings NVIDIA documents as deterministic.
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def _native_bf16() -> bool:
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def resolve_precision(precision: str, device: torch.device, cpu: dict[str, Any] | None = None) -> str:
    """``"fp32"`` or ``"bf16"``: the compute precision the learner uses on ``device``.

    ``"native"`` is bf16 exactly where the device multiplies bfloat16 matrices in hardware (a CUDA GPU with native
    bfloat16; a CPU with one of :data:`BF16_CPU_FLAGS`, read from ``cpu``, a :func:`bf16_capability` record, this
    machine's by default) and fp32 elsewhere, so it never runs bf16 in software emulation.

    Raises:
        ConfigError: ``"bf16"`` on a CUDA device without native bfloat16, or an unknown value.
    """
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r} is not one of {', '.join(map(repr, PRECISIONS))}",
            hint="'native' picks bf16 where the hardware multiplies bf16 matrices, fp32 elsewhere",
        )
    on_gpu = device.type == "cuda"
    if precision == "auto":
        return "bf16" if on_gpu and _native_bf16() else "fp32"
    if precision == "native":
        if on_gpu:
            return "bf16" if _native_bf16() else "fp32"
        return "bf16" if (cpu if cpu is not None else cpu_capability())["native_bf16_matmul"] else "fp32"
    if precision == "bf16" and on_gpu and not _native_bf16():
        raise ConfigError(
            "precision='bf16' but this GPU has no native bfloat16 "
            "(torch.cuda.is_bf16_supported(including_emulation=False) is False; it needs compute "
            "capability 8.0 or newer)",
            hint="use precision='fp32' (or 'auto' or 'native', which pick fp32 on this GPU)",
        )
    return precision


def bf16_capability(flags: set[str] | None) -> dict[str, Any]:
    """What a CPU with ``flags`` (None: unreadable) offers the learner's compute precision: ``flags_known``,
    ``flags`` (those of the reported ``CPU_FLAGS`` it has) and ``native_bf16_matmul`` (one of
    :data:`BF16_CPU_FLAGS` is present; False where the flags are unknown, so nothing counts on an unseen flag)."""
    from arpo_algo.rollout.engines.vllm.support import cpu_features

    present = cpu_features(flags or set())
    return {
        "flags_known": flags is not None,
        "flags": [name for name, on in present.items() if on],
        "native_bf16_matmul": any(present[name] for name in BF16_CPU_FLAGS),
    }


def cpu_capability() -> dict[str, Any]:
    """:func:`bf16_capability` of this machine's CPU (its flags read from Linux's /proc/cpuinfo)."""
    from arpo_algo.rollout.engines.vllm.support import read_cpu_flags

    return bf16_capability(read_cpu_flags())


def compute_record(precision: str, device: str | torch.device, setting: dict[str, Any]) -> dict[str, Any]:
    """What a run folder records of its compute: the resolved ``precision`` ("fp32"/"bf16"), the ``setting`` it came
    from (name and value), the device and the CPU's capability (:func:`cpu_capability`)."""
    return {"precision": precision, "setting": setting, "device": str(device), "cpu": cpu_capability()}


def resolve_tree_attention(choice: str, device: torch.device, *, attn_implementation: str, deterministic: bool) -> str:
    """``"dense"`` or ``"flex"``: how the packed tree is attended on ``device``.

    Raises:
        ConfigError: ``"flex"`` on a device other than CUDA, or an unknown value.
    """
    if choice not in TREE_ATTENTIONS:
        raise ConfigError(f"learner.tree_attention={choice!r} is not one of {', '.join(map(repr, TREE_ATTENTIONS))}")
    if choice == "flex" and device.type != "cuda":
        raise ConfigError(
            f"learner.tree_attention='flex' on device {device.type!r}: FlexAttention has no backward "
            f"pass there in torch {torch.__version__.split('+')[0]}",
            hint="use tree_attention='dense' (or 'auto', which picks dense off CUDA)",
        )
    if choice == "auto":
        return "flex" if device.type == "cuda" and attn_implementation == "sdpa" and not deterministic else "dense"
    return choice


def make_deterministic() -> None:
    """Ask torch for deterministic kernels in this process (process-wide, and not undone).

    Sets ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic kernel then raises instead of
    running a non-deterministic one), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when it is unset (cuBLAS reads it when its
    workspace is first created, so set it in the environment yourself if CUDA matmuls ran before the learner was
    built), and cuDNN's ``deterministic=True, benchmark=False``. Not covered: rollout actors and vLLM (other
    processes), results across GPU models, drivers or torch versions, and tool calls whose outcome depends on time.

    Raises:
        ConfigError: ``CUBLAS_WORKSPACE_CONFIG`` is set to a value that does not make cuBLAS deterministic.
    """
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = _CUBLAS_DETERMINISTIC[0]
    elif current not in _CUBLAS_DETERMINISTIC:
        raise ConfigError(
            f"learner.deterministic=True but CUBLAS_WORKSPACE_CONFIG={current!r}, which leaves cuBLAS "
            "non-deterministic",
            hint=f"unset it or set it to {' or '.join(_CUBLAS_DETERMINISTIC)}",
        )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing on a transformers model, which passes the 4D tree mask through like any
    other tensor argument (the tests check the gradients against the unchecked model). transformers renamed the
    method from ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` within 5.x; both names are
    served so that every 5.x release the package allows works (the older name warns on the newer releases)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
