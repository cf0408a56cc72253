"""Token choice for the HF engine: the per-row draw of the dynamic path and its batched, fixed-shape twin.

Both compute the same thing (see :mod:`arpo_algo.rollout.engines.hf.engine` for the definitions of logprobs and
entropies):

* greedy rows (``temperature == 0``) take ``argmax`` of the raw logits;
* other rows keep the tokens allowed by ``top_k`` (the k largest logprobs) and then ``top_p`` (the smallest prefix
  of the probability-sorted tokens that reaches ``top_p`` of the kept mass), and draw by inverse CDF with one uniform
  number from the request's own generator, so batch composition cannot change which number a row gets.

:func:`choose_token` does it for one row with Python-level branches (the dynamic path). :func:`sample_rows` does it for
a whole batch with tensor ops only: no host synchronisation and no data-dependent shapes, so it can be captured in a
CUDA graph with the decode step (:mod:`arpo_algo.rollout.engines.hf.static_decode`). What varies per row (temperature,
top-k, top-p, the uniform) comes in as tensors; what fixes the shapes comes in as :class:`SampleShape`. The two are
the same arithmetic, so on CPU the static path reproduces the dynamic path's tokens (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REFERENCE_TOPK = 10  # the reference code asks vLLM for 10 logprobs per token (docs/concepts/arpo.md#segment-entropy)


@torch.library.custom_op("arpo::row_cumsum", mutates_args=())
def _row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """The running sum along the last dimension, as an operator torch.compile cannot see into."""
    return torch.cumsum(x, -1)


@_row_cumsum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, as cumsum's result


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum(x, -1)``; traced by torch.compile on CUDA, through an opaque operator, so that the compiled step
    runs the library's scan (the kernel the eager and graph-captured steps run) instead of generating one: inductor's
    Triton split scan fails to generate code for a ``[rows, 49152]`` scan with a symbolic row count (seen with torch
    2.11). Eager calls take the plain function (no custom-operator dispatch)."""
    if x.is_cuda and torch.compiler.is_compiling():
        return _row_cumsum(x)
    return torch.cumsum(x, -1)


def choose_token(
    logits: torch.Tensor,
    logp: torch.Tensor,
    probs: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    gen: torch.Generator,
) -> int:
    """One row's token: ``logits``, ``logp`` and ``probs`` are that row's ``[vocab]`` vectors (``logp`` tempered)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    if 0 < top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k).values[-1]
        probs = torch.where(logp >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sp, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sp, 0) - sp  # mass strictly before each token; keep until top_p is reached
        sp = torch.where(before < top_p * sp.sum(), sp, torch.zeros_like(sp))
        probs = torch.zeros_like(probs).scatter(0, order, sp)
    # Inverse-CDF draw with the row's own generator: batch composition cannot change which uniform it gets.
    cdf = torch.cumsum(probs.double(), 0)
    u = torch.rand((), generator=gen, dtype=torch.float64).to(cdf.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp(max=cdf.shape[0] - 1))


@dataclass(frozen=True)
class SampleShape:
    """What fixes the shapes of :func:`sample_rows` (one CUDA graph per distinct value).

    Attributes:
        logprobs_k: Top logprobs returned per row (the largest ``logprobs_topk`` of the call; 0 = none).
        top_k_max: The largest top-k filter of the call's rows (0 = no row filters by top-k).
        top_p: Whether any row of the call uses nucleus filtering (a full sort per row when it does).
        greedy: Whether any row of the call is greedy (the argmax over the vocabulary is taken only then).
    """

    logprobs_k: int = 0
    top_k_max: int = 0
    top_p: bool = False
    greedy: bool = False


@dataclass
class RowParams:
    """Per-row sampling settings as tensors of shape ``[rows]`` (all on the logits' device).

    Attributes:
        temperature: float32; the softmax temperature (1.0 for greedy rows, as in the dynamic path).
        greedy: bool; ``temperature == 0``.
        top_k: int64; the row's top-k, 0 when it does not filter (``top_k`` off or not below the vocabulary).
        top_p: float32; the row's nucleus mass (1.0 = off).
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


def sample_rows(
    logits: torch.Tensor,
    params: RowParams,
    uniforms: torch.Tensor,
    shape: SampleShape,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Choose one token per row and return what the engine records for it, with tensor ops only.

    Args:
        logits: ``[rows, vocab]`` raw next-token logits (any float dtype).
        params: Per-row settings (:class:`RowParams`).
        uniforms: ``[rows]`` float64 in ``[0, 1)``: each row's next number from its own generator (ignored for greedy
            rows).
        shape: The call's :class:`SampleShape`.
        work: Optional float64 buffers ``[rows, vocab]`` (two) that the draw's running sum is written into instead
            of fresh tensors: on the CPU a fresh 8-byte-per-entry tensor per step is paid again in page faults (a
            32 x 49,152 running sum took 4-14 ms inside the decode loop against 0.5 ms into a kept buffer). The
            values are the same either way. The static decoder keeps them on the CPU only.

    Returns:
        ``(tokens [rows] int64, logprobs [rows] float32, entropies [rows] float32, top_values [rows, k] float32,
        top_ids [rows, k] int64)`` with ``k = shape.logprobs_k`` (tempered logprobs over the full vocabulary).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    logp = torch.log_softmax(logits / params.temperature[:, None], dim=-1)
    full = logp.exp()
    entropies = -(full * logp).nan_to_num(0.0).sum(-1)
    probs = full
    if shape.top_k_max > 0:
        vals = torch.topk(logp, min(shape.top_k_max, vocab), dim=-1).values
        idx = (params.top_k.clamp(min=1, max=vals.shape[-1]) - 1)[:, None]
        kth = vals.gather(1, idx)
        drop = (params.top_k > 0)[:, None] & (logp < kth)
        probs = torch.where(drop, torch.zeros_like(probs), probs)
    if shape.top_p:
        sp, order = torch.sort(probs, dim=-1, descending=True)
        before = _cumsum(sp) - sp
        sp = torch.where(before < params.top_p[:, None] * sp.sum(-1, keepdim=True), sp, torch.zeros_like(sp))
        nucleus = torch.zeros_like(probs).scatter(1, order, sp)
        probs = torch.where((params.top_p < 1.0)[:, None], nucleus, probs)  # rows at 1.0 skip it, as choose_token
    # the CDF: a float64 running sum in token order, as in choose_token
    if work is None:
        cdf = _cumsum(probs.double())
    else:
        wide, cdf = work
        wide.copy_(probs)
        torch.cumsum(wide, -1, out=cdf)
    target = (uniforms * cdf[:, -1])[:, None]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=vocab - 1)
    tokens = torch.where(params.greedy, torch.argmax(logits, dim=-1), drawn) if shape.greedy else drawn
    logprobs = logp.gather(1, tokens[:, None])[:, 0]
    if shape.logprobs_k > 0:
        top_values, top_ids = torch.topk(logp, min(shape.logprobs_k, vocab), dim=-1)
    else:
        top_values = logp.new_zeros(logp.shape[0], 0)
        top_ids = tokens.new_zeros(logp.shape[0], 0)
    return tokens, logprobs, entropies, top_values, top_ids
