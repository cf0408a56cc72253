"""The engine sub-tables of ``[rollouts]``: ``[rollouts.hf]`` (:class:`HFEngineConfig`) and ``[rollouts.vllm]``
(:class:`VLLMEngineConfig`), each the keyword arguments of its engine that a user may set.

Settings both engines share (``dtype``, the device, sampling) stay in :class:`arpo_algo.rollout.config.RolloutsConfig`;
what the algorithm decides (the entropy estimator, the seed, the model) is not a setting here. Every field has a
one-sentence ``doc`` in its metadata: the settings reference is generated from it. This module imports neither torch
nor vLLM, so a configuration can be built and checked without them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from arpo_base.errors import ConfigError
from arpo_base.options import setting

#: The ``max_logprobs`` every VLLMEngine is built with: vLLM refuses a request for more top logprobs per token, so
#: ``tree.topk_logprobs`` is checked against it when the settings are validated (before any model is loaded).
VLLM_MAX_LOGPROBS = 64
#: The ``max_lora_rank`` values vLLM 0.29 accepts (``vllm.config.lora.MaxLoRARanks``; a test compares the two where
#: vLLM is installed). A LoRA engine is built with the smallest one at least the adapter's rank, so an adapter rank
#: above the largest cannot be served by vLLM at all and is refused when the settings are validated.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def fitting_lora_rank(rank: int, allowed: tuple[int, ...], engine: str) -> int:
    """The smallest of an engine's ``allowed`` max_lora_rank values that holds an adapter of ``rank``, or a
    ConfigError naming the allowed values (a rank below 1 or above the largest)."""
    fits = [r for r in allowed if r >= rank]
    if rank < 1 or not fits:
        raise ConfigError(
            f"LoRA rank {rank} cannot be served by the {engine} engine: {engine}'s max_lora_rank is one of "
            f"{', '.join(map(str, allowed))}, so an adapter rank must be between 1 and {max(allowed)}",
            hint=f"set model.lora.rank between 1 and {max(allowed)}, or use rollouts.engine = 'hf'",
        )
    return fits[0]


def vllm_lora_rank(rank: int, allowed: tuple[int, ...] = VLLM_LORA_RANKS) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank`` (:func:`fitting_lora_rank`)."""
    return fitting_lora_rank(rank, allowed, "vLLM")


def captures_graphs(decode: str, device_type: str) -> bool:
    """Whether the HF engine's decode mode replays captured CUDA graphs: ``cuda_graph``, and ``compiled`` on CUDA
    (the compiled step is captured there, see :mod:`arpo_algo.rollout.engines.hf.compiled_step`). Such graphs hold the
    weights' addresses, so they cannot read weight copies rebuilt after every update."""
    return decode == "cuda_graph" or (decode == "compiled" and device_type == "cuda")


@dataclass(frozen=True)
class HFEngineConfig:
    """``[rollouts.hf]``: the transformers engine (:class:`arpo_algo.rollout.engines.hf.engine.HFEngine`)."""

    max_batch_size: int = setting(16, "Most sequences the engine decodes at once.")
    linear_layout: Literal["auto", "native", "transposed"] = setting(
        "auto",
        "Weight layout of nn.Linear while decoding: 'transposed' decodes through (in, out) copies of the "
        "weights, 1.3-1.5x faster per step on CPU for one more copy; 'auto' = transposed on CPU, native on GPU.",
    )
    decode: Literal["auto", "dynamic", "static", "cuda_graph", "compiled"] = setting(
        "auto",
        "'dynamic' (left-padded growing KV cache), 'static' (fixed-shape steps over a preallocated KV cache, "
        "same results), 'cuda_graph' (those steps replayed as CUDA graphs; CUDA only), 'compiled' (experimental, "
        "needs experimental_compiled_decode = true: those steps compiled by torch inductor, all slots, one graph "
        "for every column count, on CUDA captured as CUDA graphs; needs a C++ compiler, and Triton on CUDA); "
        "'auto' = "
        "cuda_graph on a GPU where its static cache takes at most a quarter of the free memory, else dynamic.",
    )
    static_cache_tokens: int | None = setting(
        None,
        "Tokens per sequence of the static KV cache (decode 'static'/'cuda_graph'/'compiled'); it becomes the "
        "engine's context limit. None = the model's max_position_embeddings (SmolLM2: 8192 tokens, 6 GB at 16 slots "
        "in float32; a cache larger than the free memory is refused).",
    )
    kv_cache_capacity_tokens: int = setting(
        65536, "Tokens of finished-sequence KV kept for prefix reuse (least recently used first out); 0 disables it."
    )
    experimental_compiled_decode: bool = setting(
        False,
        "Allow decode = 'compiled', an experimental path: no measurement shows it faster on its target hardware "
        "(docs/results/speed.md: 0.28x-0.66x of dynamic on CPU in float32, 1.19x in bfloat16 at batch 8 only).",
    )

    def validate(self) -> None:
        """Ranges; the device-dependent checks are :meth:`check_device`."""
        if self.max_batch_size < 1:
            raise ConfigError(f"rollouts.hf.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.kv_cache_capacity_tokens < 0:
            raise ConfigError(f"rollouts.hf.kv_cache_capacity_tokens must be >= 0, got {self.kv_cache_capacity_tokens}")
        if self.static_cache_tokens is not None and self.static_cache_tokens < 2:
            raise ConfigError(f"rollouts.hf.static_cache_tokens must be >= 2 or None, got {self.static_cache_tokens}")
        if self.decode == "compiled" and not self.experimental_compiled_decode:
            # Invariant: a path that no results page shows faster on its target hardware runs only when asked for
            # under a name that says it is experimental; the CUDA-graph path stays the GPU default.
            raise ConfigError(
                "rollouts.hf.decode='compiled' is experimental (no measurement shows it faster than the default)",
                hint="set rollouts.hf.experimental_compiled_decode = true to use it, or decode = 'auto'",
            )

    def check_device(self, device: str) -> None:
        """CUDA graphs need a CUDA device and weights that stay where the graphs read them."""
        if self.decode == "cuda_graph" and device != "cuda":
            raise ConfigError(
                f"rollouts.hf.decode='cuda_graph' needs rollouts.device='cuda', got {device!r}",
                hint="decode='static' runs the same fixed-shape steps eagerly on CPU; 'auto' picks",
            )
        if captures_graphs(self.decode, device) and self.linear_layout == "transposed":
            raise ConfigError(
                f"rollouts.hf.decode={self.decode!r} on CUDA with linear_layout='transposed': graphs "
                "would read weight copies that are rebuilt after every update",
                hint="linear_layout='auto' or 'native'",
            )

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's keyword arguments these settings give (the experimental fence is checked here, not by the
        engine)."""
        kwargs = asdict(self)
        kwargs.pop("experimental_compiled_decode")
        return kwargs


@dataclass(frozen=True)
class VLLMEngineConfig:
    """``[rollouts.vllm]``: the vLLM engine (:class:`arpo_algo.rollout.engines.vllm.engine.VLLMEngine`)."""

    gpu_memory_utilization: float = setting(
        0.5, "GPU only: share of the GPU's memory vLLM may take (leave room for a colocated learner)."
    )
    kv_cache_gib: float = setting(1.0, "CPU only: GiB of RAM reserved for the KV cache, checked against free memory.")
    max_model_len: int | None = setting(
        None, "Context limit; None = the model's (capped at 8192 on CPU, where the KV cache is small)."
    )
    tensor_parallel_size: int = setting(1, "GPUs one engine spans (tensor parallelism).")
    enforce_eager: bool | None = setting(
        None,
        "True: no CUDA graphs or compilation; None = eager on CPU (compiling there starts slowly and was not "
        "faster), CUDA graphs on GPU.",
    )
    sleep_between_rollouts: bool = setting(
        False, "Free the engine's GPU memory during each learner update (vLLM sleep mode; CUDA/ROCm only)."
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = setting(
        "raw_logprobs", "Which log-probs vLLM reports: of the raw logits, or after temperature/top-k/top-p."
    )
    transport: Literal["auto", "shm", "bytes"] = setting(
        "auto",
        "How pushed weights reach the engine process: 'shm' (a safetensors file in /dev/shm), 'bytes' "
        "(inside the RPC; with LoRA the adapter folder is in the temp dir: pick it where /dev/shm is small) or "
        "'auto' (shm where /dev/shm exists).",
    )

    def validate(self) -> None:
        """Ranges."""
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"rollouts.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"rollouts.vllm.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"rollouts.vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"rollouts.vllm.max_model_len must be >= 2 or None, got {self.max_model_len}")

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's keyword arguments these settings give."""
        return asdict(self)
