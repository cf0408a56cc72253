"""Which decode path the HF engine takes (``HFEngine(decode=...)``) and whether its static KV cache fits.

``"dynamic"`` is the left-padded growing cache of :mod:`arpo_algo.rollout.engines.hf.engine`; ``"static"``,
``"cuda_graph"`` and ``"compiled"`` are the fixed-shape steps of :mod:`arpo_algo.rollout.engines.hf.static_decode` (the
last through :mod:`arpo_algo.rollout.engines.hf.compiled_step`). Every refusal here is a
:class:`~arpo_base.errors.ConfigError` raised when the engine is built, before any work.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from arpo_algo.rollout.engines.config import captures_graphs
from arpo_base.errors import ConfigError

DECODE_MODES = ("auto", "dynamic", "static", "cuda_graph", "compiled")
#: Whether ``decode="auto"`` picks CUDA graphs on a GPU: on since the graph path passed the engine conformance suite
#: and the GPU equality test on an H200 and decoded 1.7x faster than the dynamic path there (docs/results/speed.md).
AUTO_CUDA_GRAPHS = True
#: The share of the GPU's free memory the static KV cache may take for ``decode="auto"`` to pick CUDA graphs (the
#: rest stays for a colocated learner); above it ``auto`` decodes dynamically, which holds only what the batch uses.
AUTO_GRAPH_MEMORY_SHARE = 0.25

log = logging.getLogger(__name__)


def resolve_decode(
    decode: str,
    device: torch.device,
    model: Any,
    linear_layout: str,
    *,
    slots: int = 1,
    max_positions: int | None = None,
    static_cache_tokens: int | None = None,
) -> str:
    """The decode mode to use, or a ConfigError. ``"auto"`` is ``"cuda_graph"`` on a CUDA device where the model
    allows the fixed-shape step and its static cache (``slots`` x the context) takes at most
    :data:`AUTO_GRAPH_MEMORY_SHARE` of the free GPU memory, else ``"dynamic"`` (the reason is logged); on CPU it is
    ``"dynamic"``. ``"compiled"`` is opt-in: its compile cost (minutes for a small model on 2 cores) is not worth
    paying for short runs."""
    if decode not in DECODE_MODES:
        raise ConfigError(f"unknown decode {decode!r}; choose one of {', '.join(DECODE_MODES)}")
    if decode == "auto":
        if device.type != "cuda" or not AUTO_CUDA_GRAPHS:
            return "dynamic"
        why = auto_graph_problem(model, linear_layout, slots, max_positions, static_cache_tokens)
        if why:
            log.info("decode='auto' decodes dynamically on %s: %s", device, why)
        return "dynamic" if why else "cuda_graph"
    if decode == "cuda_graph" and device.type != "cuda":
        raise ConfigError(
            f"decode='cuda_graph' needs a CUDA device, but the model is on {device}",
            hint="use decode='static' (same fixed-shape step, run eagerly) or 'dynamic' on CPU",
        )
    if decode == "compiled":
        _check_compiled(device)
    problem = (
        static_problem(model, linear_layout, graphs=captures_graphs(decode, device.type))
        if decode != "dynamic"
        else None
    )
    if problem:
        raise ConfigError(f"decode={decode!r}: {problem}", hint="use decode='dynamic' for this model or setting")
    return decode


def _check_compiled(device: torch.device) -> None:
    """``decode="compiled"`` needs inductor's code generation for the device: a C++ compiler, and on CUDA Triton."""
    from arpo_algo.rollout.engines.hf.compiled_step import compiler_problem

    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"decode='compiled' runs on CPU or CUDA, but the model is on {device}",
            hint="use decode='dynamic' on this device",
        )
    problem = compiler_problem(device.type)
    if problem:
        need, other = (
            ("g++ and triton (CXX and CC choose the compilers)", "'cuda_graph'")
            if device.type == "cuda"
            else ("g++ (or set CXX to a C++ compiler)", "'static'")
        )
        raise ConfigError(
            f"decode='compiled' cannot compile for {device.type}: {problem}",
            hint=f"install {need}, or use decode={other}; `arpo doctor` checks the compiler",
        )


def static_problem(model: Any, linear_layout: str, graphs: bool) -> str | None:
    """Why this model cannot use the fixed-shape step (None when it can)."""
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return (
            "the fixed-shape decoders are not validated with LoRA adapters yet (their captured and compiled "
            "steps are not checked to follow adapter updates)"
        )
    if graphs and linear_layout == "transposed":
        return (
            "linear_layout='transposed' copies are rebuilt after every weight update, so captured CUDA graphs "
            "(decode='cuda_graph', and 'compiled' on CUDA) would read freed memory (use linear_layout='native' "
            "or 'auto')"
        )
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    impl = getattr(cfg, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", "eager")
    if impl not in ("sdpa", "eager"):
        return f"the step passes its own 4-D mask, which needs attn_implementation 'sdpa' or 'eager', not {impl!r}"
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"only full-attention layers are supported; this model has {sorted(kinds)}"
    return None


def static_context(max_positions: int | None, requested: int | None) -> int:
    """Columns per slot: ``requested`` (at most the model's maximum) or the model's maximum."""
    if requested is not None and requested < 2:
        raise ConfigError(f"static_cache_tokens must be >= 2, got {requested}")
    if requested is None and max_positions is None:
        raise ConfigError(
            "the model declares no max_position_embeddings, so the static KV cache has no size",
            hint="pass static_cache_tokens=<tokens per sequence>",
        )
    return min(x for x in (requested, max_positions) if x is not None)


def kv_bytes(model: Any, slots: int, context: int) -> int:
    """Bytes of the static KV buffers for this model (from its config)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * slots * kv_heads * context * head_dim * elem


def available_ram() -> int | None:
    """Bytes of RAM the kernel reports available now (``MemAvailable``); None where there is no ``/proc/meminfo``."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def allocated(buf: torch.Tensor | None) -> torch.Tensor:
    """One of the static decoder's slot buffers, which exist from the first prefill of a ``generate`` call on: every
    refill, step and capture runs after it."""
    assert buf is not None, "the static decoder's slot buffers are used before the first prefill allocated them"
    return buf


def check_memory(model: Any, slots: int, context: int) -> None:
    """Refuse a static cache larger than the memory free now (the GPU's, or the machine's RAM on CPU), before any work
    starts: the buffers are allocated whole at the first call, so one that does not fit would otherwise fail (or be
    killed by the OS) in the middle of a run."""
    device = next(model.parameters()).device
    need = kv_bytes(model, slots, context)
    free: int | None  # None: the machine does not report its free RAM
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], str(device)
    else:
        free, where = available_ram(), "this machine"
    if free is not None and need > free:
        raise ConfigError(
            f"the static KV cache needs {need / 2**30:.1f} GiB ({slots} slots x {context} tokens) but "
            f"{where} has {free / 2**30:.1f} GiB free",
            hint="lower max_batch_size or static_cache_tokens (tokens per sequence; the default is the "
            "model's whole context), or use decode='dynamic'",
        )


def auto_graph_problem(
    model: Any, linear_layout: str, slots: int, max_positions: int | None, static_cache_tokens: int | None
) -> str | None:
    """Why ``decode="auto"`` does not pick CUDA graphs for this model and engine size (None when it does)."""
    problem = static_problem(model, linear_layout, graphs=True)
    if problem:
        return problem
    if static_cache_tokens is None and max_positions is None:
        return "the model declares no max_position_embeddings, so a static cache has no size"
    context = static_context(max_positions, static_cache_tokens)  # the columns the static decoder would allocate
    need, free = kv_bytes(model, slots, context), torch.cuda.mem_get_info(next(model.parameters()).device)[0]
    return graph_memory_problem(need, free)


def graph_memory_problem(need: int, free: int) -> str | None:
    """Why a static cache of ``need`` bytes is too large for ``decode="auto"`` with ``free`` bytes free (or None)."""
    if need <= AUTO_GRAPH_MEMORY_SHARE * free:
        return None
    return (
        f"its static KV cache would take {need / 2**30:.1f} GiB, more than {AUTO_GRAPH_MEMORY_SHARE:.0%} of the "
        f"{free / 2**30:.1f} GiB free (lower static_cache_tokens or max_batch_size, or ask for "
        "decode='cuda_graph')"
    )
