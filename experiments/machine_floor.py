"""What this machine can do, measured in the same minute as a benchmark: GEMM throughput and streaming read
bandwidth (on the benchmark's CPU threads, or on the GPU for a CUDA device, in the benchmark's dtype), and the decode
rate they bound for a model (the *hardware floor* of a step).

A decode step over ``batch`` rows must read every weight once (``weight_bytes / bandwidth`` seconds) and do about
``2 * params * batch`` FLOPs (``/ gemm_flops`` seconds); the floor step time is the larger of the two, which ignores
attention and the KV cache (small for short contexts) and so is a bound no engine can beat.
"""

from __future__ import annotations

import time

import torch


def _best_seconds(fn, repeats: int, device: torch.device) -> float:  # noqa: ANN001
    """The fastest of ``repeats`` calls after one warm-up; on CUDA each call is timed up to its kernels' end."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_flops(n: int | None = None, repeats: int = 5, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an ``n x n`` matrix product in ``dtype`` (best of ``repeats``) on torch's current CPU threads or on
    the GPU (n defaults to 2048 on CPU, 8192 on a GPU: large enough to reach the peak)."""
    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 2048)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b), repeats, dev)


def stream_bytes_per_s(mib: int | None = None, repeats: int = 5, device: str = "cpu") -> float:
    """Read bandwidth in bytes/s: a sum over an fp32 buffer far larger than the caches (512 MiB on CPU, 2 GiB on a
    GPU, whose L2 holds tens of MiB)."""
    dev = torch.device(device)
    mib = mib or (2048 if dev.type == "cuda" else 512)
    x = torch.ones(mib * 2 ** 18, device=dev)
    return x.numel() * 4 / _best_seconds(lambda: x.sum(), repeats, dev)


def probe(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Both probes on ``device`` (GEMM in ``dtype``), as ``{"gemm_gflops", "stream_gbs"}``."""
    return {"gemm_gflops": gemm_flops(device=device, dtype=dtype) / 1e9,
            "stream_gbs": stream_bytes_per_s(device=device) / 1e9}


def floor_tok_s(model: torch.nn.Module, batch: int, machine: dict[str, float]) -> tuple[float, str]:
    """The hardware floor in tokens/s for one decode step over ``batch`` rows, and which limit sets it."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_s = weight_bytes / (machine["stream_gbs"] * 1e9)
    flop_s = 2 * params * batch / (machine["gemm_gflops"] * 1e9)
    return batch / max(read_s, flop_s), ("weight streaming" if read_s >= flop_s else "FLOPs")
