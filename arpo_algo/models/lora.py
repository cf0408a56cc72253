"""Low-rank adapters (LoRA, on ``peft``): the ``[model.lora]`` settings, adapter folders tied to their base model,
loading and merging them.

**Training.** :func:`attach_adapter` injects LoRA layers into a plain Hugging Face causal LM in place (the module
stays a ``transformers`` model, so the learner, the tree forward and the in-process HF engine use it unchanged) and
freezes every other parameter: the base carries no gradient and so no optimizer state. The adapters run unmerged:
merging into the base weights and unmerging again is not bitwise reversible.

**KV reuse.** An engine holds one adapter at a time, so its stored KV (identical contexts, shared leading runs, the
prefix store) needs no adapter in its key: the in-process engine shares the learner's module and is told after every
update (``weights_updated``), an engine with its own copy drops its store on every ``load_state_dict``, adapter-only
or not; either way no prefix computed under one adapter is reused under another. An engine serving several adapters
at once (:mod:`arpo_algo.rollout.engines.hf.adapters`) keys its store by adapter as well.

**An adapter folder** (what a LoRA run's checkpoints and exported policy hold)::

    adapter_model.safetensors   the adapter tensors only (PEFT's key layout, so PeftModel.from_pretrained reads it)
    adapter_config.json         PEFT's LoRA config
    arpo_adapter.json           the base model's folder and the sha256 fingerprint of its weight files
    tokenizer files             the tokenizer the policy was trained with

Invariant: an adapter is only ever applied to the exact weights it was trained on. Every reader
(:func:`check_adapter_folder`) compares the base's fingerprint with the recorded one before loading anything, and a
folder without its config or marker is refused. The base of an adapter may itself be an adapter folder (RL after a
LoRA SFT): it is loaded and merged first, and its fingerprint covers the adapter and its own base.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.options import setting

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_MARKER",
    "ADAPTER_WEIGHTS",
    "DEFAULT_TARGETS",
    "LoraSettings",
    "PEFT_PREFIX",
    "adapter_base",
    "adapter_file_shapes",
    "adapter_settings",
    "adapter_shapes",
    "add_named_adapter",
    "attach_adapter",
    "check_adapter_folder",
    "check_adapter_tensors",
    "config_folder",
    "has_adapter",
    "is_adapter_folder",
    "linear_module_names",
    "linear_shapes",
    "load_adapter_weights",
    "load_into_learner",
    "load_policy_model",
    "merge_export",
    "prepare_base",
    "remove_named_adapter",
    "resolve_targets",
    "save_adapter",
    "weights_fingerprint",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: arpo's record of the adapter's base; its presence makes a folder an adapter folder.
ADAPTER_MARKER = "arpo_adapter.json"
#: The prefix PeftModel.save_pretrained puts before the module names (kept so plain PEFT reads our folders).
PEFT_PREFIX = "base_model.model."

_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Default target modules per architecture family (config.json ``model_type``): the attention and MLP projections.
#: Embeddings and the LM head are never adapted.
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    **{
        t: _LLAMA_LIKE
        for t in (
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "gemma",
            "gemma2",
            "gemma3_text",
            "olmo",
            "olmo2",
            "granite",
            "smollm3",
        )
    },
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}
#: Modules that stay frozen whatever target_modules says.
_NEVER = ("lm_head", "embed_tokens", "wte", "embed_out")


@dataclass(frozen=True)
class LoraSettings:
    """``[model.lora]``: train low-rank adapters instead of the full weights."""

    enabled: bool = setting(False, "Train LoRA adapters on a frozen base instead of every weight.")
    rank: int = setting(16, "Adapter rank r (>= 1).")
    alpha: float = setting(32.0, "LoRA alpha (> 0): the adapter's output is scaled by alpha / rank.")
    target_modules: tuple[str, ...] = setting(
        (),
        "Module names that get an adapter (last part of the name, e.g. 'q_proj'); empty: the architecture "
        "family's attention and MLP projections (docs/howto/lora.md#target-modules). Embeddings and LM head "
        "stay frozen.",
    )
    dropout: float = setting(
        0.0,
        "Dropout on the adapter's input. RL refuses it above 0 (the sampler and the learner must score the "
        "same function); SFT may use it.",
    )

    def validate(self, *, rl: bool = True, where: str = "[model.lora]") -> None:
        """Range checks (no model needed); ``rl``: refuse dropout (sampler and learner must score alike)."""
        if not self.enabled:
            changed = [
                f
                for f in ("rank", "alpha", "target_modules", "dropout")
                if getattr(self, f) != getattr(LoraSettings, f)
            ]
            if changed:
                raise ConfigError(
                    f"{where}: {', '.join(changed)} set but enabled = false: the adapter settings would do nothing",
                    hint="set model.lora.enabled = true, or remove them",
                )
            return
        if self.rank < 1:
            raise ConfigError(f"{where}: rank must be >= 1, got {self.rank}", hint="a typical rank is 8 to 64")
        if not self.alpha > 0:
            raise ConfigError(
                f"{where}: alpha must be > 0, got {self.alpha}", hint="alpha = 2 x rank is a common choice"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{where}: dropout must be in [0, 1), got {self.dropout}")
        if rl and self.dropout > 0:
            raise ConfigError(
                f"{where}: dropout = {self.dropout} in RL: the sampler scores without dropout and the "
                "learner would score with it, so the importance ratio and the mismatch alarm would "
                "compare two different policies",
                hint="dropout = 0 for RL (SFT may use it)",
            )
        bad = [t for t in self.target_modules if t in _NEVER]
        if bad:
            raise ConfigError(
                f"{where}: target_modules {bad} are embeddings or the LM head, which stay frozen",
                hint="adapt the attention and MLP projections (leave target_modules empty for the family default)",
            )

    def peft_config(self, targets: tuple[str, ...], base: str = "") -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(targets),
            lora_dropout=self.dropout,
            bias="none",
            base_model_name_or_path=base or None,
            # what PEFT's Auto classes read to pick the model class (AutoPeftModelForCausalLM refuses null)
            task_type="CAUSAL_LM",
        )


# ------------------------------------------------------------------------------------------------ architecture


#: Longest chain of adapters on adapters followed to a base model.
MAX_ADAPTER_CHAIN = 8


def _base_chain(path: Path) -> list[Path]:
    """``path`` and each base below it, down to the first folder that is not an adapter; a chain that comes back to
    a folder it has passed, or is longer than :data:`MAX_ADAPTER_CHAIN`, is a :class:`ConfigError` (the records are
    data someone wrote: following them may not hang or recurse without end)."""
    chain = [Path(path)]
    while is_adapter_folder(chain[-1]):
        base = Path(_read_marker(chain[-1])["base"])
        if base.resolve() in {p.resolve() for p in chain}:
            raise ConfigError(
                f"{chain[0]}: its chain of base models comes back to {base}",
                hint="each adapter's base must be another folder; fix arpo_adapter.json",
            )
        if len(chain) > MAX_ADAPTER_CHAIN:
            raise ConfigError(
                f"{chain[0]}: more than {MAX_ADAPTER_CHAIN} adapters on adapters before a base model",
                hint="export a merged model (arpo export --merge) and train on it",
            )
        chain.append(base)
    return chain


def config_folder(path: str | Path) -> Path:
    """The folder holding the model config: the base's for an adapter folder (through its chain of bases)."""
    return _base_chain(path)[-1]


def linear_shapes(model_path: str | Path) -> dict[str, tuple[int, int]]:
    """Every linear layer of the model by its module name, as ``(out_features, in_features)``, from its config alone
    (the skeleton is built on the meta device: no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_folder(Path(model_path)))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    shapes = {}
    for name, mod in skeleton.named_modules():
        if isinstance(mod, torch.nn.Linear):
            shapes[name] = (mod.out_features, mod.in_features)
        elif type(mod).__name__ == "Conv1D":  # GPT-2's linear layers keep their weight as (in, out)
            shapes[name] = (mod.weight.shape[1], mod.weight.shape[0])
    return shapes


def linear_module_names(model_path: str | Path) -> tuple[str, tuple[str, ...]]:
    """``(model_type, names)``: the last name part of every linear layer of the model, from its config alone."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(config_folder(Path(model_path))).model_type
    return model_type, tuple(sorted({name.rsplit(".", 1)[-1] for name in linear_shapes(model_path)}))


def adapter_shapes(
    linear: dict[str, tuple[int, int]], targets: tuple[str, ...] | list[str], rank: int
) -> dict[str, tuple[int, int]]:
    """The complete tensor set of a plain-LoRA adapter under PEFT's saved key names: for each linear layer whose
    last name part is a target, ``lora_A`` of shape (rank, in) and ``lora_B`` of shape (out, rank). ``linear`` is
    :func:`linear_shapes` of the base."""
    out = {}
    for name, (fan_out, fan_in) in linear.items():
        # PEFT's rule for a list of names: a module is adapted when its name is a target or ends in "." + target
        if name.rsplit(".", 1)[-1] not in _NEVER and any(name == t or name.endswith("." + t) for t in targets):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (int(rank), fan_in)
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (fan_out, int(rank))
    return out


def check_adapter_tensors(
    shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, int]], what: str, hint: str
) -> None:
    """A :class:`ConfigError` naming the first tensors of ``shapes`` (name -> shape) that are not in ``expected``
    (:func:`adapter_shapes`), have another shape, or are missing from it: an adapter is exactly its expected set."""
    unknown = [f"{k} {tuple(v)}" for k, v in shapes.items() if k not in expected]
    wrong = [
        f"{k} {tuple(v)} (expected {expected[k]})"
        for k, v in shapes.items()
        if k in expected and tuple(v) != expected[k]
    ]
    missing = [k for k in expected if k not in shapes]
    if unknown or wrong or missing or not expected:
        parts = [
            f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
            for label, items in (("unknown tensors", unknown), ("wrong shapes", wrong), ("missing", missing))
            if items
        ] or ["no adapter tensors expected for these target modules"]
        raise ConfigError(f"{what} ({'; '.join(parts)})", hint=hint)


def adapter_file_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an adapter folder's weights file, read from its safetensors header (no
    tensor is loaded); an unreadable file is a :class:`ConfigError`."""
    from safetensors import safe_open

    file = Path(path) / ADAPTER_WEIGHTS
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
        raise ConfigError(f"{file} cannot be read as safetensors: {e}", hint="the folder is damaged") from None


def resolve_targets(lora: LoraSettings, model_path: str | Path) -> tuple[str, ...]:
    """The target modules for ``model_path``: the given ones, each checked to exist, or the family default.

    Raises:
        ConfigError: a name the model has no linear layer of (the ones it has are named), or a family without a
            default and no target_modules given.
    """
    model_type, names = linear_module_names(model_path)
    adaptable = tuple(n for n in names if n not in _NEVER)
    targets = lora.target_modules or DEFAULT_TARGETS.get(model_type, ())
    if not targets:
        raise ConfigError(
            f"[model.lora]: no default target modules for model_type {model_type!r}",
            hint=f"set model.lora.target_modules to some of its linear layers: {', '.join(adaptable)}",
        )
    missing = [t for t in targets if t not in adaptable]
    if missing:
        raise ConfigError(
            f"[model.lora]: target_modules {missing} are not linear layers of this {model_type} model",
            hint=f"its linear layers are: {', '.join(adaptable)}",
        )
    return tuple(targets)


def prepare_base(lora: LoraSettings, model_path: str | Path) -> tuple[tuple[str, ...], str]:
    """What a LoRA learner checks before loading any weight: the settings (as RL settings: every learner trains
    against a sampler that scores without dropout, however it was built), the target modules (from the config) and,
    for an adapter folder as base, that folder against its own base. Returns ``(targets, base fingerprint)``."""
    lora.validate(rl=True, where="[model.lora]")
    targets = resolve_targets(lora, model_path)
    if is_adapter_folder(model_path):
        check_adapter_folder(model_path)
    return targets, weights_fingerprint(model_path)


def load_pretrained_into(model: Any, path: str | Path) -> None:
    """Copy the weights of an HF folder into ``model`` in place (modules shared with an engine see them)."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        model.load_state_dict(saved.state_dict())
    del saved


def load_into_learner(learner: Any, path: str | Path) -> None:
    """Load a policy folder a learner wrote into ``learner.model``, in place (a shared engine sees it): full weights,
    or with LoRA the adapter, after checking it was trained on the learner's base (``learner.base_fingerprint``)."""
    if learner.lora is None:
        if is_adapter_folder(path):
            raise ConfigError(
                f"{path} holds a LoRA adapter but this learner trains full weights",
                hint="resume with the run's [model.lora] settings (enabled = true)",
            )
        load_pretrained_into(learner.model, path)
        return
    if not is_adapter_folder(path):
        raise ConfigError(
            f"{path} holds full weights but this learner trains a LoRA adapter",
            hint="resume with the run's own settings, or start a new run from that folder",
        )
    check_adapter_folder(path, expected_fingerprint=learner.base_fingerprint)
    load_adapter_weights(learner.model, Path(path))


# ------------------------------------------------------------------------------------------------ fingerprints


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(path: str | Path) -> str:
    """sha256 over the weight files of a model folder (name and content of each ``*.safetensors`` / ``*.bin``);
    for an adapter folder, over its adapter file and its base's fingerprint."""
    path = Path(path)
    h = hashlib.sha256()
    if is_adapter_folder(path):
        h.update(f"adapter:{_file_sha256(path / ADAPTER_WEIGHTS)};base:{_read_marker(path)['fingerprint']}".encode())
        return h.hexdigest()
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
    if not files:
        raise ConfigError(
            f"{path} holds no weight files (*.safetensors or *.bin)", hint="pass a Hugging Face model folder"
        )
    for f in files:
        h.update(f"{f.name}:{_file_sha256(f)};".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ folders


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` is an adapter folder (arpo's marker, or PEFT's adapter files without it)."""
    path = Path(path)
    return (path / ADAPTER_MARKER).is_file() or (path / ADAPTER_CONFIG).is_file() or (path / ADAPTER_WEIGHTS).is_file()


def _read_marker(path: Path) -> dict[str, Any]:
    marker = path / ADAPTER_MARKER
    if not marker.is_file():
        raise ConfigError(
            f"{path} is an adapter folder without {ADAPTER_MARKER} (the record of its base model)",
            hint="arpo only applies an adapter to the base it was trained on; use a folder a LoRA "
            "run wrote, or merge the adapter with PEFT yourself",
        )
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{marker} is not valid JSON: {e}", hint="the folder is damaged") from e
    if not isinstance(data, dict) or not {"base", "fingerprint"} <= set(data):
        raise ConfigError(f"{marker} lacks 'base' or 'fingerprint'", hint="the folder is damaged")
    return data


def check_adapter_folder(path: str | Path, *, expected_fingerprint: str | None = None) -> dict[str, Any]:
    """Everything checked before an adapter folder loads: its weights and config are there, its base exists and has
    the recorded fingerprint (``expected_fingerprint``: the base a resumed run trains must be this one too).
    Returns the marker's record.

    Raises:
        ConfigError: a missing file, a missing base, or a base whose weights are not the ones the adapter was
            trained on.
    """
    path = Path(path)
    info = _read_marker(path)
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (path / name).is_file():
            raise ConfigError(
                f"{path} is an adapter folder without {name}", hint="the folder is incomplete; copy the whole folder"
            )
    base = Path(info["base"])
    if not base.is_dir():
        raise ConfigError(
            f"{path}: its base model {base} does not exist",
            hint="put the base model back at that path, or export a merged model where it exists (arpo export --merge)",
        )
    if is_adapter_folder(base):
        _base_chain(path)  # a cycle or an endless chain is refused before the recursion follows it
        check_adapter_folder(base)
    have = weights_fingerprint(base)
    if have != info["fingerprint"]:
        raise ConfigError(
            f"{path}: the base model at {base} is not the one the adapter was trained on (weights "
            f"fingerprint {have[:12]}..., the adapter records {info['fingerprint'][:12]}...)",
            hint="restore the original base weights; an adapter on other weights is another model",
        )
    if expected_fingerprint is not None and expected_fingerprint != info["fingerprint"]:
        raise ConfigError(
            f"{path}: the adapter was trained on another base than this run's model "
            f"({info['fingerprint'][:12]}... vs {expected_fingerprint[:12]}...)",
            hint="resume with the model.path the run was started with",
        )
    return info


def has_adapter(model: Any) -> bool:
    """Whether ``model`` holds injected LoRA layers."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def attach_adapter(model: Any, lora: LoraSettings, targets: tuple[str, ...], base: str = "") -> Any:
    """Inject a fresh adapter into ``model`` in place (``lora_B`` starts at 0: the output is unchanged) and freeze
    every other parameter. Returns ``model``."""
    from peft import inject_adapter_in_model

    model.requires_grad_(False)
    inject_adapter_in_model(lora.peft_config(targets, base), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def adapter_state(model: Any, adapter_name: str = "default") -> dict[str, Any]:
    """The tensors of one adapter (detached, on CPU) under PEFT's saved key names."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    return {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()}


def save_adapter(model: Any, out: Path, *, base: Path, fingerprint: str) -> Path:
    """Write ``model``'s adapter folder (weights, PEFT config, base record) into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = str(base)
    config["target_modules"] = sorted(config["target_modules"])
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, default=list), encoding="utf-8")
    (out / ADAPTER_MARKER).write_text(
        json.dumps({"base": str(base), "fingerprint": fingerprint}, indent=1), encoding="utf-8"
    )
    return out


def load_adapter_weights(model: Any, path: Path, adapter_name: str = "default") -> None:
    """Copy an adapter folder's tensors into ``model``'s injected adapter ``adapter_name``, in place; every key must
    match."""
    import torch
    from safetensors.torch import load_file

    saved = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    own = adapter_state(model, adapter_name)
    if set(saved) != set(own) or any(saved[k].shape != own[k].shape for k in own):
        raise ConfigError(
            f"{path}: the adapter's tensors do not match this model's adapter (another rank or other target modules)",
            hint="use the same [model.lora] settings the adapter was trained with",
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in saved.items():
            name = key[len(PEFT_PREFIX) :]
            stem, _, leaf = name.rpartition(".")
            params[f"{stem}.{adapter_name}.{leaf}"].copy_(value)


#: Adapter config keys whose value arpo reads or that do not change the loaded function (naming, bookkeeping,
#: initialisation of a new adapter, dropout at training time). Any other key must hold its neutral value (false,
#: null, empty, or PEFT's fixed default below): a rank pattern, rsLoRA scaling, DoRA, layer selection and the like
#: change what the adapter computes, and arpo applies plain LoRA only.
_LORA_READ_KEYS = {
    "r",
    "lora_alpha",
    "target_modules",
    "lora_dropout",
    "peft_type",
    "peft_version",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "init_lora_weights",
    "auto_mapping",
}
_LORA_FIXED_DEFAULTS = {"bias": "none", "megatron_core": "megatron.core", "qalora_group_size": 16}


def _lora_from_folder(path: Path) -> tuple[LoraSettings, tuple[str, ...]]:
    """The adapter's plain-LoRA settings from its config, refusing (:class:`ConfigError`) any key arpo would not
    apply, so a loaded adapter is never a different function than the one PEFT would load."""
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / ADAPTER_CONFIG} cannot be read: {e}", hint="the folder is damaged") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path / ADAPTER_CONFIG} is not a JSON object", hint="the folder is damaged")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing or cfg.get("peft_type", "LORA") != "LORA":
        why = f"missing {', '.join(missing)}" if missing else f"peft_type {cfg.get('peft_type')!r}"
        raise ConfigError(
            f"{path}: not a LoRA adapter config ({why})", hint="arpo loads LoRA adapters written by PEFT or by arpo"
        )
    for key, value in cfg.items():
        if key in _LORA_READ_KEYS or value in (None, False, [], {}, "") or _LORA_FIXED_DEFAULTS.get(key) == value:
            continue
        raise ConfigError(
            f"{path}: the adapter uses {key} = {value!r}, which arpo does not apply",
            hint="merge it with PEFT into a plain model folder first",
        )
    try:
        lora = LoraSettings(
            enabled=True,
            rank=int(cfg["r"]),
            alpha=float(cfg["lora_alpha"]),
            target_modules=tuple(cfg["target_modules"]),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{path / ADAPTER_CONFIG}: r, lora_alpha or target_modules has the wrong type ({e})",
            hint="the folder is damaged",
        ) from None
    return lora, lora.target_modules


def adapter_settings(path: str | Path) -> tuple[LoraSettings, tuple[str, ...]]:
    """An adapter folder's plain-LoRA settings (rank, alpha) and target modules, read from its config; any key arpo
    would not apply is a :class:`ConfigError`."""
    return _lora_from_folder(Path(path))


def add_named_adapter(model: Any, path: str | Path, name: str, *, fingerprint: str) -> None:
    """Load the adapter folder ``path`` into ``model`` (a plain base model, or one holding other named adapters)
    under ``name``, beside the others: a model serving several agents on one base. ``fingerprint`` is the
    fingerprint of the weights ``model`` was loaded from; an adapter trained on other weights is refused.

    Raises:
        ConfigError: the folder's record names another base (both fingerprints named), or its files are incomplete
            or of a layout arpo does not load; nothing is added then.
    """
    from peft import inject_adapter_in_model

    path = Path(path)
    info = _read_marker(path)
    if info["fingerprint"] != fingerprint:
        raise ConfigError(
            f"{path}: the adapter was trained on the base with weights fingerprint "
            f"{info['fingerprint'][:12]}..., not on this engine's base ({fingerprint[:12]}...)",
            hint="serve adapters of another base in their own deployment, or merge it first "
            "(arpo export --merge) and serve the merged folder as a full-weight agent",
        )
    lora, targets = _lora_from_folder(path)
    with warnings.catch_warnings():  # PEFT warns that the model holds several adapters: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        inject_adapter_in_model(lora.peft_config(targets, info["base"]), model, adapter_name=name)
    try:
        load_adapter_weights(model, path, name)
    except BaseException:
        remove_named_adapter(model, name)  # nothing half-loaded stays in the model
        raise
    model.requires_grad_(False)


def remove_named_adapter(model: Any, name: str) -> None:
    """Delete the adapter ``name`` from every LoRA layer of ``model`` (the base and the other adapters stay)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.delete_adapter(name)
    getattr(model, "peft_config", {}).pop(name, None)


def adapter_base(path: str | Path) -> dict[str, Any]:
    """An adapter folder's record of its base (``{"base": folder, "fingerprint": sha256}``), checked: its files
    are there and the base's weights are the recorded ones. Also ``rank`` (the adapter's r)."""
    info = dict(check_adapter_folder(path))
    info["rank"] = _lora_from_folder(Path(path))[0].rank
    return info


def load_policy_model(
    path: str | Path, *, dtype: Any, merge: bool = False, checked: bool = False, no_dropout: bool = False, **load: Any
) -> Any:
    """A policy as a ``transformers`` model: a plain folder as is; an adapter folder as its base (checked against the
    fingerprint first, loaded recursively and merged when it is itself an adapter) with the adapter applied,
    unmerged unless ``merge``. ``no_dropout``: every dropout rate of the (base) config set to 0
    (:mod:`arpo_algo.models.dropout`). ``load``: more ``from_pretrained`` arguments (attn_implementation)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not is_adapter_folder(path):
        if no_dropout:
            from arpo_algo.models.dropout import config_without_dropout

            load = {**load, "config": config_without_dropout(path)}
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load)
    info = _read_marker(path) if checked else check_adapter_folder(path)
    lora, targets = _lora_from_folder(path)
    model = load_policy_model(info["base"], dtype=dtype, merge=True, checked=True, no_dropout=no_dropout, **load)
    attach_adapter(model, lora, targets, info["base"])
    load_adapter_weights(model, path)
    model.requires_grad_(False)
    if merge:
        model = _merge(model)
    return model


def _merge(model: Any) -> Any:
    """``model`` with its adapter merged into the base weights and the LoRA layers removed (a plain model)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def merge_export(src: str | Path, out: str | Path) -> Path:
    """Write the adapter folder ``src`` merged into its base as a plain Hugging Face folder ``out`` (must not exist or
    be empty): the base checked first, nothing written on a refusal."""
    import torch
    from transformers import AutoTokenizer

    src, out = Path(src), Path(out)
    if not is_adapter_folder(src):
        raise ConfigError(
            f"{src} is not an adapter folder (no {ADAPTER_MARKER})",
            hint="a LoRA run's checkpoint policy/ or exported policy holds one; a plain model folder needs no merge",
        )
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty", hint="pick a new output folder")
    check_adapter_folder(src)
    model = load_policy_model(src, dtype=torch.float32, merge=True, checked=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    for extra in ("arpo_policy.json",):
        if (src / extra).is_file():
            (out / extra).write_bytes((src / extra).read_bytes())
    return out
