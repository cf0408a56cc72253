"""Batched prefill into the static decoder's slots (:class:`~arpo_algo.rollout.engines.static_decode.StaticDecoder`).

The requests that enter free slots together are prefilled in one forward (several when their padded size passes
:data:`PREFILL_TOKENS`) that writes their KV straight into their slots: each row first copies its stored prefix
(``prefix_key``) into its slot, then its remaining tokens are fed left-padded to the longest (so that every row's last
token is the forward's last position and one row of logits per request is computed), at their own positions, under
a mask that lets each token see its own slot's columns up to itself; padding writes no KV and nothing attends to it.
A context that another request of the call already prefilled is copied from that slot (or, across refills, from a
copy kept while identical requests are pending). The result equals per-request prefills up to the summation order
of the batched matrix products.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

#: Token positions (rows x longest suffix, padding included) one batched prefill forward may take; more rows wait for
#: the next forward. Bounds the prefill's activations the way max_batch_size bounds a step's.
PREFILL_TOKENS = 4096


def write_rows(buf: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, states: torch.Tensor) -> None:
    """``buf[row, :, pos[row]] = states[row, :, 0]`` for every row of ``buf`` (``[rows, heads, columns, dim]``);
    ``rows`` is ``arange(len(pos))``, made once per step for all layers.

    On the CPU by indexed assignment: there ``scatter_`` along the columns copies the whole buffer for bf16 (measured
    0.84 ms against 8 us per write at 32 rows x 512 columns, 45% of a bf16 step); fp32 takes the same 9-11 us either
    way. Elsewhere ``scatter_``, the write the GPU modes were measured and captured with. Both write the same values."""
    if buf.device.type == "cpu":
        buf[rows, :, pos] = states[:, :, 0]
    else:
        buf.scatter_(2, pos[:, None, None, None].expand(-1, states.shape[1], 1, states.shape[3]), states)


@functools.cache
def slot_layer_class() -> type:
    """The decode step's transformers cache layer over one slice of the slot buffers (defined once, on first use;
    :mod:`~arpo_algo.rollout.engines.static_decode` uses it, and the prefill layer below extends it)."""
    from transformers.cache_utils import CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        """Writes each row's new key/value (one token per row) at that row's position ``pos[row]``; returns the first
        ``length`` columns. ``rows`` is ``arange(len(pos))``, shared by every layer of a step."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor | None, length: int,
                     rows: torch.Tensor | None = None) -> None:
            super().__init__()
            self.kbuf, self.vbuf, self.pos, self.length, self.rows = keys, values, pos, length, rows
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:  # noqa: ANN001
            pass

        def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            write_rows(self.kbuf, self.rows, self.pos, key_states)
            write_rows(self.vbuf, self.rows, self.pos, value_states)
            return self.kbuf[:, :, :self.length], self.vbuf[:, :, :self.length]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length, 0

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return self.kbuf.shape[2]

    return SlotLayer


@functools.cache
def prefill_layer_class() -> type:
    """The decode step's slot layer, writing a batched prefill's keys/values into the slot buffers instead."""
    class SlotPrefillLayer(slot_layer_class()):
        """Writes the real (not padding) tokens of each row into its slot at their positions; returns, per row, the
        first ``length`` columns of its slot (its reused prefix, then the tokens just written)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, where: tuple, slots: torch.Tensor,
                     length: int) -> None:
            super().__init__(keys, values, None, length)
            self.where, self.slots = where, slots

        def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            row, t, slot, col = self.where
            self.kbuf[slot, :, col] = key_states[row, :, t]
            self.vbuf[slot, :, col] = value_states[row, :, t]
            # columns first: index_select copies, and only the first ``length`` columns are attended
            return (self.kbuf[:, :, :self.length].index_select(0, self.slots),
                    self.vbuf[:, :, :self.length].index_select(0, self.slots))

    return SlotPrefillLayer


def prefill(dec: Any, entering: list, twins: collections.Counter, prefilled: dict) -> torch.Tensor:
    """The KV of every entering row into its slot, and each row's next-token logits ``[rows, vocab]``.

    A row whose context another row of this call already prefilled copies that KV; a row with a stored prefix
    (``prefix_key``) copies it and feeds only the rest. The rows left are fed together, left-padded to their
    longest suffix (so that every row's last token is the forward's last position), in forwards of at most
    :data:`PREFILL_TOKENS` positions; padding writes no KV and no row attends to it."""
    eng = dec.engine
    dec.ensure_buffers_for_model()
    logits: dict[int, torch.Tensor] = {}
    feed = []  # (entering index, slot, row, reused prefix length)
    first: dict[tuple[int, ...], int] = {}  # context -> entering index that prefills it in this round
    for j, (b, row) in enumerate(entering):
        ctx = tuple(row.req.token_ids)
        twins[ctx] -= 1
        row.fed = len(ctx)
        if ctx in prefilled or ctx in first:
            eng._stats["reused_tokens"] += len(ctx)
            eng._stats["shared_prefills"] += 1
            continue
        m, entry = eng._store.lookup(row.req.prefix_key, row.req.token_ids)
        if entry is not None and m > 0:
            for buf, src in zip(dec.keys + dec.values, entry.keys + entry.values):
                buf[b, :, :m].copy_(src[0, :, :m])
        else:
            m = 0
        eng._stats["prefill_tokens"] += len(ctx) - m
        eng._stats["reused_tokens"] += m
        first[ctx] = j
        feed.append((j, b, row, m))
    feed.sort(key=lambda f: len(f[2].req.token_ids) - f[3])
    while feed:
        group = [feed.pop(0)]
        while feed and (len(group) + 1) * (len(feed[0][2].req.token_ids) - feed[0][3]) <= PREFILL_TOKENS:
            group.append(feed.pop(0))
        for j, out in zip([g[0] for g in group], _forward(dec, group)):
            logits[j] = out
    for j, (b, row) in enumerate(entering):  # the shared contexts, from this round or an earlier one
        ctx = tuple(row.req.token_ids)
        if j in logits:
            if twins[ctx] > 0:  # identical requests still pending: keep this prefill for them
                n = len(ctx)
                prefilled[ctx] = ([k[b:b + 1, :, :n].clone() for k in dec.keys],
                                  [v[b:b + 1, :, :n].clone() for v in dec.values], logits[j])
            continue
        src = first.get(ctx)
        if src is not None:
            sb = entering[src][0]
            for buf in dec.keys + dec.values:
                buf[b, :, :row.fed].copy_(buf[sb, :, :row.fed])
            logits[j] = logits[src]
        else:
            k1, v1, lg = prefilled[ctx]
            for buf, src_kv in zip(dec.keys + dec.values, k1 + v1):
                buf[b, :, :row.fed].copy_(src_kv[0])
            logits[j] = lg
    for ctx in [c for c in prefilled if twins[c] <= 0]:  # no identical request left to serve
        del prefilled[ctx]
    return torch.stack([logits[j] for j in range(len(entering))])

def _forward(dec: Any, group: list) -> torch.Tensor:
    """One batched forward over ``group`` = [(entering index, slot, row, reused prefix)]: left-padded suffixes,
    each token at its own position; its KV goes into the row's slot. The last position's logits per row."""
    eng = dec.engine
    dev = eng.device
    suffix = [row.req.token_ids[m:] for _, _, row, m in group]
    width = max(len(x) for x in suffix)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    pos = torch.zeros(len(group), width, dtype=torch.long)
    where: list[list[int]] = [[], [], [], []]  # row, column of the forward; slot, column of the slot
    for r, ((_, b, _, m), toks) in enumerate(zip(group, suffix)):
        pad = width - len(toks)
        ids[r, pad:] = torch.tensor(toks, dtype=torch.long)
        pos[r, pad:] = torch.arange(m, m + len(toks))
        for w, x in zip(where, ([r] * len(toks), range(pad, width), [b] * len(toks), range(m, m + len(toks)))):
            w.extend(x)
    length = dec.bucket_columns(max(len(row.req.token_ids) for _, _, row, _ in group))
    real = torch.zeros(len(group), width, dtype=torch.bool)
    for r, toks in enumerate(suffix):
        real[r, width - len(toks):] = True
    ids, pos, real = ids.to(dev), pos.to(dev), real.to(dev)  # the mask is built where attention reads it
    mask = (torch.arange(length, device=dev)[None, None, :] <= pos[:, :, None]) & real[:, :, None]
    mask[:, :, 0] |= ~real  # a padding query attends to column 0 only (never all-masked); its output is unused
    if eng.model.config._attn_implementation == "eager":
        dtype = dec.keys[0].dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill(~mask, torch.finfo(dtype).min)
    slots = torch.tensor([b for _, b, _, _ in group], device=dev)
    idx = tuple(torch.tensor(w, dtype=torch.long, device=dev) for w in where)
    layer = prefill_layer_class()
    from transformers.cache_utils import Cache

    cache = Cache(layers=[layer(k, v, idx, slots, length) for k, v in zip(dec.keys, dec.values)])
    out = eng.model(input_ids=ids, position_ids=pos, attention_mask=mask[:, None], use_cache=True, logits_to_keep=1,
                    **{eng.cache_kw: cache})
    eng._stats["forward_calls"] += 1
    eng._stats["prefill_forwards"] += 1
    return out.logits[:, -1]
