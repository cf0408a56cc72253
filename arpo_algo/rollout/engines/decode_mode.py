"""Which decode path the HF engine takes (``HFEngine(decode=...)``) and whether its static KV cache fits.

``"dynamic"`` is the left-padded growing cache of :mod:`arpo_algo.rollout.engines.hf`; ``"static"``,
``"cuda_graph"`` and ``"compiled"`` are the fixed-shape steps of :mod:`arpo_algo.rollout.engines.static_decode` (the
last through :mod:`arpo_algo.rollout.engines.compiled_step`). Every refusal here is a
:class:`~arpo_base.errors.ConfigError` raised when the engine is built, before any work.
"""

from __future__ import annotations

from typing import Any

import torch

from arpo_base.errors import ConfigError

DECODE_MODES = ("auto", "dynamic", "static", "cuda_graph", "compiled")
#: Whether ``decode="auto"`` picks CUDA graphs on a GPU. Off until the graph path has run on a GPU (see below).
AUTO_CUDA_GRAPHS = False


def resolve_decode(decode: str, device: torch.device, model: Any, linear_layout: str) -> str:
    """The decode mode to use, or a ConfigError. ``"auto"`` is ``"dynamic"`` on every device for now: the CUDA-graph
    path is exact on CPU in its eager form (``"static"``, tested) but has never run on a GPU, so it stays opt-in
    (``decode="cuda_graph"``) until the GPU test (``tests/arpo_algo/rollout/test_static_decode.py -m gpu``) and the
    benchmark have passed on one; then ``auto`` becomes cuda_graph on CUDA (:data:`AUTO_CUDA_GRAPHS`). ``"compiled"``
    is opt-in as well: its compile cost (minutes for a small model on 2 cores) is not worth paying for short runs."""
    if decode not in DECODE_MODES:
        raise ConfigError(f"unknown decode {decode!r}; choose one of {', '.join(DECODE_MODES)}")
    if decode == "auto":
        on_cuda = device.type == "cuda"
        graphs_ok = AUTO_CUDA_GRAPHS and on_cuda and static_problem(model, linear_layout, graphs=True) is None
        return "cuda_graph" if graphs_ok else "dynamic"
    if decode == "cuda_graph" and device.type != "cuda":
        raise ConfigError(f"decode='cuda_graph' needs a CUDA device, but the model is on {device}",
                          hint="use decode='static' (same fixed-shape step, run eagerly) or 'dynamic' on CPU")
    if decode == "compiled":
        _check_compiled(device)
    problem = static_problem(model, linear_layout, graphs=decode == "cuda_graph") if decode != "dynamic" else None
    if problem:
        raise ConfigError(f"decode={decode!r}: {problem}", hint="use decode='dynamic' for this model or setting")
    return decode


def _check_compiled(device: torch.device) -> None:
    """``decode="compiled"`` needs inductor's CPU code generation (a C++ compiler); it has only run on CPU."""
    from arpo_algo.rollout.engines.compiled_step import compiler_problem

    if device.type != "cpu":
        raise ConfigError(f"decode='compiled' has only been validated on CPU, but the model is on {device}",
                          hint="use decode='cuda_graph' or 'dynamic' on a GPU")
    problem = compiler_problem()
    if problem:
        raise ConfigError(f"decode='compiled' needs a working C++ compiler for torch inductor: {problem}",
                          hint="install g++ (or set CXX to a C++ compiler), or use decode='static'; "
                               "`arpo doctor` checks the compiler")


def static_problem(model: Any, linear_layout: str, graphs: bool) -> str | None:
    """Why this model cannot use the fixed-shape step (None when it can)."""
    if graphs and linear_layout == "transposed":
        return ("linear_layout='transposed' copies are rebuilt after every weight update, so captured graphs would "
                "read freed memory (use linear_layout='native' or 'auto')")
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
        raise ConfigError("the model declares no max_position_embeddings, so the static KV cache has no size",
                          hint="pass static_cache_tokens=<tokens per sequence>")
    return min(x for x in (requested, max_positions) if x is not None)


def kv_bytes(model: Any, slots: int, context: int) -> int:
    """Bytes of the static KV buffers for this model (from its config)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * slots * kv_heads * context * head_dim * elem


def check_memory(model: Any, slots: int, context: int) -> None:
    """On CUDA, refuse a static cache larger than the free device memory (before any work starts)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return
    need, free = kv_bytes(model, slots, context), torch.cuda.mem_get_info(device)[0]
    if need > free:
        raise ConfigError(f"the static KV cache needs {need / 2**30:.1f} GiB ({slots} slots x {context} tokens) but "
                          f"{device} has {free / 2**30:.1f} GiB free",
                          hint="lower max_batch_size or static_cache_tokens, or use decode='dynamic'")
