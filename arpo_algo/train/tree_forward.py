"""Token-level forward passes for training: the duplicated (padded) batch and the prefix-deduplicated tree pack.

**Duplicated** (``dedup_prefix=False``, the reference's computation): every trajectory is a full row
``prompt + response`` of a right-padded batch, so a prefix shared by d trajectories runs through the model d times.

**Deduplicated** (``dedup_prefix=True``): the micro-batch's sequences are merged into a token trie (identical
prefixes become one path; the shared chat-template system prompt of different prompts merges too), the unique trie
nodes are packed into ONE row, and one forward runs with a tree attention mask (each token attends to its
ancestors and itself) and ``position_ids`` = depth in the trie. A token's hidden state depends only on its ancestors,
so every unique token gets exactly the logits it has in each sequence through it (up to float rounding from the
different matmul shapes, ~1e-6 in fp32). Loss terms are then formed per (trajectory, token) *pair* that points at
the shared node, so the objective and its gradient equal the duplicated ones.

Both builders produce a :class:`TokenBatch`: model inputs, the "unique predictions" U (which kept logits row
predicts which token) and the loss pairs P (which prediction, advantage, count weight, old log-prob, sequence and
group). The packed batch carries the tree as two O(N) tables (preorder number and subtree end,
:func:`arpo_algo.train.tree_flex.preorder_spans`); :func:`attention_mask_for` turns them, on the device, into the
form the model's attention takes: an [N, N] mask for SDPA/eager (``tree_attention="dense"``, O(N²) booleans, and SDPA
falls off its flash kernels), or a FlexAttention block mask that skips the empty tiles (``"flex"``,
:mod:`arpo_algo.train.tree_flex`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from arpo_algo.core.advantages import build_token_trie
from arpo_algo.train.tree_flex import FLEX_TREE_IMPL, preorder_spans, tree_block_mask, tree_dense_mask
from arpo_base.errors import ArpoError, ConfigError


@dataclass
class SeqSpec:
    """One trajectory as the learner hands it to a batch builder.

    Attributes:
        group: Global group index (for per-group statistics).
        seq: Global sequence index (for the per-sequence loss mean).
        prompt: Prompt token ids (non-empty: the first response token is predicted from the last prompt token).
        response: Response token ids.
        trained: Trained mask per response token.
        adv: Advantage per response token.
        weight: Count weight per response token (1.0 soft; 1/d for hard attribution in the duplicated path).
        old_logp: Behaviour log-prob per response token (used when old log-probs come from the rollout).
        unsampled: Response positions that no engine sampled (the tool-limit EOS): their ``old_logp`` is a
            placeholder and the learner scores them itself.
    """

    group: int
    seq: int
    prompt: list[int]
    response: list[int]
    trained: list[int]
    adv: list[float]
    weight: list[float]
    old_logp: list[float]
    unsampled: tuple[int, ...] | list[int] = ()


@dataclass
class TokenBatch:
    """Model inputs plus the index tables that turn kept logits into per-pair loss inputs."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor | None  # [B, L] (padded); None for the packed tree (see tree_pre/tree_end)
    position_ids: torch.Tensor | None  # [1, N] trie depth for the packed tree
    keep: torch.Tensor  # [K] positions whose logits are needed
    node_b: torch.Tensor  # [U] batch row of each unique prediction
    node_row: torch.Tensor  # [U] index into ``keep``
    node_tok: torch.Tensor  # [U] predicted token id
    pair_node: torch.Tensor  # [P] index into U
    pair_adv: torch.Tensor  # [P]
    pair_weight: torch.Tensor  # [P]
    pair_old_logp: torch.Tensor  # [P]
    pair_seq: torch.Tensor  # [P]
    pair_group: torch.Tensor  # [P]
    pair_sampled: torch.Tensor  # [P] bool: the engine sampled the token (False: appended, e.g. the limit EOS)
    num_tokens: int  # tokens run through the model (no padding)
    pair_pos: torch.Tensor | None = None  # [P] the pair's response position in its sequence (the tree recorder)
    tree_pre: torch.Tensor | None = None  # [N] preorder number of each packed node (packed tree only)
    tree_end: torch.Tensor | None = None  # [N] preorder end of each node's subtree (packed tree only)
    block_mask: Any = None  # the FlexAttention BlockMask, built on first use (attention_mask_for)

    def to(self, device: torch.device | str) -> TokenBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[k] = v.to(device)
        return TokenBatch(**moved)


def _check(specs: list[SeqSpec]) -> None:
    if not specs:
        raise ArpoError("empty micro-batch: no trajectories to train on")
    for s in specs:
        if not s.prompt:
            raise ArpoError(
                f"sequence {s.seq} (group {s.group}) has an empty prompt",
                hint="the first response token is predicted from the prompt; tokenize the chat prompt",
            )


def _pair_tensors(rows: list[tuple[int, float, float, float, int, int, bool, int]]) -> dict[str, torch.Tensor]:
    node, adv, w, old, seq, grp, sampled, pos = zip(*rows) if rows else ((),) * 8
    return {
        "pair_node": torch.tensor(node, dtype=torch.long),
        "pair_adv": torch.tensor(adv, dtype=torch.float32),
        "pair_weight": torch.tensor(w, dtype=torch.float32),
        "pair_old_logp": torch.tensor(old, dtype=torch.float32),
        "pair_seq": torch.tensor(seq, dtype=torch.long),
        "pair_group": torch.tensor(grp, dtype=torch.long),
        "pair_sampled": torch.tensor(sampled, dtype=torch.bool),
        "pair_pos": torch.tensor(pos, dtype=torch.long),
    }


def build_padded_batch(specs: list[SeqSpec], pad_id: int) -> TokenBatch:
    """The duplicated computation: one right-padded row per trajectory; logits kept from the shortest prompt on."""
    _check(specs)
    seqs = [s.prompt + s.response for s in specs]
    length = max(len(x) for x in seqs)
    ids = torch.full((len(specs), length), pad_id, dtype=torch.long)
    att = torch.zeros((len(specs), length), dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
        att[b, : len(x)] = 1
    start = min(len(s.prompt) for s in specs) - 1
    keep = torch.arange(start, length - 1, dtype=torch.long) if length - 1 > start else torch.tensor([start])
    nb, nr, nt, pairs = [], [], [], []
    for b, s in enumerate(specs):
        p = len(s.prompt)
        for t, m in enumerate(s.trained):
            if m:
                nb.append(b)
                nr.append(p + t - 1 - start)
                nt.append(s.response[t])
                pairs.append(
                    (len(pairs), s.adv[t], s.weight[t], s.old_logp[t], s.seq, s.group, t not in s.unsampled, t)
                )
    return TokenBatch(
        input_ids=ids,
        attention_mask=att,
        position_ids=None,
        keep=keep,
        node_b=torch.tensor(nb, dtype=torch.long),
        node_row=torch.tensor(nr, dtype=torch.long),
        node_tok=torch.tensor(nt, dtype=torch.long),
        num_tokens=int(att.sum()),
        **_pair_tensors(pairs),
    )


def build_dedup_batch(specs: list[SeqSpec], *, merge_shared: bool = False) -> TokenBatch:
    """The prefix-deduplicated computation: the micro-batch's trie packed into one row with an ancestor mask.

    Args:
        specs: The micro-batch's trajectories (whole groups).
        merge_shared: Merge the pairs of a shared token within a group into one pair (weights summed). Used for
            hard attribution, where the copies carry the same (mean) advantage and the token counts once. The
            merged pair keeps the first copy's rollout old log-prob (the copies of a shared sampled token are the
            same sample, so the sampler reports the same value for each).
    """
    _check(specs)
    trie = build_token_trie([s.prompt + s.response for s in specs])
    n = trie.num_nodes
    pre, end = preorder_spans(trie.parent)
    # Unique predictions: each trained node is predicted from its parent's logits.
    node_index: dict[int, int] = {}
    pairs: list[tuple[int, float, float, float, int, int, bool, int]] = []
    merged: dict[tuple[int, int], int] = {}
    for j, s in enumerate(specs):
        path, p = trie.paths[j], len(s.prompt)
        for t, m in enumerate(s.trained):
            if not m:
                continue
            node = path[p + t]
            u = node_index.setdefault(node, len(node_index))
            key = (s.group, node)
            if merge_shared and key in merged:
                i = merged[key]
                old = pairs[i]
                pairs[i] = (old[0], old[1], old[2] + s.weight[t], *old[3:])
                continue
            merged[key] = len(pairs)
            pairs.append((u, s.adv[t], s.weight[t], s.old_logp[t], s.seq, s.group, t not in s.unsampled, t))
    nodes = list(node_index)
    parents = sorted({trie.parent[v] for v in nodes})
    row_of = {v: i for i, v in enumerate(parents)}
    keep = torch.tensor(parents if parents else [0], dtype=torch.long)
    return TokenBatch(
        input_ids=torch.tensor([trie.token], dtype=torch.long),
        attention_mask=None,
        position_ids=torch.tensor([trie.depth], dtype=torch.long),
        keep=keep,
        node_b=torch.zeros(len(nodes), dtype=torch.long),
        node_row=torch.tensor([row_of[trie.parent[v]] for v in nodes], dtype=torch.long),
        node_tok=torch.tensor([trie.token[v] for v in nodes], dtype=torch.long),
        num_tokens=n,
        tree_pre=torch.tensor(pre, dtype=torch.long),
        tree_end=torch.tensor(end, dtype=torch.long),
        **_pair_tensors(pairs),
    )


def attention_mask_for(model: torch.nn.Module, batch: TokenBatch) -> Any:
    """The mask in the form the model's attention implementation takes.

    A padded batch: its [B, L] mask. The packed tree, by the model's implementation: :data:`FLEX_TREE_IMPL` gets the
    FlexAttention ``BlockMask`` (built once and kept on the batch); SDPA the [1, 1, N, N] boolean mask (True =
    attend); eager a float mask with 0 / dtype-min, which it adds to the scores. Flash-attention kernels take no
    arbitrary mask, so the packed tree cannot run on them.
    """
    if batch.tree_pre is None:
        return batch.attention_mask
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl == FLEX_TREE_IMPL:
        if batch.block_mask is None:
            batch.block_mask = tree_block_mask(batch.tree_pre, batch.tree_end)
        return batch.block_mask
    if impl not in ("sdpa", "eager"):
        raise ConfigError(
            f"attn_implementation={impl!r} cannot take the tree attention mask of dedup_prefix=True",
            hint="load the model with attn_implementation='sdpa' or 'eager', or set dedup_prefix=False",
        )
    mask = tree_dense_mask(batch.tree_pre, batch.tree_end)[None, None]
    if impl == "sdpa":
        return mask
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    return torch.where(mask, zero, torch.finfo(torch.float32).min)


def forward_token_stats(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    with_entropy: bool,
    entropy_grad: bool = True,
    head_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model once and return each unique prediction's log-prob (and full-vocabulary entropy), in fp32.

    Only the kept positions go through the LM head (``logits_to_keep`` with an index tensor), which matters with
    large vocabularies. ``entropy_grad=False`` computes the entropy outside the autograd graph (a metric or a
    detached z-score needs no gradient, and the graph would keep a [U, V] tensor alive).

    ``head_chunk`` (``LearnerConfig.head_chunk_tokens``): the model body runs once, then the LM head, log-softmax
    and entropy run over at most ``head_chunk`` predictions at a time, each chunk recomputed in the backward pass
    (non-reentrant activation checkpointing), so the [U, V] logits and their log-softmax, entropy terms and
    gradients (the RL step's largest tensors otherwise) exist one chunk at a time. Same values and
    gradients up to float rounding; one more head forward. Needs a plain HF causal LM whose logits are its output
    embeddings applied to the last hidden state (no logit scaling or soft-capping).
    """
    if head_chunk:
        return _chunked_head_stats(model, batch, with_entropy, entropy_grad, head_chunk)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=attention_mask_for(model, batch),
        position_ids=batch.position_ids,
        logits_to_keep=batch.keep,
        use_cache=False,
    )
    return _head_stats(out.logits[batch.node_b, batch.node_row], batch.node_tok, with_entropy, entropy_grad)


def _head_stats(
    logits: torch.Tensor, tok: torch.Tensor, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    lp = logprobs.gather(1, tok[:, None]).squeeze(1)
    if not with_entropy:
        return lp, None
    with torch.enable_grad() if entropy_grad else torch.no_grad():
        ent = -(torch.exp(logprobs) * logprobs).sum(-1)
    return lp, ent


def _chunked_head_stats(
    model: torch.nn.Module, batch: TokenBatch, with_entropy: bool, entropy_grad: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from torch.utils.checkpoint import checkpoint

    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) is not None:
            raise ConfigError(
                f"learner.head_chunk_tokens: the model's logits are not its plain LM head output "
                f"(config.{name} is set)",
                hint="leave head_chunk_tokens unset for this model",
            )
    body = getattr(model, model.base_model_prefix)
    hidden = body(
        input_ids=batch.input_ids,
        attention_mask=attention_mask_for(model, batch),
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state
    rows = hidden[batch.node_b, batch.keep[batch.node_row]]  # [U, H]: the hidden state under each kept logit row
    head = model.get_output_embeddings()

    def stats(h: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lp, ent = _head_stats(head(h), tok, with_entropy, entropy_grad)
        return (lp,) if ent is None else (lp, ent)

    parts = [
        checkpoint(stats, h, tok, use_reentrant=False) if torch.is_grad_enabled() else stats(h, tok)
        for h, tok in zip(rows.split(chunk), batch.node_tok.split(chunk), strict=True)
    ]
    lp = torch.cat([p[0] for p in parts])
    return lp, (torch.cat([p[1] for p in parts]) if with_entropy else None)
