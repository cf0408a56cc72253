"""The HF engine's fixed-shape decode path: a static per-slot KV cache, optionally replayed as CUDA graphs.

``HFEngine(decode="static")`` and ``decode="cuda_graph"`` decode here instead of through the left-padded dynamic cache
(:mod:`arpo_algo.rollout.engines.hf.kv_cache`). Everything else is the engine's own code: finished rows leave at once
and
pending requests take their slots, and each row's tokens are recorded (logprob, entropy, top logprobs, ``on_token``,
stop strings, per-request budgets) by the same functions as on the dynamic path.

Prefill. The requests that enter free slots together are prefilled in batched forwards that write their KV straight
into their slots (:mod:`~arpo_algo.rollout.engines.hf.slot_prefill`), then each samples its first token. A leading run
that several fresh requests of the call share is prefilled once and copied, within a refill and across refills.

Host work per step. The packed results of a step come to the host once and go into arrays (``Book``); EOS, the
budget and stop strings are decided there with vectorised checks over the step's tokens. Only the rows that may have
ended (an EOS id, the budget reached, or a token that can complete one of their stop strings, see
:mod:`~arpo_algo.rollout.engines.stop_filter`) get per-row Python: their waiting tokens move into their lists (the
same float64 values), and the engine's own finish check runs. ``on_token`` is called for every token, in slot
order, only when it is set.

Layout. Every layer has key and value buffers of shape ``[max_batch_size, kv_heads, context + 1, head_dim]`` (one
spare column, never read: see :mod:`~arpo_algo.rollout.engines.hf.compiled_step`), allocated once; slot ``b`` holds one
request with its tokens at columns ``0 .. fed-1`` (``fed`` = tokens whose KV is cached = the position id of the next
token to feed). A decode step feeds one token per slot at its own position: each layer
writes the new key/value into column ``pos[b]`` (a scatter), attends over the first ``length`` columns under the mask
``column <= pos[b]``, and :func:`~arpo_algo.rollout.engines.sampling.sample_rows` picks the next tokens. The per-slot
state (last token, position, uniform index, active flag, sampling settings) lives in one device tensor that the step
reads and advances in place, so a step takes no host input: the host only writes a slot when a request enters or
leaves and reads one packed result tensor per step.

Shapes: with ``decode="static"`` a step runs eagerly over the slots up to the highest busy one (requests take the
lowest free slot) and the columns the longest row needs, rounded up to :data:`EAGER_COLUMNS`. With
``decode="cuda_graph"`` they come from two buckets: rows (a power of two covering the highest busy slot) and columns
(64 doubled until it covers the longest row, at most ``context``); each (rows, columns, sampling shape) is captured once
into a ``torch.cuda.CUDAGraph`` (all graphs share one memory pool and write only into the engine's own buffers, so any
replay order is safe) and replayed. Captured graphs hold the addresses of the weights: in-place updates (a learner
step, ``load_state_dict``) keep them valid; if the parameters are re-allocated (moved, re-created) the graphs are
dropped and captured again.

``decode="compiled"`` runs the same step through ``torch.compile`` (:mod:`~arpo_algo.rollout.engines.hf.compiled_step`):
always all slots, the eager step's columns (symbolic in the graph), so a process compiles one graph per sampling shape.
On CUDA that compiled step is then captured as CUDA graphs per column bucket, like ``decode="cuda_graph"``'s.

Not covered: models whose layers are not all full attention (sliding windows, linear attention) and attention
implementations other than "sdpa" and "eager" (the step passes its own 4-D mask); both are a ConfigError.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch

from arpo_algo.rollout.engines.config import captures_graphs
from arpo_algo.rollout.engines.hf import slot_prefill
from arpo_algo.rollout.engines.hf.compiled_step import CompiledStep
from arpo_algo.rollout.engines.hf.decode_mode import allocated, check_memory, static_context
from arpo_algo.rollout.engines.hf.static_book import Book, unpack
from arpo_algo.rollout.engines.sampling import REFERENCE_TOPK, RowParams, SampleShape, sample_rows
from arpo_algo.rollout.engines.stop_filter import StopFilter
from arpo_base.errors import ConfigError

MIN_COLUMNS = 64  # the smallest column bucket
#: The column granularity of an eager or compiled step (not captured): any column count costs nothing extra there (the
#: compiled graph's is symbolic), and attention's time grows with the columns it reads (a 256-column bucket for 200
#: columns of tokens reads 28% more).
EAGER_COLUMNS = 8
# columns of the per-slot state tensor (float64: token ids and positions are exact below 2**53)
TOK, POS, STEP, ACTIVE, TEMP, GREEDY, TOPK, TOPP = range(8)
_IDLE = (0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0)  # a free slot: feeds token 0 at position 0, never advances


def _bucket(need: int, start: int, cap: int) -> int:
    size = start
    while size < need:
        size *= 2
    return min(size, cap)


def _slot_cache(
    keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor, length: int, layer: type
) -> Any:
    """A transformers ``Cache`` over the slot buffers ``[rows, heads, context, dim]`` (one token per row); ``layer``
    is :func:`~arpo_algo.rollout.engines.hf.slot_prefill.slot_layer_class`, looked up outside the step so that a
    compiled step never defines a class."""
    from transformers.cache_utils import Cache

    rows = torch.arange(len(pos), device=pos.device)
    return Cache(layers=[layer(k, v, pos, length, rows) for k, v in zip(keys, values)])


#: The attention implementation a step runs under where the model's is "sdpa" (registered with transformers on first
#: use, see :func:`folded_sdpa`).
FOLDED_SDPA = "arpo_folded_sdpa"


def folded_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' "sdpa" attention for a decode step: one query token per row, with the query heads that share a
    key/value head folded into SDPA's query length (``[rows, kv_heads, groups, dim]``), so the keys and values are
    read as they are stored. transformers folds them this way only outside ``torch.compile``; under it, it repeats
    every key and value head once per query head, a copy of the whole attended cache per layer and step that took
    more time than the step's matrix products on the CPU. Other shapes, masks that differ per head and the options
    only transformers' function knows (softcap, position bias, sinks) go to that function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    per_head_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1
    if (
        query.shape[2] != 1
        or groups == 1
        or per_head_mask
        or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "sinks", "s_aux"))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, heads // groups, groups, dim),
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


@functools.cache
def _folded_sdpa_name() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FOLDED_SDPA, folded_sdpa)
    # the masks "sdpa" gets: a forward under this setting that is given a 2-D padding mask still gets it applied
    AttentionMaskInterface.register(FOLDED_SDPA, sdpa_mask)
    return FOLDED_SDPA


@contextlib.contextmanager
def folded_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's "sdpa" attention as :func:`folded_sdpa` inside the block (the shared model's setting is put
    back on exit, so a learner's forward never sees it); other implementations, and composite models (whose setting
    is spread over sub-configs that may differ), are left as they are."""
    config: Any = model.config  # a transformers config (torch types a module's attributes as Tensor | Module)
    if config._attn_implementation != "sdpa" or getattr(config, "sub_configs", None):
        yield
        return
    config._attn_implementation = _folded_sdpa_name()
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


class StaticDecoder:
    """The fixed-shape decode loop of one :class:`~arpo_algo.rollout.engines.hf.engine.HFEngine` (see the module
    docstring).

    Args:
        engine: The engine whose rows, prefill, recording and results this loop uses.
        context: Columns per slot (the engine's ``max_context``).
        graphs: Capture and replay CUDA graphs (``decode="cuda_graph"``) instead of running each step eagerly.
        compiled: Run each step through ``torch.compile`` (``decode="compiled"``, see
            :mod:`~arpo_algo.rollout.engines.hf.compiled_step`): all slots; on the CPU the columns the longest row
            needs, on CUDA (with ``graphs``) the column buckets of the captured graphs.
    """

    def __init__(self, engine: Any, context: int, graphs: bool, compiled: bool = False) -> None:
        self.engine, self.context, self.graphs = engine, context, graphs
        self.compiled = CompiledStep(self._body, engine._stats, engine.device.type) if compiled else None
        self.slots = engine.max_batch_size
        self._layer = slot_prefill.slot_layer_class()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # the slot buffers: None until the first prefill of a generate() allocates them, and again after close()
        self.state = self.uniforms = self.cols = cast("torch.Tensor | None", None)
        self._results: dict[int, torch.Tensor] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._weights: tuple = ()
        self._stop_filter = StopFilter(engine.tokenizer, engine.vocab_rows)
        self._made_for: tuple = ()  # (device, dtype) of the weights the slot buffers were made for
        self._draw: tuple[torch.Tensor, ...] = ()  # the draw's float64 buffers, [slots, vocab] each

    @classmethod
    def for_engine(cls, engine: Any, static_cache_tokens: int | None) -> StaticDecoder:
        """Size the engine's static cache (it becomes its ``max_positions``), check it fits, build the decoder."""
        engine.max_positions = static_context(engine.max_positions, static_cache_tokens)
        check_memory(engine.model, engine.max_batch_size, engine.max_positions)
        return cls(
            engine,
            engine.max_positions,
            graphs=captures_graphs(engine.decode, engine.device.type),
            compiled=engine.decode == "compiled",
        )

    def close(self) -> None:
        """Free the buffers and the graphs."""
        self._graphs.clear()
        self._results.clear()
        self.keys, self.values, self._pool, self._draw = [], [], None, ()
        self.state = self.uniforms = self.cols = None

    def bucket_columns(self, need: int) -> int:
        """The column bucket a step that needs ``need`` columns runs with: doubling sizes when it is captured (one
        graph each), otherwise (eager, or compiled with symbolic sizes) ``need`` rounded up to :data:`EAGER_COLUMNS`."""
        if self.graphs:
            return _bucket(need, MIN_COLUMNS, self.context)
        return min(-(-need // EAGER_COLUMNS) * EAGER_COLUMNS, self.context)

    def bucket_rows(self, need: int) -> int:
        """The row bucket a step over slots ``[0, need)`` runs with: all slots when compiled (one shape fewer),
        doubling sizes when captured, exactly ``need`` when eager."""
        if self.compiled is not None:
            return self.slots
        return _bucket(need, 1, self.slots) if self.graphs else need

    def time_step(self, rows: int, length: int, shape: SampleShape = SampleShape(), repeats: int = 20) -> float:
        """Seconds of one bare decode step over ``rows`` slots and ``length`` columns (no host work in between), with
        the weight layout and attention the loop uses: the floor the decode loop can approach. Runs on idle slots
        after a ``generate`` allocated the buffers."""
        if self.state is None:
            raise ConfigError("time_step needs the slot buffers: run one generate() first")
        self._check_weights()  # graphs captured before the weights moved would read freed memory
        rows, length = self.bucket_rows(rows), self.bucket_columns(length)
        # the step the loop runs: the engine's weight layout and attention, as inside generate()
        with torch.inference_mode(), self.engine.decode_layout(), folded_attention(self.engine.model):
            saved = self.state.clone()
            self._run(rows, length, shape)  # warm-up (captures the graph when needed)
            sync = torch.cuda.synchronize if self.state.device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                width = 3 + 2 * shape.logprobs_k
                if self.graphs:
                    self._graphs[(rows, length, shape)].replay()
                elif self.compiled is not None:
                    self.compiled(rows, length, shape, self._results[width][:rows])
                else:
                    self._body(rows, length, shape, self._results[width][:rows])
            sync()
            seconds = (time.perf_counter() - t0) / repeats
            self.state.copy_(saved)
        return seconds

    # ------------------------------------------------------------------------------------------------ the loop
    def decode_all(self, call: Any) -> None:
        """One pass over the pending requests of ``call`` (a :class:`~arpo_algo.rollout.engines.hf.call.CallQueue`):
        decode them, and the requests that join while it runs if this pass's sampling shape and token room hold
        them; those that do not are left pending for the engine's next pass."""
        eng = self.engine
        self._check_weights()
        call.take_joined()  # this pass plans from the requests pending now
        reqs = [call.requests[i] for i in call.pending]
        shape = self._call_shape(reqs)
        twins = collections.Counter(tuple(r.token_ids) for r in reqs)
        prefilled: dict[tuple[int, ...], tuple] = {}
        runs = slot_prefill.plan_shared_runs(reqs)
        slots: list[Any] = [None] * self.slots
        book = self._book(reqs, shape)
        later: list[int] = []  # joined requests this pass cannot hold
        while True:
            self._refill(call, slots, (twins, prefilled, runs), shape, book, later)
            live = np.flatnonzero(book.live)
            if not len(live):
                break
            rows = self.bucket_rows(int(live[-1]) + 1)
            length = self.bucket_columns(int(book.fed[live].max()) + 1)
            t0 = time.perf_counter()
            out = self._run(rows, length, shape).numpy()
            eng._stats["decode_seconds"] += time.perf_counter() - t0
            toks, look = book.add(live, out)
            eng._stats["generated_tokens"] += len(live)
            if eng._on_token is not None:  # in slot order, as each row's token was recorded
                for b, tok in zip(live.tolist(), toks.tolist()):
                    eng._on_token(slots[b].req.request_id, tok)
            done = []
            for b, tok in zip(live[look].tolist(), toks[look].tolist()):
                r = slots[b]
                book.keep(eng, r, b, shape.logprobs_k)
                eng._check_finish(r, tok)
                if r.finish:
                    slots[b] = None
                    book.live[b] = False
                    done.append(b)
                    call.finish(r.idx, eng._result(r, r.finish, self._slot_kv(b, r.fed)))
            if done:
                state = allocated(self.state)
                state[torch.tensor(done, device=state.device)] = torch.tensor(
                    _IDLE, dtype=torch.float64, device=state.device
                )
        call.pending.extend(later)

    def _book(self, reqs: list, shape: SampleShape) -> Book:
        """The host-side record of one call: room for every request's tokens, its EOS and stop-token masks."""
        eng = self.engine
        ends = np.zeros(eng.vocab_rows, dtype=bool)
        ends[[i for i in eng.eos_ids if 0 <= i < eng.vocab_rows]] = True
        stops = self._stop_filter.mask({s for r in reqs for s in r.params.stop})
        cap = max((min(r.params.max_new_tokens, self.context) for r in reqs), default=0) + 1
        return Book(self.slots, cap, 3 + 2 * shape.logprobs_k, ends, stops)

    def _admit(self, call: Any, plan: tuple, shape: SampleShape, book: Book, later: list[int]) -> None:
        """Plan the requests that joined ``call`` since the last look into this pass (``plan``: its twins, prefilled
        contexts and shared runs), or move them to ``later`` when this pass's sampling shape or token room cannot
        hold them (their tokens must not depend on the pass they decode in)."""

        def fits(r: Any) -> bool:
            need = self._call_shape([r])
            return (
                need.logprobs_k <= shape.logprobs_k
                and need.top_k_max <= shape.top_k_max
                and need.top_p <= shape.top_p
                and need.greedy <= shape.greedy
                and min(r.params.max_new_tokens, self.context) + 1 <= book.out.shape[1]
            )

        fit, refused = call.plan_joined(
            plan[0], plan[2], lambda r: tuple(r.token_ids), slot_prefill.plan_shared_runs, fits
        )
        later += refused
        if fit:  # more rows may now need a stop check after some tokens; a check that finds nothing changes nothing
            book.stops = book.stops | self._stop_filter.mask({s for r in fit for s in r.params.stop})

    def _refill(self, call: Any, slots: list, plan: tuple, shape: SampleShape, book: Book, later: list[int]) -> None:
        """Put pending requests into free slots (lowest first), prefilled together in batched forwards: first token,
        then the slot's state. Repeats while a row that ended at its first token left its slot free."""
        eng = self.engine
        twins, prefilled, runs = plan
        while True:
            self._admit(call, plan, shape, book, later)
            if not (call.pending and any(r is None for r in slots)):
                return
            entering = []
            for b in range(self.slots):
                while slots[b] is None and call.pending:
                    row = eng._new_row(call.pending[0], call.requests[call.pending.popleft()])
                    if row.max_new <= 0:
                        call.finish(row.idx, eng._result(row, "length", None))
                        self._admit(call, plan, shape, book, later)
                        continue
                    slots[b] = row
                    entering.append((b, row))
            if not entering:
                return
            t0 = time.perf_counter()
            logits = self._prefill(entering, twins, prefilled, runs)
            self._first_tokens(entering, logits, shape)
            eng._stats["prefill_seconds"] += time.perf_counter() - t0
            for b, row in entering:
                if row.finish:
                    slots[b] = None
                    call.finish(row.idx, eng._result(row, row.finish, self._slot_kv(b, row.fed)))
                    continue
                p = row.req.params
                allocated(self.state)[b] = torch.tensor(
                    [
                        row.new[-1],
                        row.fed,
                        1,
                        1,
                        p.temperature or 1.0,
                        p.temperature == 0,
                        self._top_k(p.top_k),
                        p.top_p,
                    ],
                    dtype=torch.float64,
                )
                book.start(b, row)

    def _slot_kv(self, b: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Slot ``b``'s first ``n`` cached positions per layer, as a finished row's KV (views; the store copies)."""
        return [k[b : b + 1, :, :n] for k in self.keys], [v[b : b + 1, :, :n] for v in self.values]

    def _prefill(self, entering: list, twins: collections.Counter, prefilled: dict, runs: dict) -> torch.Tensor:
        """The entering rows' KV into their slots and their next-token logits (:func:`slot_prefill.prefill`)."""
        return slot_prefill.prefill(self, entering, twins, prefilled, runs)

    def _first_tokens(self, entering: list, logits: torch.Tensor, shape: SampleShape) -> None:
        """Sample and record every entering row's first token, and put its uniforms into its slot."""
        eng = self.engine
        dev = logits.device
        draws = []
        for b, row in entering:
            p = row.req.params
            if p.temperature:
                uniforms = torch.rand(row.max_new, generator=row.gen, dtype=torch.float64)
                allocated(self.uniforms)[b, : uniforms.shape[0]].copy_(uniforms)
                draws.append(uniforms[0])
            else:
                draws.append(torch.zeros((), dtype=torch.float64))
        params = [self._row_params(row.req.params, dev) for _, row in entering]
        joined = RowParams(
            *(torch.cat([getattr(x, f) for x in params]) for f in ("temperature", "greedy", "top_k", "top_p"))
        )
        first = sample_rows(logits, joined, torch.stack(draws).to(dev), shape)
        packed = torch.cat([x.double().reshape(len(entering), -1) for x in first], 1).tolist()
        for (_, row), out in zip(entering, packed):
            eng._record(row, *unpack(out, shape.logprobs_k, row.topk))

    # ------------------------------------------------------------------------------------------------ set-up
    def _top_k(self, top_k: int) -> int:
        return top_k if 0 < top_k < self.engine.vocab_rows else 0

    def _call_shape(self, reqs: list) -> SampleShape:
        eng = self.engine
        tops = [r.params.logprobs_topk or (REFERENCE_TOPK if eng.entropy_method == "topk_sum_lnV" else 0) for r in reqs]
        return SampleShape(
            logprobs_k=min(max(tops, default=0), eng.vocab_rows),
            top_k_max=max((self._top_k(r.params.top_k) for r in reqs), default=0),
            top_p=any(r.params.top_p < 1.0 and r.params.temperature > 0 for r in reqs),
            greedy=any(r.params.temperature == 0 for r in reqs),
        )

    def _row_params(self, p: Any, device: torch.device) -> RowParams:
        return RowParams(
            temperature=torch.tensor([p.temperature or 1.0], dtype=torch.float32, device=device),
            greedy=torch.tensor([p.temperature == 0], device=device),
            top_k=torch.tensor([self._top_k(p.top_k)], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p], dtype=torch.float32, device=device),
        )

    def ensure_buffers_for_model(self) -> None:
        """Slot buffers shaped like the model's KV (layers, heads, head size, dtype), from a one-token forward when
        there are none yet or the weights changed dtype since they were made (the engine's device is fixed)."""
        eng = self.engine
        weight = next(eng.model.parameters())
        if self.keys and self._made_for == (weight.device, weight.dtype):
            return
        from transformers import DynamicCache

        cache: Any = DynamicCache()  # its layers here are all full-attention ones (keys and values)
        with torch.inference_mode():
            out = eng.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=eng.device),
                use_cache=True,
                logits_to_keep=1,
                **{eng.cache_kw: cache},
            )
        self._ensure_buffers([ly.keys for ly in cache.layers], [ly.values for ly in cache.layers], out.logits.shape[-1])
        self._made_for = (weight.device, weight.dtype)

    def _ensure_buffers(self, k1: list[torch.Tensor], v1: list[torch.Tensor], vocab: int) -> None:
        """Allocate the slot buffers on first use, shaped like this forward's KV (layers, heads, head size, dtype);
        ``vocab`` is the width of its logits (the draw's buffers)."""
        ref = k1[0]
        if self.keys and self.keys[0].dtype == ref.dtype and self.keys[0].device == ref.device:
            return
        self.close()
        dev = ref.device
        # One column more than a step ever reads: the compiled step's column count is symbolic, and a slice to a
        # buffer's full length would make dynamo specialise on it (a second graph when a row reaches the context).
        spare = self.context + 1
        self.keys = [ref.new_zeros(self.slots, k.shape[1], spare, k.shape[3]) for k in k1]
        self.values = [ref.new_zeros(self.slots, v.shape[1], spare, v.shape[3]) for v in v1]
        self.state = torch.tensor([_IDLE] * self.slots, dtype=torch.float64, device=dev)
        self.uniforms = torch.zeros(self.slots, self.context, dtype=torch.float64, device=dev)
        self.cols = torch.arange(spare, device=dev)
        # the draw's running sum in kept buffers pays only on the CPU (page faults of a fresh tensor per step)
        self._draw = (
            tuple(torch.empty(self.slots, vocab, dtype=torch.float64, device=dev) for _ in range(2))
            if dev.type == "cpu"
            else ()
        )

    def _check_weights(self) -> None:
        """Drop the graphs when the parameters live at other addresses than when they were captured."""
        ptrs = tuple(p.data_ptr() for p in self.engine.model.parameters())
        if ptrs != self._weights:
            self._graphs.clear()
            self._weights = ptrs

    # ------------------------------------------------------------------------------------------------ one step
    def _run(self, rows: int, length: int, shape: SampleShape) -> torch.Tensor:
        """One decode step over slots ``[0, rows)`` and ``length`` columns; the packed results on the CPU."""
        eng = self.engine
        eng._stats["forward_calls"] += 1
        eng._stats["decode_steps"] += 1
        width = 3 + 2 * shape.logprobs_k
        if width not in self._results:  # allocated outside any graph: every graph writes into it, none owns it
            self._results[width] = torch.zeros(
                self.slots, width, dtype=torch.float64, device=allocated(self.state).device
            )
        res = self._results[width][:rows]
        if self.graphs:
            key = (rows, length, shape)
            graph = self._graphs.get(key)
            if graph is None:
                with folded_attention(eng.model):
                    graph = self._graphs[key] = self._capture(rows, length, shape, res)
            graph.replay()
            eng._stats["graph_replays"] += 1
            return res.cpu()
        with folded_attention(eng.model):
            (self.compiled or self._body)(rows, length, shape, res)
        return res.cpu()

    def _body(self, rows: int, length: int, shape: SampleShape, res: torch.Tensor) -> None:
        """The fixed-shape step: forward one token per slot, sample, pack the results into ``res``, advance the
        slots' state. Tensor ops only (no host synchronisation), so it can be captured. Everything it writes lives in
        buffers kept across steps (the KV slots, the state, ``res``, on the CPU the draw's running sum), which a
        compiled step updates in place (see :mod:`~arpo_algo.rollout.engines.hf.compiled_step`)."""
        st = allocated(self.state)[:rows]
        pos = st[:, POS].long()
        # [rows, length]: this slot's tokens and the new one
        valid = allocated(self.cols)[:length][None, :] <= pos[:, None]
        if self.engine.model.config._attn_implementation == "eager":  # additive mask, as transformers builds it
            dtype = self.keys[0].dtype
            mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(
                ~valid, torch.finfo(dtype).min
            )
        else:
            mask = valid
        cache = _slot_cache([k[:rows] for k in self.keys], [v[:rows] for v in self.values], pos, length, self._layer)
        out = self.engine.model(
            input_ids=st[:, TOK].long()[:, None],
            position_ids=pos[:, None],
            attention_mask=mask[:, None, None, :],
            use_cache=True,
            **{self.engine.cache_kw: cache},
        )
        params = RowParams(
            temperature=st[:, TEMP].float(),
            greedy=st[:, GREEDY] > 0,
            top_k=st[:, TOPK].long(),
            top_p=st[:, TOPP].float(),
        )
        step = st[:, STEP].long().clamp(max=self.context - 1)
        uniforms = allocated(self.uniforms)[:rows].gather(1, step[:, None])[:, 0]
        tok, lp, ent, top_v, top_i = sample_rows(
            out.logits[:, -1],
            params,
            uniforms,
            shape,
            (self._draw[0][:rows], self._draw[1][:rows]) if self._draw else None,
        )
        res.copy_(
            torch.cat(
                [tok.double()[:, None], lp.double()[:, None], ent.double()[:, None], top_v.double(), top_i.double()], 1
            )
        )
        st[:, TOK] = tok.double()
        st[:, POS] += st[:, ACTIVE]
        st[:, STEP] += st[:, ACTIVE]

    def _capture(self, rows: int, length: int, shape: SampleShape, res: torch.Tensor) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream (putting back the state it advanced), then capture it. A compiled step
        compiles in the warm-up, so nothing but its kernels' launches reaches the capture."""
        state = allocated(self.state)
        dev = state.device
        step = self.compiled or self._body
        saved = state.clone()
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # the warm-up writes the KV columns the replay will write (same values), nothing else
                step(rows, length, shape, res)
                state.copy_(saved)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step(rows, length, shape, res)
        self.engine._stats["graph_captures"] += 1
        return graph
