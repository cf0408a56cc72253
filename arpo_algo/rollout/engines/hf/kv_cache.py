"""The HF engine's KV memory: the prefix store (finished sequences' KV, LRU, reused by ``prefix_key``), the growable
cache layer and the left-padded batch layout helpers (see :mod:`arpo_algo.rollout.engines.hf.engine` for how decoding
uses
them).
"""

from __future__ import annotations

import collections
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from arpo_algo.rollout.engines.base import Tally


@dataclass
class KVEntry:
    """A stored KV prefix: the tokens it covers and, per layer, keys/values of shape [1, kv_heads, n, head_dim]."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    adapter: str | None = None


class KVStore:
    """Finished sequences' KV under their cache keys, LRU-bounded by ``capacity_tokens`` (0 = store nothing).

    Counters (prefix hits/misses/mismatches, evictions) go into the engine's ``stats`` counter.
    """

    def __init__(self, capacity_tokens: int, stats: Tally) -> None:
        self.capacity_tokens = capacity_tokens
        self.stats = stats
        self._entries: collections.OrderedDict[str, KVEntry] = collections.OrderedDict()
        self.stored_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.stored_tokens = 0

    def release(self, keys: list[Any]) -> None:
        """Forget these keys (unknown or already evicted keys are ignored)."""
        for key in keys:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.stored_tokens -= len(entry.tokens)

    def put(
        self,
        key: str,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        adapter: str | None = None,
    ) -> str | None:
        """Store a copy of this KV under ``key`` (evicting the least recently used); None when it does not fit.
        ``adapter``: the LoRA adapter that computed it (part of its identity, like the tokens)."""
        if not 0 < len(tokens) <= self.capacity_tokens:
            return None
        # clone: a slice would keep the whole batch tensor alive
        self._entries[key] = KVEntry(tokens, [k.clone() for k in keys], [v.clone() for v in values], adapter)
        self.stored_tokens += len(tokens)
        while self.stored_tokens > self.capacity_tokens:
            _, old = self._entries.popitem(last=False)
            self.stored_tokens -= len(old.tokens)
            self.stats["kv_evictions"] += 1
        return key

    def lookup(self, prefix_key: Any, ctx: list[int], adapter: str | None = None) -> tuple[int, KVEntry | None]:
        """How many leading tokens of ``ctx`` can come from the stored prefix ``prefix_key`` (verified: the same
        tokens under the same adapter; KV computed under one adapter is never reused under another)."""
        if prefix_key is None:
            return 0, None
        entry = self._entries.get(prefix_key)
        if entry is None:
            self.stats["prefix_misses"] += 1
            return 0, None
        n = len(entry.tokens)
        m = min(n, len(ctx))
        if entry.adapter != adapter or list(ctx[:m]) != entry.tokens[:m]:
            self.stats["prefix_mismatches"] += 1  # not a prefix: recompute everything rather than trust the hint
            return 0, None
        self._entries.move_to_end(prefix_key)
        self.stats["prefix_hits"] += 1
        return min(m, len(ctx) - 1), entry  # at least one token must be fed to get the next-token logits


def cache_argument(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache under: ``cache`` in the transformers releases that renamed it,
    ``past_key_values`` in the earlier 5.x ones (the old name is deprecated there and goes away in a later release,
    so every forward of the engines passes the cache under the name this returns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def grow_layer_class() -> type:
    """A transformers ``DynamicLayer`` that appends into spare capacity instead of re-concatenating every step.

    ``DynamicLayer.update`` does ``torch.cat`` of the whole cache per generated token, an O(T) copy per layer and step.
    This layer keeps a buffer with room to grow (doubling) and returns views of its filled part, so one decoding step
    writes only the new column. Any other tensor put in ``keys`` (a merge, a row removal) is adopted on the next update.
    """
    from transformers.cache_utils import DynamicLayer

    class GrowLayer(DynamicLayer):
        kbuf: torch.Tensor | None = None
        vbuf: torch.Tensor | None = None

        def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values, kbuf, vbuf = self.keys, self.values, self.kbuf, self.vbuf
            assert keys is not None and values is not None, "an initialized layer holds tensors (empty at first)"
            n, t = keys.shape[-2] if keys.numel() else 0, key_states.shape[-2]
            owned = (
                kbuf is not None
                and keys.numel()
                and keys.data_ptr() == kbuf.data_ptr()
                and kbuf.shape[0] == key_states.shape[0]
            )
            # the two buffers are always replaced together, so kbuf and vbuf are both None or both tensors
            if kbuf is None or vbuf is None or not owned or n + t > kbuf.shape[-2]:
                shape = list(key_states.shape)
                shape[-2] = max(2 * (n + t), n + t + 64)
                kbuf, vbuf = key_states.new_empty(shape), value_states.new_empty(shape)
                self.kbuf, self.vbuf = kbuf, vbuf
                if n:
                    kbuf[..., :n, :] = keys
                    vbuf[..., :n, :] = values
            kbuf[..., n : n + t, :] = key_states
            vbuf[..., n : n + t, :] = value_states
            self.keys, self.values = kbuf[..., : n + t, :], vbuf[..., : n + t, :]
            return self.keys, self.values

    return GrowLayer


def left_pad(t: torch.Tensor, amount: int, dim: int) -> torch.Tensor:
    if amount <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = amount
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def build_cache(
    layer_cls: type, keys: list[torch.Tensor], values: list[torch.Tensor], reuse: list[Any] | None = None
) -> Any:
    """A DynamicCache over these tensors. Layers of ``reuse`` whose ``keys`` are exactly these tensors (the views
    a previous step returned) are kept, so their spare capacity carries over to this step."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        old = reuse[i] if reuse is not None and i < len(reuse) else None
        if old is not None and old.keys is k and old.values is v:
            cache.layers.append(old)
            continue
        layer = layer_cls()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v  # hand over without the copy DynamicCache(ddp_cache_data=...) makes
        cache.layers.append(layer)
    return cache


def merge_rows(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor,
    k1: list[torch.Tensor],
    v1: list[torch.Tensor],
) -> tuple[list, list, torch.Tensor]:
    """Add one prefilled row (batch 1) to the left-padded batch KV and its attention mask."""
    n = k1[0].shape[2]
    m1 = torch.ones(1, n, dtype=torch.long, device=mask.device)
    if not keys:
        return k1, v1, m1
    t = mask.shape[1]
    keys = [torch.cat([left_pad(k, n - t, 2), left_pad(a, t - n, 2)]) for k, a in zip(keys, k1)]
    values = [torch.cat([left_pad(v, n - t, 2), left_pad(a, t - n, 2)]) for v, a in zip(values, v1)]
    mask = torch.cat([left_pad(mask, n - t, 1), left_pad(m1, t - n, 1)])
    return keys, values, mask
