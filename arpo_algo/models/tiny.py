"""Tiny models for fast tests: a byte-level tokenizer defined here and a randomly initialised Llama of a few layers."""

from __future__ import annotations

import os
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per byte) and ChatML special tokens.

    It is a real ``PreTrainedTokenizerFast``: it saves, reloads and applies its chat template like any HF tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(
    dest: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Llama with the byte tokenizer (or the tokenizer of another folder) to ``dest``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from) if tokenizer_from else byte_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id
    )
    dest = Path(dest)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def build_tiny_adapter(
    base: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    rank: int = 4,
    seed: int = 0,
    scale: float = 0.5,
    target_modules: tuple[str, ...] = (),
) -> Path:
    """Write a LoRA adapter folder for the model folder ``base`` (as a LoRA run writes it, tied to the base's
    fingerprint) with random adapter matrices (``lora_B`` not zero, so the adapter changes the output)."""
    import torch
    from transformers import AutoTokenizer

    from arpo_algo.models.lora import (
        LoraSettings,
        attach_adapter,
        load_policy_model,
        resolve_targets,
        save_adapter,
        weights_fingerprint,
    )

    lora = LoraSettings(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=tuple(target_modules))
    model = load_policy_model(base, dtype=torch.float32)
    attach_adapter(model, lora, resolve_targets(lora, base), str(base))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    dest = save_adapter(model, Path(dest), base=Path(base), fingerprint=weights_fingerprint(base))
    AutoTokenizer.from_pretrained(base).save_pretrained(dest)
    return dest
