"""The static decode step compiled with ``torch.compile`` (``HFEngine(decode="compiled")``).

The step is :meth:`~arpo_algo.rollout.engines.hf.static_decode.StaticDecoder._body` unchanged: one token per slot over
the per-slot KV buffers, sampling on the device, the slots' state advanced in place. Compiling it with inductor
fuses the dozens of small eager kernels of each layer (norms, rotary embedding, activations, sampling) into a few
generated C++ loops; the matrix products stay library calls. The calls themselves (about 400 per step) are made from
a generated C++ wrapper (inductor's ``cpp_wrapper``), not from Python: 6-11% off a SmolLM2 step at batch 32.
Whatever the step writes lives in buffers kept across steps (the KV slots, the state, on the CPU the draw's running
sum), which inductor updates in place: a graph that returned its large results instead allocated them afresh every
step, and also copied every KV buffer around its one-column write (measured: 7.7 ms per layer).

Weights are graph inputs, never constants: dynamo lifts the parameters (and the transposed-layout copies, which are
rebuilt as new tensors of the same shape after a weight update, see :mod:`~arpo_algo.rollout.engines.hf.linear_layout`)
as inputs of the compiled graph and guards only on their shape, dtype and strides. A learner update in place
(``optimizer.step``, ``load_state_dict``) changes their values, not those properties, so the next step reads the new
weights with no recompile. Inductor's freezing (which would bake the weights in as constants) is never turned on here.

Shapes are bounded: every compiled step runs all ``max_batch_size`` rows (idle slots compute a throw-away token)
and is compiled with symbolic sizes (``dynamic=True``), so one graph serves every column count up to the context (the
slot buffers keep one spare column so that no step slices a buffer to its full length, which dynamo would specialise
on): a step attends over the columns its longest row needs, as the eager step does, instead of a bucket up to twice
that (attention reads the cache, so it costs what it reads). A graph is compiled per sampling shape that changes the
step's code (greedy rows, top-k, top-p or top logprobs switched on or off); with the one shape a rollout uses, an
engine compiles one graph. Each compile is timed and counted in the engine's stats (``compiles``,
``compile_seconds``). Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) makes a later process's compiles cheaper;
on the CPU it is keyed on the vector width too (:func:`cpu_vector_bits`), so machines with different vector widths
(AVX2, AVX-512) can share it.

On CUDA the same compiled step (its fused kernels written in Triton) is captured as CUDA graphs, as
``decode="cuda_graph"`` captures the eager step: all slots, one graph per column bucket (doubling sizes), each captured
after the compiled function has run (and compiled) outside the capture. Compiling fuses the step's small kernels (about
850 per eager step on an H200, most of its time); the graph removes the launches. Graph replays read the weights at
their addresses, so in-place updates reach them as they reach the compiled function; a weight that moved drops the
graphs (not the compiled function), and the next step captures them again.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Graphs one compiled function may hold (sampling shapes, and the two layouts of the linear weights) before dynamo
#: would stop compiling it and run it eagerly; above the torch default of 8 so that a few sampling shapes per engine
#: stay compiled.
RECOMPILE_LIMIT = 32


def triton_problem() -> str | None:
    """Why inductor cannot write CUDA kernels here (None when Triton can use the GPU)."""
    from torch.utils._triton import has_triton

    if not has_triton():
        return "Triton is not installed or cannot use this GPU (inductor writes its CUDA kernels in Triton)"
    return None


def compiler_problem(device_type: str = "cpu") -> str | None:
    """Why inductor cannot generate code for ``device_type`` here (None when it can): on every device a C/C++
    compiler that runs (inductor's CPU code and wrapper; on CUDA, Triton builds its kernel launcher with one), and on
    CUDA also Triton (:func:`triton_problem`), which writes the GPU kernels."""
    if device_type == "cuda" and (problem := triton_problem()):
        return problem
    from torch._inductor import config

    tried = [c for c in (config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)) if c]
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
    except Exception:  # noqa: BLE001 - any failure to find or run a compiler is the answer
        return f"no working C++ compiler found (tried {', '.join(map(repr, tried))}; CXX chooses it)"
    if not (os.path.isabs(cxx) and os.access(cxx, os.X_OK)) and shutil.which(cxx) is None:
        return f"the C++ compiler {cxx!r} is not on PATH"
    return None


def cpu_vector_bits() -> int:
    """The vector width (bits) inductor writes its CPU loops for in this process: that of the widest instruction set
    the CPU and ``ATEN_CPU_CAPABILITY`` allow (0 where inductor writes no vector code).

    Passed to every CPU compile as ``cpp.simdlen`` (which then picks the same instruction set) so that it is part of
    inductor's cache key: the key leaves the CPU's instruction set out, while the build of a cached graph's C++ uses
    the present one, so without it a process on an AVX2 CPU (or under ``ATEN_CPU_CAPABILITY=avx2``) that shares
    ``TORCHINDUCTOR_CACHE_DIR`` with an AVX-512 one loads loops written 16 floats wide, builds them for 8-float
    vectors, and computes wrong numbers or hangs (seen for the sampling kernel of SmolLM2's step)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return pick_vec_isa().bit_width()  # 0 for inductor's "no vector ISA"


class CompiledStep:
    """One ``torch.compile`` of a step function, with the compiles it triggered timed and counted.

    A compile is whatever makes dynamo build a new graph (counted from its own ``unique_graphs`` counter, so a
    recompile after a guard failed, e.g. for another sampling shape or the other weight layout, is counted and timed
    too, and a call that reuses a graph is not).

    Args:
        body: The step ``body(rows, length, shape, res)`` (tensor ops only, reads and writes its owner's buffers);
            ``length`` (the columns attended) is symbolic in the compiled graph.
        stats: The engine's counters, which get ``compiles`` and ``compile_seconds``.
        device_type: Where the step runs. On CPU the kernels are called from a generated C++ wrapper; on CUDA from
            inductor's Python wrapper, since the decoder captures the compiled step as CUDA graphs, whose replay
            makes no calls from the host at all.
    """

    def __init__(self, body: Callable[..., None], stats: Any, device_type: str = "cpu") -> None:
        cpu = device_type == "cpu"
        options: dict[str, Any] = (
            {"cpp_wrapper": True, "cpp.simdlen": cpu_vector_bits()} if cpu else {"cpp_wrapper": False}
        )
        self._fn = torch.compile(body, backend="inductor", dynamic=True, fullgraph=True, options=options)
        self._stats = stats
        #: Seconds of each call that compiled (compile plus one step), by that call's ``(rows, length, shape)``.
        self.compile_seconds: dict[tuple, float] = {}

    def __call__(self, rows: int, length: int, shape: Any, res: torch.Tensor) -> None:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            self._fn(rows, length, shape, res)
        new = counters["stats"]["unique_graphs"] - graphs
        if not new:
            return
        seconds = time.perf_counter() - t0
        key = (rows, length, shape)
        self.compile_seconds[key] = self.compile_seconds.get(key, 0.0) + seconds
        self._stats["compiles"] += new
        self._stats["compile_seconds"] += seconds
        log.info("compiled the decode step for %d rows, %d columns (%s) in %.1f s", rows, length, shape, seconds)
