"""Decode-friendly weight layout for ``nn.Linear`` layers on CPU.

``nn.Linear`` stores its weight as ``(out_features, in_features)`` and computes ``x @ W.T``. For the small row counts
of batched decoding (one token per sequence, 1 to 16 rows), the CPU GEMM kernels behind ``x @ W.T`` are far slower
than on a weight already laid out as ``(in_features, out_features)``: measured with 2 threads on the project's CPU
machine, a 576x576 projection at 8 rows takes 0.25 ms against 0.03 ms, and SmolLM2's 49152x576 output head 18 ms
against 9 ms; in a whole SmolLM2 decoding step the linear layers take about 40% less time
(``python -m benchmarks.bench_engine`` runs the engine with both layouts). The result is the same product up to
floating-point summation order.

:class:`TransposedLinears` keeps such a copy of every plain ``nn.Linear`` weight and, inside :meth:`active`, routes
the layers' forward through it. The copies are rebuilt whenever the caller's weights version changes (a learner
step), and the original forward is always restored on exit, so a module shared with a learner trains normally.
The price is memory: one more copy of the linear weights (about 540 MB for SmolLM2-135M in fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

LINEAR_LAYOUTS = ("auto", "native", "transposed")


def resolve_layout(layout: str, device: torch.device) -> str:
    """``"auto"`` means transposed on CPU (where it pays) and native elsewhere (cuBLAS handles transposes)."""
    if layout == "auto":
        return "transposed" if device.type == "cpu" else "native"
    return layout


def _transposed_forward(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # One mm over all rows: given a non-contiguous batched input (a prefill's last positions, ``x[:, -1:]``),
    # torch.matmul runs a bmm against the weight expanded per row instead, 4.7x slower for the 49152-row head.
    out = torch.mm(x.reshape(-1, x.shape[-1]), weight_t).view(*x.shape[:-1], weight_t.shape[1])
    return out + bias if bias is not None else out


def plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's plain ``nn.Linear`` layers in module order: the ones the transposed layout routes (subclasses, such
    as LoRA or quantized layers, keep their own forward)."""
    return [mod for mod in model.modules() if type(mod) is torch.nn.Linear]


class TransposedLinears:
    """``(in, out)`` copies of a model's ``nn.Linear`` weights, used only inside :meth:`active`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._version: Any = None
        self._layers: list[tuple[torch.nn.Linear, torch.Tensor]] = []

    def _rebuild(self) -> None:
        self.clear()  # free the stale copies first: never two sets of them in memory at once
        self._layers = [(mod, mod.weight.detach().t().contiguous()) for mod in plain_linears(self.model)]

    def clear(self) -> None:
        """Free the copies; the next :meth:`active` rebuilds them."""
        self._layers = []
        self._version = None

    @contextlib.contextmanager
    def active(self, version: Any) -> Iterator[None]:
        """Route every plain ``nn.Linear`` of the model through its copy; ``version`` identifies the weights."""
        if version != self._version or not self._layers:
            self._rebuild()
            self._version = version
        patched = []
        try:
            for mod, weight_t in self._layers:
                # an instance attribute shadows Linear.forward on purpose (undone below), which mypy reports
                mod.forward = _bind(weight_t, mod.bias)  # type: ignore[method-assign]
                patched.append(mod)
            yield
        finally:
            for mod in patched:
                del mod.forward


def _bind(weight_t: torch.Tensor, bias: torch.Tensor | None):  # noqa: ANN202
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _transposed_forward(x, weight_t, bias)

    return forward
