"""FlexAttention for the packed tree: a block-sparse mask built from the trie, and the attention function behind it.

The dense tree mask (:mod:`arpo_algo.train.tree_forward`) hands SDPA an arbitrary [N, N] boolean mask, which takes it
off its flash kernels: on an H100 in bf16, dedup was then only 1.09x faster than the duplicated batch although it ran
2.8x fewer tokens (docs/results/gpu-h100.md#learner). FlexAttention takes a ``BlockMask`` instead: the [N, N] grid cut
into 128 x 128 tiles, each one empty (skipped), full (computed without evaluating a mask) or partial (the mask
function evaluated per element).

**The tree as two O(N) tables.** Number the trie's nodes in depth-first preorder (``pre``) and let ``end`` be
``pre`` + the size of the node's subtree. Node ``kv`` is an ancestor of node ``q`` (or ``q`` itself) exactly when
``pre[kv] <= pre[q] < end[kv]``: the mask function evaluates that, and :func:`tree_block_mask` classifies the tiles
from it chunk by chunk, so no [N, N] mask is ever held in memory.

**How the model uses it.** The learner loads its model with ``attn_implementation=FLEX_TREE_IMPL``, a name registered
with transformers' attention interfaces by :func:`register`: a ``BlockMask`` goes to ``flex_attention``; any other
mask (padded batches; the rollout engine's decoding when it shares the learner's module) goes to transformers' own
SDPA function with SDPA's mask builder, so everything except the packed tree runs exactly as with ``"sdpa"``.

On CUDA ``flex_attention`` runs compiled (``torch.compile``; a new shape compiles on first use, then torch's automatic
dynamic shapes stop the recompiles). On CPU torch 2.13 runs it unfused and forward only (a backward raises), which
is what the CPU tests use it for: the log-probs. The gradients are compared by a ``gpu`` test.
"""

from __future__ import annotations

from typing import Any

import torch

from arpo_base.errors import ConfigError

__all__ = [
    "BLOCK",
    "FLEX_TREE_IMPL",
    "preorder_spans",
    "register",
    "tree_block_mask",
    "tree_dense_mask",
    "tree_flex_attention",
]

#: The attention implementation name the learner loads its model with for ``tree_attention="flex"``.
FLEX_TREE_IMPL = "arpo_tree_flex"
#: FlexAttention's tile size (its default sparse block size).
BLOCK = 128
#: A preorder number no real node has (padding rows and columns match nothing).
_NEVER = 2**30

_compiled_flex: Any = None


def preorder_spans(parent: list[int]) -> tuple[list[int], list[int]]:
    """Depth-first preorder number and subtree end of each trie node (children in id order, roots in id order).

    Args:
        parent: Parent node id per node, -1 for a root; a parent's id is smaller than its children's (as
            :func:`arpo_algo.core.advantages.build_token_trie` assigns them).

    Returns:
        ``(pre, end)``: node ``a`` is an ancestor of ``b`` or ``b`` itself iff ``pre[a] <= pre[b] < end[a]``.
    """
    n = len(parent)
    size = [1] * n
    for v in range(n - 1, -1, -1):
        if parent[v] >= 0:
            size[parent[v]] += size[v]
    pre, free = [0] * n, [0] * n  # free[v]: the next preorder slot for v's next child
    next_root = 0
    for v in range(n):
        p = parent[v]
        if p < 0:
            pre[v], next_root = next_root, next_root + size[v]
        else:
            if p >= v:
                raise ValueError(f"trie node {v} has parent {p}: parents must come before their children")
            pre[v] = free[p]
            free[p] += size[v]
        free[v] = pre[v] + 1
    return pre, [pre[v] + size[v] for v in range(n)]


def tree_dense_mask(pre: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The [N, N] boolean ancestor-or-self mask (True = attend) from the preorder tables."""
    q = pre[:, None]
    return (pre[None, :] <= q) & (q < end[None, :])


def tree_block_mask(pre: torch.Tensor, end: torch.Tensor, *, chunk_elements: int = 1 << 24) -> Any:
    """The FlexAttention ``BlockMask`` of the tree given by ``pre``/``end`` ([N] integer tensors, on the device).

    Tiles are classified a band of query tiles at a time (at most ``chunk_elements`` mask elements live at once).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = int(pre.numel())
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    pre_p = torch.cat([pre.to(torch.int32), pre.new_full((pad,), _NEVER, dtype=torch.int32)])
    end_p = torch.cat([end.to(torch.int32), end.new_zeros((pad,), dtype=torch.int32)])
    rows = max(1, chunk_elements // (nb * BLOCK * BLOCK))
    any_tiles, full_tiles = [], []
    for start in range(0, nb, rows):
        q = pre_p[start * BLOCK : (start + rows) * BLOCK, None]
        tiles = ((pre_p[None, :] <= q) & (q < end_p[None, :])).view(-1, BLOCK, nb, BLOCK)
        any_tiles.append(tiles.any(dim=3).any(dim=1))
        full_tiles.append(tiles.all(dim=3).all(dim=1))
    full = torch.cat(full_tiles)
    partial = torch.cat(any_tiles) & ~full

    def table(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)  # listed tiles first
        return m.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (pre_p[kv_idx] <= pre_p[q_idx]) & (pre_p[q_idx] < end_p[kv_idx])

    kv_num, kv_idx = table(partial)
    full_num, full_idx = table(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def _flex(device_type: str) -> Any:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention  # unfused reference; forward only on CPU
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def tree_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: FlexAttention for a ``BlockMask``, transformers' SDPA for anything else.

    Args:
        query: [B, H, L, D]; ``key``/``value``: [B, H_kv, L, D] (grouped-query attention when H_kv < H).

    Returns:
        ``([B, L, H, D] attention output, None)`` as transformers' attention functions return it.
    """
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout > 0:
        raise ConfigError(
            f"tree_attention='flex' cannot apply attention dropout ({dropout})",
            hint="set the model's attention_dropout to 0, or tree_attention='dense'",
        )
    out = _flex(query.device.type)(
        query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`FLEX_TREE_IMPL` with transformers (idempotent): flex attention, SDPA's mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLEX_TREE_IMPL, tree_flex_attention)
    AttentionMaskInterface.register(FLEX_TREE_IMPL, sdpa_mask)
