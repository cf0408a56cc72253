"""THE token-layout rule (docs/concepts/arpo.md#token-layout), used by the sampler, the agent loop, SFT, eval and serve.

A conversation's token ids are: the chat template of its messages with the generation prompt
(:func:`prompt_ids`), then the model's sampled tokens (trained, ``trained_mask`` 1) and, after each tool call, the
tool result tokenized alone (:func:`observation_ids`, appended with ``trained_mask`` 0). Nothing is ever
re-tokenized, so a branch's prefix is token-identical to its parent's and SFT rows match RL rows token for token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The prompt: ``apply_chat_template(messages, add_generation_prompt=True)`` as a list of token ids."""
    return list(
        tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def observation_ids(tokenizer: Any, text: str) -> list[int]:
    """A tool result (or any inserted text) tokenized on its own: no special tokens added, and special-token text
    in it split into plain tokens (a tool cannot inject ``<|im_end|>``). Empty text gives no tokens."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Model-written text (an SFT demonstration's trained segment) tokenized on its own, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
