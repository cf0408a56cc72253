"""Batched prefill into the static decoder's slots (:class:`~arpo_algo.rollout.engines.hf.static_decode.StaticDecoder`).

The requests that enter free slots together are prefilled in batched forwards (rows of similar length together, see
:func:`forward_groups`) that write their KV straight into their slots: each row first copies its stored prefix
(``prefix_key``) into its slot, then its remaining tokens are fed left-padded to the longest (so that every row's last
token is the forward's last position and one row of logits per request is computed), at their own positions, under
a mask that lets each token see its own slot's columns up to itself; padding writes no KV and nothing attends to it.
A context that another request of the call already prefilled is copied from that slot (or, across refills, from a
copy kept while identical requests are pending). Requests without a ``prefix_key`` that share a leading run of at
least :data:`SHARED_PREFIX_MIN` tokens (a system prompt, a task's instructions; :func:`plan_shared_runs`) have that run
prefilled once, into the slot of the first of them to enter, and copied into the others' slots before their own
tokens are fed (from a copy kept while members are still pending, when they enter later). The result equals
per-request prefills up to the summation order of the batched matrix products.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

#: Token positions (rows x longest suffix, padding included) one batched prefill forward may take; more rows wait for
#: the next forward. Bounds the prefill's activations the way max_batch_size bounds a step's.
PREFILL_TOKENS = 4096

#: A batched prefill forward's fixed cost counted in token positions (the per-layer calls around the matrix
#: products): what grouping rows of different lengths into one forward may spend on padding instead.
FORWARD_COST_POSITIONS = 32

#: The shortest leading run of tokens that entering rows share for it to be prefilled once and copied: below it the
#: extra forward costs more than the tokens it saves.
SHARED_PREFIX_MIN = 32


def write_rows(buf: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, states: torch.Tensor) -> None:
    """``buf[row, :, pos[row]] = states[row, :, 0]`` for every row of ``buf`` (``[rows, heads, columns, dim]``);
    ``rows`` is ``arange(len(pos))``, made once per step for all layers.

    By indexed assignment on the CPU and wherever the step is being compiled: eager ``scatter_`` along the columns
    copies the whole buffer on the CPU for bf16 (measured 0.84 ms against 8 us per write at 32 rows x 512 columns,
    45% of a bf16 step; fp32 takes the same 9-11 us either way), and inductor turns ``scatter_`` into an
    out-of-place scatter plus a copy back on every device (on CUDA two passes over each layer's keys and values per
    step), while it writes the indexed assignment in place. Eager on the GPU ``scatter_``, the write the CUDA graph
    mode was measured and captured with. Both write the same values."""
    if buf.device.type == "cpu" or torch.compiler.is_compiling():
        buf[rows, :, pos] = states[:, :, 0]
    else:
        buf.scatter_(2, pos[:, None, None, None].expand(-1, states.shape[1], 1, states.shape[3]), states)


@functools.cache
def slot_layer_class() -> type:
    """The decode step's transformers cache layer over one slice of the slot buffers (defined once, on first use;
    :mod:`~arpo_algo.rollout.engines.hf.static_decode` uses it, and the prefill layer below extends it)."""
    from transformers.cache_utils import CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        """Writes each row's new key/value (one token per row) at that row's position ``pos[row]``; returns the first
        ``length`` columns. ``rows`` is ``arange(len(pos))``, shared by every layer of a step."""

        def __init__(
            self,
            keys: torch.Tensor,
            values: torch.Tensor,
            pos: torch.Tensor | None,
            length: int,
            rows: torch.Tensor | None = None,
        ) -> None:
            super().__init__()
            self.kbuf, self.vbuf, self.pos, self.length, self.rows = keys, values, pos, length, rows
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:  # noqa: ANN001
            pass

        def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            # the decode step builds this layer with its positions and rows; only the prefill layer (which has its own
            # update) leaves them None
            assert self.rows is not None and self.pos is not None
            write_rows(self.kbuf, self.rows, self.pos, key_states)
            write_rows(self.vbuf, self.rows, self.pos, value_states)
            return self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]

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

    base: Any = slot_layer_class()  # a class made at run time (transformers is imported lazily)

    class SlotPrefillLayer(base):
        """Writes the real (not padding) tokens of each row into its slot at their positions; returns, per row, the
        first ``length`` columns of its slot (its reused prefix, then the tokens just written)."""

        def __init__(
            self, keys: torch.Tensor, values: torch.Tensor, where: tuple, slots: torch.Tensor, length: int
        ) -> None:
            super().__init__(keys, values, None, length)
            self.where, self.slots = where, slots

        def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            row, t, slot, col = self.where
            self.kbuf[slot, :, col] = key_states[row, :, t]
            self.vbuf[slot, :, col] = value_states[row, :, t]
            # columns first: index_select copies, and only the first ``length`` columns are attended
            return (
                self.kbuf[:, :, : self.length].index_select(0, self.slots),
                self.vbuf[:, :, : self.length].index_select(0, self.slots),
            )

    return SlotPrefillLayer


def prefill(dec: Any, entering: list, twins: collections.Counter, prefilled: dict, runs: dict) -> torch.Tensor:
    """The KV of every entering row into its slot, and each row's next-token logits ``[rows, vocab]``.

    A row whose context another row of this call already prefilled copies that KV; a row with a stored prefix
    (``prefix_key``) copies it and feeds only the rest; a row with a shared leading run (``runs``, from
    :func:`plan_shared_runs`) gets it once made and feeds only the rest (:func:`_share_prefixes`). The rows left are
    fed left-padded to the longest suffix of their forward (so that every row's last token is the forward's last
    position), in forwards of rows of similar length (:func:`forward_groups`); padding writes no KV and no row
    attends to it."""
    eng = dec.engine
    dec.ensure_buffers_for_model()
    logits: dict[int, torch.Tensor] = {}
    feed = []  # (entering index, slot, context tokens, reused prefix length)
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
            _load_slot(dec, b, entry.keys, entry.values, m)
        else:
            m = 0
        eng._stats["prefill_tokens"] += len(ctx) - m
        eng._stats["reused_tokens"] += m
        first[ctx] = j
        feed.append((j, b, ctx, m))
    feed = _share_prefixes(dec, feed, runs)
    for j, out in _forward_all(dec, feed):
        logits[j] = out
    for j, (b, row) in enumerate(entering):  # the shared contexts, from this round or an earlier one
        ctx = tuple(row.req.token_ids)
        if j in logits:
            if twins[ctx] > 0:  # identical requests still pending: keep this prefill for them
                prefilled[ctx] = (*_save_slot(dec, b, len(ctx)), logits[j])
            continue
        src = first.get(ctx)
        if src is not None:
            _copy_slot(dec, b, entering[src][0], row.fed)
            logits[j] = logits[src]
        else:
            k1, v1, lg = prefilled[ctx]
            _load_slot(dec, b, k1, v1, row.fed)
            logits[j] = lg
    for ctx in [c for c in prefilled if twins[c] <= 0]:  # no identical request left to serve
        del prefilled[ctx]
    return torch.stack([logits[j] for j in range(len(entering))])


def _copy_slot(dec: Any, dst: int, src: int, n: int) -> None:
    """Slot ``dst``'s first ``n`` columns become slot ``src``'s, in every layer."""
    for buf in dec.keys + dec.values:
        buf[dst, :, :n].copy_(buf[src, :, :n])


def _load_slot(dec: Any, b: int, keys: list[torch.Tensor], values: list[torch.Tensor], n: int) -> None:
    """Slot ``b``'s first ``n`` columns become the first ``n`` of a batch-1 KV (``[1, kv_heads, >= n, dim]`` per
    layer)."""
    for buf, src in zip(dec.keys + dec.values, keys + values):
        buf[b, :, :n].copy_(src[0, :, :n])


def _save_slot(dec: Any, b: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A copy of slot ``b``'s first ``n`` columns per layer, kept for rows that enter after the slot is reused."""
    keys, values = dec._slot_kv(b, n)
    return [k.clone() for k in keys], [v.clone() for v in values]


def shared_runs(contexts: list) -> list[tuple[int, list[int]]]:
    """The groups of ``contexts`` (token sequences; None for a row that takes no part) that share a leading run of at
    least :data:`SHARED_PREFIX_MIN` tokens: ``(run length, [indices])`` with two or more rows each. Each row keeps at
    least its last token to feed (its next-token logits come from its own forward).

    The rows are sorted by their tokens, so a group is a range of neighbours whose run is the smallest common prefix
    of neighbouring pairs; the ranges maximise the tokens saved, ``(rows - 1) x run`` summed over the groups (dynamic
    programming over the range ends), so one row that shares little does not cut the run of many that share more."""
    rows = sorted((tuple(c), i) for i, c in enumerate(contexts) if c is not None)
    toks = [r[0] for r in rows]
    n = len(toks)
    common = [0] + [
        next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(toks, toks[1:])
    ]  # common[k]: the prefix rows k-1 and k share
    best = [0] * (n + 1)
    start = list(range(-1, n))  # start[end] = end - 1: the row alone
    runs = [0] * (n + 1)  # runs[end]: the run of the group that ends there
    for end in range(1, n + 1):
        best[end] = best[end - 1]
        run = len(toks[end - 1]) - 1
        for begin in range(end - 2, -1, -1):
            run = min(run, common[begin + 1], len(toks[begin]) - 1)
            if run < SHARED_PREFIX_MIN:
                break
            saved = best[begin] + (end - begin - 1) * run
            if saved > best[end]:
                best[end], start[end], runs[end] = saved, begin, run
    groups = []
    end = n
    while end:
        begin = start[end]
        if end - begin > 1:
            groups.append((runs[end], [rows[k][1] for k in range(begin, end)]))
        end = begin
    return groups[::-1]


class SharedRun:
    """A leading run that several fresh contexts of one call share: its length, its KV once made (per layer
    ``[1, kv_heads, length, head_dim]``, or None), and how many of its contexts are still to be prefilled (the KV is
    dropped after the last)."""

    def __init__(self, length: int, members: int) -> None:
        self.length, self.left = length, members
        self.keys: list[torch.Tensor] | None = None
        self.values: list[torch.Tensor] | None = None

    def used(self) -> None:
        """One member was prefilled on top of the run."""
        self.left -= 1
        if self.left <= 0:
            self.keys = self.values = None


def plan_shared_runs(requests: list) -> dict[tuple[int, ...], SharedRun]:
    """Context -> its :class:`SharedRun`, for the requests of one call that have no ``prefix_key`` (those are fed on
    top of their stored prefix) and tokens to generate, grouped by :func:`shared_runs`; identical contexts count
    once (they share one prefill already)."""
    fresh = list(
        dict.fromkeys(tuple(r.token_ids) for r in requests if r.prefix_key is None and r.params.max_new_tokens > 0)
    )
    plan: dict[tuple[int, ...], SharedRun] = {}
    for run, idx in shared_runs(fresh):
        shared = SharedRun(run, len(idx))
        plan.update((fresh[i], shared) for i in idx)
    return plan


def _share_prefixes(dec: Any, feed: list, runs: dict) -> list:
    """Give every ``feed`` row with a shared run (``runs``, taken out as it is used) the run's KV in its slot: made by
    one forward over the run in the slot of its first row here when nobody made it yet (kept as a copy while other
    members are still pending), else copied from that copy; ``feed`` comes back with each such row's reused length
    raised to its run."""
    here: dict[int, tuple[SharedRun, list[int]]] = {}
    for i, (_, _, ctx, m) in enumerate(feed):
        shared = runs.pop(ctx, None) if m == 0 else None
        if shared is not None:
            here.setdefault(id(shared), (shared, []))[1].append(i)
    if not here:
        return feed
    eng = dec.engine
    new = [(shared, idx) for shared, idx in here.values() if shared.keys is None]
    leaders = [(-1, feed[idx[0]][1], feed[idx[0]][2][: shared.length], 0) for shared, idx in new]
    for _ in _forward_all(dec, leaders):  # their KV lands in the leaders' slots; the logits are not needed
        pass
    lead_slot = {}
    for (shared, idx), (_, b, _, _) in zip(new, leaders):
        lead_slot[id(shared)] = b
        if shared.left > len(idx):  # members still pending: keep the run for them
            shared.keys, shared.values = _save_slot(dec, b, shared.length)
    feed = list(feed)
    for shared, idx in here.values():
        run, lead = shared.length, lead_slot.get(id(shared))
        for i in idx:
            j, b, toks, _ = feed[i]
            if b != lead:
                if lead is not None:
                    _copy_slot(dec, b, lead, run)
                else:
                    # no leader in this call: the run was made by an earlier call and kept for its pending members
                    assert shared.keys is not None and shared.values is not None
                    _load_slot(dec, b, shared.keys, shared.values, run)
                eng._stats["prefill_tokens"] -= run
                eng._stats["reused_tokens"] += run
                eng._stats["shared_prefix_rows"] += 1
            feed[i] = (j, b, toks, run)
            shared.used()
    return feed


def forward_groups(sizes: list[int]) -> list[int]:
    """Where to cut ascending suffix ``sizes`` into batched forwards: the end index of each group of neighbours.

    A group costs its rows times its longest suffix (padding included) plus :data:`FORWARD_COST_POSITIONS`, and holds
    at most :data:`PREFILL_TOKENS` positions unless it is one row; the cuts minimise the total (dynamic programming
    over the cut points), so rows of very different lengths are not padded to the longest."""
    n = len(sizes)
    best = [0.0] + [float("inf")] * n
    start = [0] * (n + 1)
    for end in range(1, n + 1):
        for begin in range(end - 1, -1, -1):
            positions = (end - begin) * sizes[end - 1]
            if positions > PREFILL_TOKENS and end - begin > 1:
                break
            cost = best[begin] + positions + FORWARD_COST_POSITIONS
            if cost < best[end]:
                best[end], start[end] = cost, begin
    ends = []
    while n:
        ends.append(n)
        n = start[n]
    return ends[::-1]


def _forward_all(dec: Any, feed: list):  # noqa: ANN202
    """``(entering index, last-position logits)`` per ``feed`` row, from batched forwards of rows with similar
    suffix lengths (:func:`forward_groups`)."""
    feed = sorted(feed, key=lambda f: len(f[2]) - f[3])
    begin = 0
    for end in forward_groups([len(f[2]) - f[3] for f in feed]):
        group = feed[begin:end]
        begin = end
        yield from zip([g[0] for g in group], _forward(dec, group))


def _forward(dec: Any, group: list) -> torch.Tensor:
    """One batched forward over ``group`` = [(entering index, slot, tokens, reused prefix)]: left-padded suffixes
    ``tokens[reused:]``, each token at its own position; its KV goes into the row's slot. The last position's logits
    per row."""
    eng = dec.engine
    dev = eng.device
    suffix = [toks[m:] for _, _, toks, m in group]
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
    length = dec.bucket_columns(max(len(toks) for _, _, toks, _ in group))
    real = torch.zeros(len(group), width, dtype=torch.bool)
    for r, toks in enumerate(suffix):
        real[r, width - len(toks) :] = True
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
    out = eng.model(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask[:, None],
        use_cache=True,
        logits_to_keep=1,
        **{eng.cache_kw: cache},
    )
    eng._stats["forward_calls"] += 1
    eng._stats["prefill_forwards"] += 1
    return out.logits[:, -1]
