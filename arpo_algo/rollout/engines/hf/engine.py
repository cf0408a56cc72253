"""HFEngine: batched incremental decoding with transformers, a self-managed KV cache and prefix reuse (CPU or GPU).

Definitions (the same in every engine of this package, see :mod:`arpo_algo.core.entropy`):

* ``logprobs``: ``log_softmax(raw_logits / T)[token]`` with ``T = temperature`` (``T = 1`` when greedy), taken over
  the *full* vocabulary **before** top-k/top-p truncation. Truncation only decides which token is drawn; the
  logprob is the policy's, so the learner can recompute it from the same logits without knowing top-k/top-p.
* ``entropies`` (``entropy_method="full"``): exact entropy (nats) of that same distribution, from the full logits (never
  from processed scores, docs/howto/rllib.md#raw-logits-for-entropy). With ``entropy_method="topk_sum_lnV"`` each value
  is instead the truncated per-token term ``-sum exp(l) l`` over the top-k entries plus the sampled token (the reference
  estimator's summand; ``k = logprobs_topk`` or 10), and ``top_logprobs`` is always returned. ``logprobs_topk`` may
  be at most the engine's ``max_logprobs`` (here the vocabulary size, vLLM: 64); a request for more gets
  ``finish_reason="error"`` in every engine.

How decoding works: up to ``max_batch_size`` sequences decode together, one token per forward. The batch KV cache is
kept *left padded* (each row's tokens sit contiguously at the right end; padding columns are masked out through an
explicit 2-D ``attention_mask``, and RoPE positions come from explicit ``position_ids``). A request is prefilled
alone (batch 1, no padding), then merged into the batch; a finished row leaves at once and the next pending request
takes its place, so one long sequence never stalls the others. When a request finishes, its KV (context + new
tokens except the last, unfed one) is stored under ``Generation.cache_key`` in an LRU store bounded by
``kv_cache_capacity_tokens``; a later request with ``prefix_key`` set to that key only prefills its new suffix after
the engine has verified the tokens really match. Requests of one call with identical contexts (the initial samples of
a prompt, sibling branches) are prefilled once and share that KV and those next-token logits; requests without a
``prefix_key`` that share a long leading run (a system prompt; at least
:data:`~arpo_algo.rollout.engines.hf.slot_prefill.SHARED_PREFIX_MIN` tokens) have that run prefilled once and feed only
the rest.

Each request samples with its own ``torch.Generator`` (seeded from ``SamplingParams.seed``), so the same seed and
context give the same tokens whatever else is in the batch (up to floating-point ties).

``decode="static"``/``"cuda_graph"`` decode in fixed-shape steps over a preallocated per-slot KV cache, eagerly or
as CUDA graphs, with the same prefill, reuse, refill and records (:mod:`arpo_algo.rollout.engines.hf.static_decode`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import torch

from arpo_algo.core.entropy import ENTROPY_METHODS, topk_token_term
from arpo_algo.rollout.engines.base import (
    FinishCallback,
    Generation,
    GenRequest,
    Tally,
    TokenCallback,
    new_tally,
    request_problem,
)
from arpo_algo.rollout.engines.hf.adapters import NamedAdapters, context_key, plan_runs
from arpo_algo.rollout.engines.hf.call import CallQueue
from arpo_algo.rollout.engines.hf.decode_mode import resolve_decode
from arpo_algo.rollout.engines.hf.kv_cache import KVStore, build_cache, cache_argument, grow_layer_class, merge_rows
from arpo_algo.rollout.engines.hf.linear_layout import LINEAR_LAYOUTS, TransposedLinears, resolve_layout
from arpo_algo.rollout.engines.hf.slot_prefill import SharedRun
from arpo_algo.rollout.engines.hf.static_decode import StaticDecoder
from arpo_algo.rollout.engines.sampling import REFERENCE_TOPK, choose_token
from arpo_base.errors import ConfigError

if TYPE_CHECKING:
    from arpo_algo.models.lora import LoraSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Row:
    """A request being decoded: its sampling state and outputs so far."""

    def __init__(self, idx: int, req: GenRequest, max_new: int, gen: torch.Generator, topk: int) -> None:
        self.idx, self.req, self.max_new, self.gen, self.topk = idx, req, max_new, gen, topk
        self.new: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.top: list[list[tuple[int, float]]] | None = [] if topk > 0 else None
        self.fed = 0  # tokens whose KV is in the cache (= position id of the next token to feed)
        self.finish: str | None = None
        self.stop_string: str | None = None


class HFEngine(NamedAdapters):
    """A :class:`~arpo_algo.rollout.engines.base.RolloutEngine` on a transformers causal LM (see the module docstring).

    Args:
        model_or_path: A registered model name, a local HF folder, or an ``nn.Module`` (shared, not copied).
        tokenizer: The tokenizer; loaded from the folder when omitted (required with a module).
        model: Keyword alias for passing a shared module (``HFEngine(model=learner.model, tokenizer=...)``).
        device: Torch device of a model loaded here ("cpu", "cuda", "cuda:1"). A shared module stays where it is.
        dtype: "float32", "bfloat16" or "float16" for a model loaded here; a shared module must already have it.
        max_batch_size: Sequences decoded together.
        entropy_method: "full" (exact per-token entropy) or "topk_sum_lnV" (reference per-token summands).
        kv_cache_capacity_tokens: Total tokens of finished-sequence KV kept for prefix reuse (LRU); 0 disables it.
        seed: Seeds the random seeds of requests whose ``SamplingParams.seed`` is None.
        linear_layout: "auto" (transposed on CPU, native elsewhere), "native" or "transposed": decode through
            ``(in, out)`` copies of the linear weights, much faster for small batches on CPU at the cost of one
            more copy of those weights (see :mod:`arpo_algo.rollout.engines.hf.linear_layout`).
        decode: "auto" (cuda_graph where CUDA and the model allow it, else dynamic), "dynamic" (left-padded growing
            cache), "static" (fixed-shape steps, per-slot cache), "cuda_graph" (those steps as CUDA graphs) or
            "compiled" (those steps compiled by torch inductor; on CUDA then captured as CUDA graphs).
        static_cache_tokens: Tokens per slot of the static cache, then the engine's ``max_context`` (None = the
            model's ``max_position_embeddings``).
        lora: The learner's adapter settings (:class:`~arpo_algo.models.lora.LoraSettings`, ``target_modules`` the
            resolved module names), for an engine with its own copy (a
            rollout actor): the model is loaded (an adapter folder merged) and gets an adapter of that layout, which
            adapter-only :meth:`load_state_dict` calls fill. The engine holds one adapter at a time and drops its
            stored KV on every load, so no cached prefix outlives the adapter that computed it.
        adapters: ``{name: adapter folder}``: serve several LoRA adapters of the base ``model_or_path`` at once
            (each checked against the base's weights fingerprint). Each request picks one by ``GenRequest.adapter``
            (None: the base itself) and one batch mixes them (PEFT's per-row adapter names); stored KV, identical
            contexts and shared leading runs are keyed by adapter as well as by tokens, so nothing computed under
            one adapter is reused under another. :meth:`add_adapter` / :meth:`remove_adapter` change the set between
            calls. Decodes on the dynamic path only.
    """

    def __init__(
        self,
        model_or_path: Any = None,
        tokenizer: Any = None,
        *,
        model: Any = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 16,
        entropy_method: str = "full",
        kv_cache_capacity_tokens: int = 65536,
        seed: int = 0,
        linear_layout: str = "auto",
        decode: str = "auto",
        static_cache_tokens: int | None = None,
        lora: LoraSettings | None = None,
        adapters: dict[str, str] | None = None,
    ) -> None:
        if (model_or_path is None) == (model is None):
            raise ConfigError("HFEngine needs exactly one of model_or_path or model=")
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
        if entropy_method not in ENTROPY_METHODS:
            raise ConfigError(f"unknown entropy_method {entropy_method!r}; choose one of {', '.join(ENTROPY_METHODS)}")
        if linear_layout not in LINEAR_LAYOUTS:
            raise ConfigError(f"unknown linear_layout {linear_layout!r}; choose one of {', '.join(LINEAR_LAYOUTS)}")
        if max_batch_size < 1 or kv_cache_capacity_tokens < 0:
            raise ConfigError("max_batch_size must be >= 1 and kv_cache_capacity_tokens >= 0")
        if lora is not None and model is not None:
            raise ConfigError(
                "HFEngine(model=<module>, lora=...): a shared module already holds the learner's adapter",
                hint="pass lora= only to an engine that loads its own copy (model_or_path=)",
            )
        if adapters is not None and (model is not None or lora is not None):
            raise ConfigError("HFEngine(adapters=...) loads its own base: pass model_or_path, without model= or lora=")
        if adapters is not None and decode not in ("auto", "dynamic"):
            raise ConfigError(
                f"HFEngine(adapters=...) decodes on the dynamic path only, not decode={decode!r}",
                hint="leave decode at 'auto' or set 'dynamic'",
            )
        self.model, self.tokenizer = self._load(
            model if model is not None else model_or_path,
            tokenizer,
            device,
            _DTYPES[dtype],
            merge=lora is not None or adapters is not None,
        )
        #: Named adapters on one base (``adapters=``): name -> folder; None on an engine of one policy.
        self.adapters: dict[str, str] | None = None
        self._row_adapters: list[str] | None = None  # per-row adapter names of the forward being run
        self._hooked: set[int] = set()
        if adapters is not None:
            from arpo_algo.models import resolve_model_path
            from arpo_algo.models.lora import weights_fingerprint

            self.base_fingerprint = weights_fingerprint(resolve_model_path(os.fspath(model_or_path)))
            self.adapters = {}
            decode = "dynamic"
        if lora is not None:  # the learner's adapter layout, filled by adapter-only load_state_dict() calls
            from arpo_algo.models.lora import attach_adapter

            attach_adapter(self.model, lora, tuple(lora.target_modules))
            self.model.requires_grad_(False)
        self.device = next(self.model.parameters()).device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.entropy_method = entropy_method
        self.kv_cache_capacity_tokens = kv_cache_capacity_tokens
        cfg = (
            self.model.config.get_text_config(decoder=True)
            if hasattr(self.model.config, "get_text_config")
            else self.model.config
        )
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        self.vocab_rows = self.model.get_input_embeddings().weight.shape[0]
        #: Most top logprobs per token a request may ask for: the whole vocabulary.
        self.max_logprobs: int = self.vocab_rows
        self.eos_ids = self._eos_ids()
        self._rng = random.Random(seed)
        self._uid = uuid.uuid4().hex[:8]
        self._next_key = 0
        self._updates = 0  # bumped by weights_updated(): part of the weights' identity
        self._weights_version = self._param_version()
        self._stats: Tally = new_tally()
        self._store = KVStore(kv_cache_capacity_tokens, self._stats)
        self._on_token: TokenCallback | None = None
        self._layer_cls = grow_layer_class()
        self.cache_kw = cache_argument(self.model)  # the forward's name for the KV cache in this transformers
        self._decode_layers: list[Any] = []
        self.linear_layout = resolve_layout(linear_layout, self.device)
        self._transposed = TransposedLinears(self.model) if self.linear_layout == "transposed" else None
        for name, folder in (adapters or {}).items():  # before the decode path is chosen: it sees the LoRA layers
            self.add_adapter(name, folder)
        self.decode = resolve_decode(
            decode,
            self.device,
            self.model,
            self.linear_layout,
            slots=max_batch_size,
            max_positions=self.max_positions,
            static_cache_tokens=static_cache_tokens,
        )
        #: The fixed-shape decoder (None on the dynamic path); ``static_decoder.time_step`` measures one bare step.
        self.static_decoder = None if self.decode == "dynamic" else StaticDecoder.for_engine(self, static_cache_tokens)

    # ----------------------------------------------------------------------------------------------- setup helpers
    @staticmethod
    def _load(src: Any, tokenizer: Any, device: str, dtype: torch.dtype, merge: bool = False) -> tuple[Any, Any]:
        from transformers import AutoTokenizer

        if isinstance(src, torch.nn.Module):
            if tokenizer is None:
                raise ConfigError("HFEngine(model=<module>) needs tokenizer= as well")
            have = next(src.parameters()).dtype
            if have != dtype:
                raise ConfigError(
                    f"the shared module is {have} but the engine dtype is {dtype}; a shared module is "
                    "used as is, so pass the matching dtype (or give the engine its own copy)"
                )
            return src, tokenizer
        from arpo_algo.models import resolve_model_path
        from arpo_algo.models.lora import load_policy_model

        path = resolve_model_path(os.fspath(src))
        # an adapter folder: its base (fingerprint checked) with the adapter applied, unmerged; dropout off, as the
        # learner loads it: train-mode and eval-mode scores are one function on both sides
        mdl = load_policy_model(path, dtype=dtype, merge=merge, no_dropout=True).to(device).eval()
        return mdl, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        for src in (getattr(gen_cfg, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src is not None:
                ids.update(int(i) for i in src)
        return ids

    def _param_version(self) -> tuple[int, int]:
        # Most in-place updates of a parameter (load_state_dict, copy_, mul_, the foreach optimizers) bump its
        # version counter, so a change of the sum means the weights changed under us. Not all: torch's fused AdamW
        # writes the parameters without bumping it, hence the explicit count of weights_updated() calls.
        return self._updates, sum(p._version for p in self.model.parameters())

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def max_context(self) -> int | None:
        """Longest prompt plus generation the model accepts (its ``max_position_embeddings``; None = unbounded)."""
        return self.max_positions

    def close(self) -> None:
        """Drop the stored KV and weight copies (the model may be shared with a learner, so it stays). Idempotent."""
        self.sleep()
        if self.static_decoder is not None:
            self.static_decoder.close()

    def sleep(self) -> None:
        """Free the stored KV and transposed weight copies (stale after a learner update), and on the ``static`` path
        its slot buffers (the static KV cache, allocated whole: 0.75 GB for SmolLM2 at 16 slots x 1024 tokens); the
        next call rebuilds them. ``cuda_graph`` and ``compiled`` keep their buffers: their captured graphs and
        compiled steps were made for them."""
        self._store.clear()
        if self._transposed is not None:
            self._transposed.clear()
        if self.decode == "static" and self.static_decoder is not None:
            self.static_decoder.close()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy new policy weights into the model (dtype/device converted) and drop all cached KV."""
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if any("lora_" in k for k in state_dict):  # an adapter-only copy: the frozen base is already here
            missing = [k for k in missing if "lora_" in k]
        if [k for k in missing if k not in tied] or unexpected:
            raise ConfigError(
                f"state_dict does not match the engine's model: missing={list(missing)[:5]} "
                f"unexpected={list(unexpected)[:5]}"
            )
        self._invalidate()

    def weights_updated(self) -> None:
        """Say that the (shared) module's weights changed in place: drop the cached KV and the transposed weight
        copies. The owner of a shared module must call this after every optimizer step: torch's fused AdamW (what
        :mod:`arpo_algo.train.optim` uses) leaves autograd's version counters alone, so the engine cannot see such a
        step by itself and would keep sampling from the old weights."""
        self._updates += 1
        self._invalidate()

    def release(self, cache_keys: list[Any]) -> None:
        """Forget the stored KV of these keys (unknown or already evicted keys are ignored)."""
        self._store.release(cache_keys)

    def stats(self) -> dict[str, float]:
        """Counters since the last call (tokens generated/prefilled/reused, prefix hits/misses, seconds...)."""
        out = {k: float(v) for k, v in self._stats.items()}
        out["kv_cached_tokens"] = float(self._store.stored_tokens)
        self._stats.clear()
        return out

    #: ``generate`` takes ``on_finish``: requests may join a running call (:mod:`~arpo_algo.rollout.engines.hf.call`).
    joins_requests = True

    def generate(
        self,
        requests: list[GenRequest],
        *,
        on_token: TokenCallback | None = None,
        on_finish: FinishCallback | None = None,
    ) -> list[Generation]:
        """Continue every request (results in request order); a bad request gets ``finish_reason="error"``.
        ``on_token(request_id, token_id)`` is called for each token as it is sampled. ``on_finish(index, generation)``
        is called as each request finishes; the requests it returns join this call (they take batch slots as rows
        leave, and their results follow the others' in the returned list). A request's tokens depend on its seed and
        context only, not on when it joined (up to floating-point ties, as for any batch composition)."""
        t0 = time.perf_counter()
        version = self._param_version()
        if version != self._weights_version:
            self._invalidate()

        def problem(req: GenRequest) -> str | None:
            return request_problem(
                req,
                max_context=self.max_positions,
                vocab_size=self.vocab_rows,
                max_logprobs=self.max_logprobs,
                adapters=self.adapters or (),
            )

        call = CallQueue(requests, problem, self._stats, on_finish)
        was_training = self.model.training
        self.model.eval()
        self._on_token = on_token
        try:
            call.refuse_invalid()
            with torch.inference_mode(), self.decode_layout(version):
                self._decode_all(call)
        finally:
            self._decode_layers = []  # drop the batch buffers between calls
            self._on_token = None
            self.model.train(was_training)
        self._stats["requests"] += len(call.requests)
        self._stats["seconds"] += time.perf_counter() - t0 - call.caller_seconds  # the engine's time only
        return call.results  # type: ignore[return-value]

    def decode_layout(self, version: Any = None) -> contextlib.AbstractContextManager:
        """The weight layout the engine decodes with, as a context (the transposed copies of ``linear_layout``);
        ``version`` identifies the weights (the current ones when omitted)."""
        if self._transposed is None:
            return contextlib.nullcontext()
        return self._transposed.active(self._param_version() if version is None else version)

    # ----------------------------------------------------------------------------------------------- internals
    def _invalidate(self) -> None:
        if self._store:
            self._stats["kv_invalidations"] += 1
        self._store.clear()
        self._weights_version = self._param_version()

    def _new_row(self, idx: int, req: GenRequest) -> _Row:
        p = req.params
        room = (
            p.max_new_tokens
            if self.max_positions is None
            else min(p.max_new_tokens, self.max_positions - len(req.token_ids) + 1)
        )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(p.seed if p.seed is not None else self._rng.getrandbits(63))
        topk = p.logprobs_topk or (REFERENCE_TOPK if self.entropy_method == "topk_sum_lnV" else 0)
        return _Row(idx, req, room, gen, topk)

    def _decode_all(self, call: CallQueue) -> None:
        if self.static_decoder is not None:
            while call.pending:  # a pass ends with requests that joined but did not fit its shapes
                self.static_decoder.decode_all(call)
            return
        requests, pending = call.requests, call.pending
        rows: list[_Row] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        # Identical contexts in one call (the N initial samples of a prompt, fill-ups) are prefilled once: the KV
        # and the next-token logits depend only on the context, and each row still samples with its own generator.
        twins: collections.Counter = collections.Counter()
        prefilled: dict[tuple, tuple] = {}
        runs: dict[tuple, SharedRun] = {}  # leading runs fresh contexts of one adapter share
        while rows or pending:
            while pending and len(rows) < self.max_batch_size:  # refill free slots
                call.plan_joined(twins, runs, context_key, plan_runs)  # the call's, then those joined as rows finished
                row = self._new_row(pending[0], requests[pending.popleft()])
                if row.max_new <= 0:
                    call.finish(row.idx, self._result(row, "length", None))
                    continue
                k1, v1, logits = self._prefill_shared(row, twins, prefilled, runs)
                self._sample([row], logits)
                if row.finish:
                    call.finish(row.idx, self._result(row, row.finish, (k1, v1)))
                    continue
                keys, values, mask = merge_rows(keys, values, mask, k1, v1)
                rows.append(row)
            if not rows:
                break
            logits, keys, values, mask = self._step(rows, keys, values, mask)
            self._sample(rows, logits)
            done = [j for j, r in enumerate(rows) if r.finish]
            if done:
                t = mask.shape[1]
                for j in done:
                    r = rows[j]
                    assert r.finish is not None  # done lists the rows that finished
                    kv = ([k[j : j + 1, :, t - r.fed :] for k in keys], [v[j : j + 1, :, t - r.fed :] for v in values])
                    call.finish(r.idx, self._result(r, r.finish, kv))
                keep = [j for j, r in enumerate(rows) if not r.finish]
                rows = [rows[j] for j in keep]
                idx = torch.tensor(keep, dtype=torch.long, device=self.device)
                keys = [k.index_select(0, idx) for k in keys]
                values = [v.index_select(0, idx) for v in values]
                mask = mask.index_select(0, idx)
                # Drop the leading columns that are padding in every remaining row (the finished long row's history).
                if rows:
                    first = int(mask.any(0).nonzero()[0])
                    if first:
                        keys = [k[:, :, first:] for k in keys]
                        values = [v[:, :, first:] for v in values]
                        mask = mask[:, first:]

    def _prefill_shared(self, row: _Row, twins: collections.Counter, prefilled: dict, runs: dict) -> tuple:
        """``_prefill``, or the result of an identical context's prefill in this call (kept while twins remain)."""
        ctx = context_key(row.req)
        twins[ctx] -= 1
        if ctx in prefilled:
            out = prefilled.pop(ctx) if twins[ctx] == 0 else prefilled[ctx]
            row.fed = len(row.req.token_ids)
            self._stats["reused_tokens"] += row.fed
            self._stats["shared_prefills"] += 1
            return out  # read only: a merge copies, and a new cache layer adopts a tensor it does not own by copying
        out = self._prefill(row, runs)
        if twins[ctx] > 0:
            prefilled[ctx] = out
        return out

    def _prefill(self, row: _Row, runs: dict[tuple[int, ...], SharedRun]) -> tuple[list, list, torch.Tensor]:
        """The row's KV and next-token logits, fed on top of its stored prefix (``prefix_key``), else on top of its
        shared leading run (``runs``; the run is made by the first of its contexts to be prefilled, reused by the
        others, dropped after the last), else whole."""
        ctx, adapter = row.req.token_ids, row.req.adapter
        m, entry = self._store.lookup(row.req.prefix_key, ctx, adapter)
        shared = runs.pop(context_key(row.req), None) if m == 0 else None
        reused = m
        if m > 0:
            assert entry is not None  # lookup reuses tokens (m > 0) only from an entry it found
            keys, values = [k[:, :, :m] for k in entry.keys], [v[:, :, :m] for v in entry.values]
        elif shared is not None:
            m = reused = shared.length
            if shared.keys is None:
                shared.keys, shared.values, _ = self._feed(ctx[:m], 0, [], [], adapter)
                reused = 0  # prefilled here, for the others
            else:
                self._stats["shared_prefix_rows"] += 1
            # a run's keys and values are made and dropped together
            assert shared.keys is not None and shared.values is not None
            keys, values = shared.keys, shared.values
            shared.used()
        else:
            keys, values = [], []
        out = self._feed(ctx, m, keys, values, adapter)
        self._stats["reused_tokens"] += reused
        row.fed = len(ctx)
        return out

    def _feed(
        self, tokens: Any, m: int, keys: list, values: list, adapter: str | None = None
    ) -> tuple[list, list, torch.Tensor]:
        """One batch-1 forward of ``tokens[m:]`` on top of the KV of ``tokens[:m]`` (``keys``/``values``, read only:
        the cache layer copies before it writes), under ``adapter``: the KV of all of ``tokens`` and the last
        position's logits."""
        cache = build_cache(self._layer_cls, keys, values)
        ids = torch.tensor([list(tokens[m:])], dtype=torch.long, device=self.device)
        pos = torch.arange(m, len(tokens), device=self.device).unsqueeze(0)
        att = torch.ones(1, len(tokens), dtype=torch.long, device=self.device)
        with self._rows_under([adapter]):
            out = self.model(
                input_ids=ids,
                attention_mask=att,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: cache},
            )
        self._stats["prefill_tokens"] += len(tokens) - m
        self._stats["forward_calls"] += 1
        return [ly.keys for ly in cache.layers], [ly.values for ly in cache.layers], out.logits[:, -1]

    def _step(
        self, rows: list[_Row], keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, list, list, torch.Tensor]:
        ids = torch.tensor([[r.new[-1]] for r in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.fed] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        cache = build_cache(self._layer_cls, keys, values, reuse=self._decode_layers)
        self._decode_layers = cache.layers
        with self._rows_under([r.req.adapter for r in rows]):
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self.cache_kw: cache}
            )
        self._stats["forward_calls"] += 1
        for r in rows:
            r.fed += 1
        return out.logits[:, -1], [ly.keys for ly in cache.layers], [ly.values for ly in cache.layers], mask

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Pick one token per row from its own generator and record logprob, entropy and the finish state."""
        logits = logits.float()
        temps = torch.tensor([[r.req.params.temperature or 1.0] for r in rows], device=logits.device)
        logp = torch.log_softmax(logits / temps, dim=-1)
        probs = logp.exp()
        ents = (-(probs * logp).nan_to_num(0.0).sum(-1)).tolist()
        for j, r in enumerate(rows):
            p = r.req.params
            tok = choose_token(logits[j], logp[j], probs[j], p.temperature, p.top_k, p.top_p, r.gen)
            lp = float(logp[j, tok])
            top = None
            if r.topk:
                vals, ids = torch.topk(logp[j], min(r.topk, logp.shape[-1]))
                top = list(zip(ids.tolist(), vals.tolist()))
                if tok not in ids.tolist():  # like vLLM: the sampled token is added when it is not in the top k
                    top.append((tok, lp))
            self._record(r, tok, lp, ents[j], top)

    def _record(self, r: _Row, tok: int, lp: float, entropy: float, top: list | None) -> None:
        """Append one sampled token to its row (every decode path), stream it, and check whether the row is done."""
        self._append(r, tok, lp, entropy, top)
        self._stats["generated_tokens"] += 1
        if self._on_token is not None:
            self._on_token(r.req.request_id, tok)
        self._check_finish(r, tok)

    def _append(self, r: _Row, tok: int, lp: float, entropy: float, top: list | None) -> None:
        """Add one token's outputs to its row's lists (the static decoder adds the tokens it kept in bulk here)."""
        if top is not None:
            assert r.top is not None  # a row is given top entries only when it asked for them, and then keeps a list
            r.top.append(top)
        r.new.append(tok)
        r.logprobs.append(lp)
        # cast: topk_sum_lnV makes every row ask for REFERENCE_TOPK entries at least, so it is given a list
        r.entropies.append(entropy if self.entropy_method == "full" else topk_token_term(cast(list, top)))

    def _check_finish(self, r: _Row, tok: int) -> None:
        if tok in self.eos_ids:
            r.finish = "eos"
            return
        stops = r.req.params.stop
        if stops:
            # Only the tail can complete a stop string; each token is >= 1 byte, so this window always covers it.
            width = max(len(s.encode()) for s in stops) + 1
            text = self.tokenizer.decode(r.new[-width:], skip_special_tokens=False)
            for s in stops:
                if s in text:
                    r.finish, r.stop_string = "stop", s
                    return
        if len(r.new) >= r.max_new:
            r.finish = "length"

    def _result(self, r: _Row, finish: str, kv: tuple[list, list] | None) -> Generation:
        key = None
        if kv is not None:
            key = self._store.put(
                f"{self._uid}:{self._next_key}", list(r.req.token_ids) + r.new[:-1], *kv, adapter=r.req.adapter
            )
            self._next_key += key is not None
        return Generation(
            r.req.request_id,
            r.new,
            r.logprobs,
            r.entropies,
            finish,  # type: ignore[arg-type]
            stop_string=r.stop_string,
            top_logprobs=r.top,
            cache_key=key,
            metrics={"new_tokens": float(len(r.new))},
        )
