"""Real 1-layer Llamas whose weights make them deterministic bigram chains, for tests that need a model to write a
known text (stop strings, tool calls) without training one.

Attention and MLP outputs are zeroed, so the logits depend on the current token only: each token of the chain has
its own embedding direction, and the head maps it to its successor with a margin of 100; every other token shares
direction 0, which leads to the chain's first token.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_chain_model(tok, nxt: dict[int, int], start: int, dest, max_positions: int) -> Path:  # noqa: ANN001
    """Save to ``dest`` a Llama over ``tok`` that writes ``start`` after any token outside ``nxt`` and ``nxt[t]``
    after ``t`` (greedy or sampled: the margin leaves the rest of the vocabulary no probability mass in float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h = 64
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    slots = {t: i + 1 for i, t in enumerate(sorted(nxt))}  # slot 0: every other token, which leads to the start
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(len(tok), h)
        emb[:, 0] = 1.0
        for t, s in slots.items():
            emb[t] = 0.0
            emb[t, s] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(len(tok), h)
        head[start, 0] = 100.0
        for t, s in slots.items():
            head[nxt[t], s] = 100.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return Path(dest)
