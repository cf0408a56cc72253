"""What this machine can do, measured in the same minute as a benchmark: GEMM throughput and streaming read
bandwidth (on the benchmark's CPU threads, or on the GPU for a CUDA device, in the benchmark's dtype), and the decode
rate they bound for a model (the *hardware floor* of a step).

A decode step over ``batch`` rows must read every weight once (``weight_bytes / bandwidth`` seconds) and do about
``2 * params * batch`` FLOPs (``/ gemm_flops`` seconds); the floor step time is the larger of the two, which ignores
attention and the KV cache (small for short contexts) and so is a bound no engine can beat.

Run as a command, it times the matrix products of a decode step by every route torch offers on the CPU, side by side,
and with ``--step MODEL`` the two parts of a fixed-shape decode step that no engine can skip, each timed alone: all
the model's matrix products at ``--rows`` rows, and one read of the key/value cache a step attends at ``--columns``.
Their sum is what a step would cost if everything else in it (norms, rotary embedding, softmax, sampling, Python)
were free, so the rate it gives bounds any decode path that runs torch's matrix products on this machine (not the
hardware itself: a faster small-batch product than the library's would lower it; the probes above bound that):

    python -m benchmarks.machine_floor --linear 32x576x1536 32x1536x576 --threads 2
    python -m benchmarks.machine_floor --step smollm2-135m-instruct --rows 32 --columns 144 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from arpo_algo.rollout.engines.hf.linear_layout import plain_linears


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


def gemm_flops(
    n: int | None = None, repeats: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of an ``n x n`` matrix product in ``dtype`` (best of ``repeats``) on torch's current CPU threads or on
    the GPU (n defaults to 2048 on CPU, 8192 on a GPU: large enough to reach the peak)."""
    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 2048)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), repeats, dev)


def stream_bytes_per_s(mib: int | None = None, repeats: int = 5, device: str = "cpu") -> float:
    """Read bandwidth in bytes/s: a sum over an fp32 buffer far larger than the caches (512 MiB on CPU, 2 GiB on a
    GPU, whose L2 holds tens of MiB)."""
    dev = torch.device(device)
    mib = mib or (2048 if dev.type == "cuda" else 512)
    x = torch.ones(mib * 2**18, device=dev)
    return x.numel() * 4 / _best_seconds(lambda: x.sum(), repeats, dev)


def probe(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Both probes on ``device`` (GEMM in ``dtype``), as ``{"gemm_gflops", "stream_gbs"}``."""
    return {
        "gemm_gflops": gemm_flops(device=device, dtype=dtype) / 1e9,
        "stream_gbs": stream_bytes_per_s(device=device) / 1e9,
    }


def floor_tok_s(model: torch.nn.Module, batch: int, machine: dict[str, float]) -> tuple[float, str]:
    """The hardware floor in tokens/s for one decode step over ``batch`` rows, and which limit sets it."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_s = weight_bytes / (machine["stream_gbs"] * 1e9)
    flop_s = 2 * params * batch / (machine["gemm_gflops"] * 1e9)
    return batch / max(read_s, flop_s), ("weight streaming" if read_s >= flop_s else "FLOPs")


#: The routes of one linear layer's product: y = x W^T with W of shape [out, in].
ROUTES = ("fp32 mm, transposed copy", "fp32 F.linear", "fp32 oneDNN prepacked", "bf16 F.linear")


def linear_seconds(rows: int, d_in: int, d_out: int, repeats: int = 50) -> dict[str, float]:
    """Seconds of one ``[rows, d_in] x [d_in, d_out]`` product per route (:data:`ROUTES`; best of ``repeats``
    batches of 10 calls, CPU): what a decode step's linear layers can cost at this batch on this machine."""
    dev = torch.device("cpu")
    x, w = torch.randn(rows, d_in), torch.randn(d_out, d_in)
    wt, xb, wb = w.t().contiguous(), x.bfloat16(), w.bfloat16()
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    lin.weight.data = w
    from torch.utils import mkldnn

    packed = mkldnn.to_mkldnn(torch.nn.Sequential(lin))[0]
    calls = {
        "fp32 mm, transposed copy": lambda: torch.mm(x, wt),
        "fp32 F.linear": lambda: torch.nn.functional.linear(x, w),
        "fp32 oneDNN prepacked": lambda: packed(x),
        "bf16 F.linear": lambda: torch.nn.functional.linear(xb, wb),
    }
    with torch.inference_mode():
        return {
            name: _best_seconds(lambda f=f: [f() for _ in range(10)], repeats, dev) / 10 for name, f in calls.items()
        }


def _untimed_products(model: torch.nn.Module) -> list[str]:
    """Modules that run a matrix product in a step but are not plain ``nn.Linear`` (transformers' ``Conv1D``, LoRA or
    quantized subclasses of Linear): a floor that left them out would be too low."""
    plain = {id(m) for m in plain_linears(model)}
    return sorted(
        {
            type(m).__name__
            for m in model.modules()
            if (isinstance(m, torch.nn.Linear) and id(m) not in plain) or type(m).__name__ == "Conv1D"
        }
    )


def step_parts(model: torch.nn.Module, rows: int, columns: int, context: int) -> tuple:
    """The two parts of one decode step over ``rows`` rows and ``columns`` attended columns that no decode path
    skips, as callables on fresh inputs in the model's dtype, and what they read: ``(products, kv_read, info)``.

    ``products()``: every plain ``nn.Linear`` of the model in module order (the language-model head included) at
    ``rows`` rows, as the engine's CPU layout runs them (``mm`` against transposed copies); it returns the products'
    results. Every weight is read once per call, as in a step, so a model larger than the caches streams its weights
    here as it does there. ``kv_read()``: one read (a sum per buffer, returned) of each layer's keys and values over
    the first ``columns`` columns of buffers laid out as the static decode path keeps them (``[rows, kv heads,
    context + 1, head size]``); a 2-byte dtype is summed as 4-byte words over the same bytes, since a 2-byte sum is
    bound by its arithmetic, not by the read. A ValueError for a model whose products are not all in plain
    ``nn.Linear`` layers (its floor would be too low)."""
    untimed = _untimed_products(model)
    if untimed:
        raise ValueError(
            f"it runs matrix products in modules this floor does not time ({', '.join(untimed)}): only "
            f"plain torch.nn.Linear layers are timed, so its floor would be too low"
        )
    cfg = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    layers = plain_linears(model)  # the layers the engine's CPU layout runs as products against transposed copies
    weights = [m.weight.detach().t().contiguous() for m in layers]
    inputs = {w.shape[0]: torch.randn(rows, w.shape[0], dtype=dtype) for w in weights}
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = [torch.ones(rows, heads, context + 1, head_dim, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]
    if dtype.itemsize == 2 and head_dim % 2 == 0:
        kv = [t.view(torch.float32) for t in kv]
    info = {
        "linear_layers": len(layers),
        "weight_bytes": sum(w.numel() * w.element_size() for w in weights),
        "kv_bytes": sum(t[:, :, :columns].numel() * t.element_size() for t in kv),
    }
    return (
        lambda: [torch.mm(inputs[w.shape[0]], w) for w in weights],
        lambda: [t[:, :, :columns].sum() for t in kv],
        info,
    )


def step_parts_seconds(
    model: torch.nn.Module, rows: int, columns: int, context: int, repeats: int = 5
) -> dict[str, float]:
    """:func:`step_parts` timed alone on the CPU (best of ``repeats`` after a warm-up): seconds of ``products`` and of
    ``kv_read``, with the layer count and the bytes each reads."""
    products, kv_read, info = step_parts(model, rows, columns, context)
    dev = torch.device("cpu")
    with torch.inference_mode():
        return {
            "products": _best_seconds(products, repeats, dev),
            "kv_read": _best_seconds(kv_read, repeats, dev),
            **info,
        }


def _step_floor(args: argparse.Namespace) -> dict:
    """``--step``: the step's unskippable parts, printed as a table, and the rate their sum allows."""
    from transformers import AutoModelForCausalLM

    from arpo_algo.models import resolve_model_path
    from arpo_base.errors import ArpoError

    try:
        path = resolve_model_path(args.step)
    except ArpoError as err:  # an unknown model or a missing pull: the message says what to do
        raise SystemExit(str(err)) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
    except (OSError, ValueError) as err:
        raise SystemExit(f"cannot load {args.step} ({path}) as a causal language model: {err}") from None
    try:
        t = step_parts_seconds(model, args.rows, args.columns, args.context)
    except ValueError as err:
        raise SystemExit(f"{args.step}: {err}") from None
    floor = t["products"] + t["kv_read"]
    print(
        f"Decode step of {args.step}: {args.rows} rows, {args.columns} of {args.context} columns, {args.dtype}, "
        f"{args.threads} threads\n"
    )
    print("| part | ms | bytes read |\n|---|---|---|")
    print(
        f"| matrix products ({t['linear_layers']} linear layers, transposed copies) | {t['products'] * 1e3:.1f} | "
        f"{t['weight_bytes'] / 1e6:.0f} MB of weights |"
    )
    print(f"| reading the attended KV cache | {t['kv_read'] * 1e3:.1f} | {t['kv_bytes'] / 1e6:.0f} MB |")
    print(f"| both (everything else free) | {floor * 1e3:.1f} | at most {args.rows / floor:.0f} tok/s |\n", flush=True)
    return {
        "step": args.step,
        "rows": args.rows,
        "columns": args.columns,
        "context": args.context,
        "dtype": args.dtype,
        **t,
        "floor_tok_s": args.rows / floor,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description="The machine's GEMM and bandwidth probes, and a decode step's matrix products by every CPU route"
    )
    ap.add_argument(
        "--linear",
        nargs="+",
        metavar="ROWSxINxOUT",
        help="products to time by every route (default 32x576x1536 when --step is not given)",
    )
    ap.add_argument(
        "--step",
        metavar="MODEL",
        help="a model (name or folder) whose decode step's unskippable parts "
        "to time: all its matrix products and one read of the KV cache",
    )
    ap.add_argument("--rows", type=int, default=32, help="with --step: rows (requests) per step")
    ap.add_argument("--columns", type=int, default=144, help="with --step: KV columns a step attends")
    ap.add_argument(
        "--context",
        type=int,
        default=512,
        help="with --step: columns each slot buffer holds (the engine's static_cache_tokens; at least --columns)",
    )
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="with --step: the weights' dtype"
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if min(args.rows, args.columns, args.threads) < 1:
        ap.error("--rows, --columns and --threads must be at least 1")
    if args.context < args.columns:
        ap.error(f"--context ({args.context}) must hold the --columns a step attends ({args.columns})")
    shapes = []
    for spec in args.linear or ([] if args.step else ["32x576x1536"]):
        parts = spec.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--linear takes ROWSxINxOUT with positive numbers, e.g. 32x576x1536; got {spec!r}")
        shapes.append(tuple(int(p) for p in parts))
    torch.set_num_threads(args.threads)
    results = [_step_floor(args)] if args.step else []
    return results + (_linear_table(shapes, args.threads) if shapes else [])


def _linear_table(shapes: list[tuple[int, int, int]], threads: int) -> list[dict]:
    """``--linear``: the machine's probes, then each product by every route."""
    machine = probe()
    print(
        f"Machine ({threads} threads): float32 GEMM {machine['gemm_gflops']:.0f} GFLOP/s, streaming read "
        f"{machine['stream_gbs']:.1f} GB/s\n"
    )
    print("| rows x in x out | " + " | ".join(f"{r} ms" for r in ROUTES) + " | bf16 / best fp32 |")
    print("|---|" + "---|" * (len(ROUTES) + 1))
    rows = []
    for n, d_in, d_out in shapes:
        t = linear_seconds(n, d_in, d_out)
        best32 = min(v for k, v in t.items() if k.startswith("fp32"))
        rows.append({"shape": [n, d_in, d_out], **t})
        print(
            f"| {n} x {d_in} x {d_out} | "
            + " | ".join(f"{t[r] * 1e3:.3f}" for r in ROUTES)
            + f" | {best32 / t['bf16 F.linear']:.2f}x faster |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
