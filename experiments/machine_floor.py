"""What this machine can do, measured in the same minute as a benchmark: fp32 GEMM throughput and streaming read
bandwidth on the benchmark's threads, and the decode rate they bound for a model (the *hardware floor* of a step).

A decode step over ``batch`` rows must read every weight once (``weight_bytes / bandwidth`` seconds) and do about
``2 * params * batch`` FLOPs (``/ gemm_flops`` seconds); the floor step time is the larger of the two, which ignores
attention and the KV cache (small for short contexts) and so is a bound no engine can beat.
"""

from __future__ import annotations

import time

import torch


def _best_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an fp32 ``n x n`` matrix product (best of ``repeats``) on torch's current threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b), repeats)


def stream_bytes_per_s(mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a sum over a ``mib`` MiB fp32 buffer (far larger than the caches)."""
    x = torch.ones(mib * 2 ** 18)
    return x.numel() * 4 / _best_seconds(lambda: x.sum(), repeats)


def probe() -> dict[str, float]:
    """Both probes, as ``{"gemm_gflops", "stream_gbs"}``."""
    return {"gemm_gflops": gemm_flops() / 1e9, "stream_gbs": stream_bytes_per_s() / 1e9}


def floor_tok_s(model: torch.nn.Module, batch: int, machine: dict[str, float]) -> tuple[float, str]:
    """The hardware floor in tokens/s for one decode step over ``batch`` rows, and which limit sets it."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_s = weight_bytes / (machine["stream_gbs"] * 1e9)
    flop_s = 2 * params * batch / (machine["gemm_gflops"] * 1e9)
    return batch / max(read_s, flop_s), ("weight streaming" if read_s >= flop_s else "FLOPs")
