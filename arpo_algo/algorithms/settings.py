"""Every setting of every variant: one dataclass per experiment-file section, held together by :class:`Settings`.

=================  ======================================================  ==========================================
section            dataclass (defined, and validated, in its own room)      receives it as it is
=================  ======================================================  ==========================================
``[model]``        :class:`ModelConfig`                                     the learner and engine builders
``[tree]``         :class:`arpo_algo.core.tree.TreeConfig`                  the tree sampler
``[training]``     :class:`arpo_algo.train.learner_config.TrainingConfig`   the learner
``[backend]``      :class:`arpo_algo.train.backend_config.BackendConfig`    the learner backend factory
``[rollouts]``     :class:`arpo_algo.rollout.config.RolloutsConfig`         the sampler and the engine factory
``[rollouts.hf]``  :class:`arpo_algo.rollout.engines.config.HFEngineConfig`    the HF engine
``[rollouts.vllm]`` :class:`arpo_algo.rollout.engines.config.VLLMEngineConfig` the vLLM engine
``[evaluation]``   :class:`arpo_algo.eval.config.EvaluationConfig`          held-out evaluation
=================  ======================================================  ==========================================

One name per setting everywhere: the dotted name ``section.key`` (``tree.tau``, ``rollouts.hf.decode``) is the
experiment file's key, the ``--set`` override, the sweep knob, the key of the RLlib config dict Tune passes around,
and the attribute path ``config.settings.tree.tau``. Unknown keys fail with the closest valid name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from arpo_algo.algorithms.variants import VARIANT_DEFAULTS, VARIANTS
from arpo_algo.core.tree import TreeConfig
from arpo_algo.eval.config import EvaluationConfig
from arpo_algo.models.lora import LoraSettings, is_adapter_folder
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.learner_config import TrainingConfig
from arpo_base.errors import ConfigError
from arpo_base.options import dataclass_rows, setting, unknown_key_error, update_dataclass

__all__ = ["RECORDS_INERT", "SECTIONS", "VARIANT_DEFAULTS", "ModelConfig", "Settings", "check_records", "setting_rows"]


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: the policy to train."""

    path: str | None = setting(
        None, "Policy to train: a local Hugging Face folder or a registered name (`arpo model list`). Required."
    )
    lora: LoraSettings = field(
        default_factory=LoraSettings, metadata={"doc": "[model.lora]: train low-rank adapters on the frozen base."}
    )


#: The sections of :class:`Settings`, in experiment-file order.
SECTIONS = ("model", "tree", "training", "backend", "rollouts", "evaluation")


@dataclass(frozen=True)
class Settings:
    """All sections together (immutable: :meth:`update` returns a new object)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    @classmethod
    def for_variant(cls, variant: str) -> Settings:
        """The defaults of one registered algorithm (:mod:`arpo_algo.algorithms.variants`): its ``tree.mode`` (the
        algorithm, not a setting) and its preset."""
        if variant not in VARIANTS:
            raise unknown_key_error(variant, tuple(VARIANTS), "Settings.for_variant", what="algorithm")
        v = VARIANTS[variant]
        return cls(tree=TreeConfig(mode=v.tree_mode)).update(v.defaults, f"{variant} preset")

    def update(
        self, values: Mapping[str, Any], where: str = "settings", *, placeholder: Callable[[Any], bool] | None = None
    ) -> Settings:
        """A copy with ``values`` applied: dotted names (``{"tree.tau": 0.5, "rollouts.hf.decode": "static"}``) or
        section tables (``{"tree": {"tau": 0.5}}``), keys and types checked (``placeholder``: see
        :func:`arpo_base.options.update_dataclass`)."""
        tables: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            section, _, rest = str(key).partition(".")
            if section not in SECTIONS:
                raise unknown_key_error(key, SECTIONS, where, what="section")
            table = tables.setdefault(section, {})
            if not rest:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{where}: {section!r} is a section: give a table or {section}.<key>")
                _merge(table, value)
            else:
                _merge(table, _nest(rest, value))
        changes = {}
        for section, table in tables.items():
            if section == "tree" and "mode" in table:
                raise ConfigError(
                    f"{where}: tree.mode is the algorithm, not a setting",
                    hint="pick it with [experiment] algorithm = "
                    + " | ".join(f'"{n}"' for n in VARIANTS or ("arpo",))
                    + " (or its config class, e.g. ARPOConfig)",
                )
            changes[section] = update_dataclass(
                getattr(self, section), table, f"{where}: [{section}]", placeholder=placeholder
            )
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict[str, Any]:
        """Every setting by dotted name (``tree.mode`` excluded: it is the algorithm)."""
        out = {}
        for section in SECTIONS:
            for name, _, _, _ in dataclass_rows(type(getattr(self, section)), f"{section}."):
                if name != "tree.mode":
                    out[name] = _lookup(self, name)
        return out

    def sections(self) -> dict[str, dict[str, Any]]:
        """Every section as a (nested) dict, for config.json and reports."""
        out = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        out["tree"].pop("mode")
        return out

    def validate(self) -> None:
        """Each section's own checks, then the checks across sections."""
        if self.model.path is None:
            raise ConfigError(
                "model.path is not set",
                hint="[model] path = <HF folder or registered name>, or config.training(model_path=...)",
            )
        engine = self.rollouts.engine_spec
        caps = engine.capabilities
        if self.model.lora.enabled:
            engine.lora_rank(self.model.lora.rank)  # a rank the engine cannot serve, refused naming the ones it can
        if not caps.loads_adapter_folders and isinstance(self.model.path, str) and is_adapter_folder(self.model.path):
            # Invariant: the engine samples from the weights the learner starts from; the learner merges an adapter
            # folder into its base, which this engine cannot load as a model, so this is refused before the learner
            # loads.
            raise ConfigError(
                f"model.path {self.model.path} is a LoRA adapter folder, which the {engine.title} engine cannot "
                "load as its model",
                hint="merge it first (arpo export --merge <folder> --output "
                "<merged>) and train from the merged folder, or use "
                "rollouts.engine = 'hf'",
            )
        self.model.lora.validate(rl=True, where="[model.lora]")
        if self.model.lora.enabled:
            _check_lora(self)
        self.tree.validate()
        self.training.validate()
        self.backend.validate()
        self.rollouts.validate()
        self.evaluation.validate()
        self.backend.check_device(self.rollouts.device)
        # a records run grows no tree: its engine (evaluation's) takes the estimator it has (AgenticRLAlgorithm)
        if not caps.full_entropy and self.tree.entropy_method != "topk_sum_lnV" and self.training.records is None:
            raise ConfigError(
                f"rollouts.engine={engine.name!r} with tree.entropy_method={self.tree.entropy_method!r}: "
                f"{engine.title} returns only top-k logprobs, so the full entropy is not available",
                hint="tree.entropy_method = 'topk_sum_lnV' (the reference estimator), or engine 'hf'",
            )
        rollouts = self.rollouts
        if (
            caps.shares_module
            and rollouts.num_rollout_actors == 0
            and not self.backend.distributed
            and rollouts.dtype != "float32"
        ):
            # Invariant: the in-process HF engine over the local learner samples from the very module the learner
            # trains (no copy, no push), and that module is float32. A ddp/deepspeed learner keeps its modules in
            # its rank actors, so there the in-process engine loads its own copy, in any dtype, and gets rank 0's
            # weights pushed after each update.
            raise ConfigError(
                f"rollouts.dtype={rollouts.dtype!r} with in-process rollouts and the local learner: the "
                "in-process HF engine shares the learner's float32 module, so it cannot run in "
                "another dtype",
                hint="keep dtype = 'float32' (training.precision sets the learner's compute precision),"
                " or give the engine its own copy: rollout actors (num_rollout_actors > 0), "
                "engine = 'vllm', or backend.learner_backend = 'ddp' / 'deepspeed'",
            )
        cap = caps.max_logprobs
        if cap is not None and self.tree.topk_logprobs > cap:
            # Invariant: every rollout request can be served; an engine (vLLM) refuses a request for more top
            # logprobs than the max_logprobs it was built with, which would fail the first rollout after the model
            # loaded.
            raise ConfigError(
                f"tree.topk_logprobs={self.tree.topk_logprobs} is more than the {engine.title} engine returns: "
                f"it is built with at most {cap} logprobs per token",
                hint=f"lower tree.topk_logprobs to at most {cap} (the reference uses 10),"
                " or use rollouts.engine = 'hf' (up to the whole vocabulary)",
            )
        if self.rollouts.asynchronous:
            _check_asynchronous(self)
        _check_ratio_options(self)


#: Why each setting outside ``[tree]`` does nothing in a run that trains on recorded episodes (``training.records``):
#: the settings that shape only the trajectories the run samples itself. The rest of ``[rollouts]`` still acts there:
#: the engine, its resources and ``[rollouts.hf]``/``[rollouts.vllm]``, ``max_response_tokens``, ``tool_workers`` and
#: ``prompt_overflow`` run the evaluation, the ``record_*`` settings write the trees of the episodes trained on.
_SAMPLED = "the server sampled them, and records its sampling settings with each turn"
RECORDS_INERT = {
    "rollouts.temperature": _SAMPLED,
    "rollouts.top_p": _SAMPLED,
    "rollouts.top_k": _SAMPLED,
    "rollouts.train_tool_limit_eos": "the server records which tokens are trained (each reply's trained mask)",
    "rollouts.asynchronous": "there are no rollouts to run in the background",
    "rollouts.max_staleness": "there are no rollouts to run in the background",
    "training.dynamic_sampling_max_rounds": "there are no sampling rounds",
}


def check_records(settings: Settings, defaults: Settings) -> None:
    """Invariant: a run that trains on recorded episodes accepts no setting that only shapes the trajectories it would
    sample itself, so every setting it accepts acts. ``defaults`` are the variant's (its preset included), so what is
    refused is what the user set: any ``[tree]`` setting (no tree is grown) and those of :data:`RECORDS_INERT`."""
    if settings.training.records is None:
        return
    tree = {f"tree.{f.name}": "no sampling tree is grown" for f in dataclasses.fields(TreeConfig) if f.name != "mode"}
    for name, why in {**tree, **RECORDS_INERT}.items():
        value, default = _lookup(settings, name), _lookup(defaults, name)
        if value != default:
            raise ConfigError(
                f"{name} = {json.dumps(value)} does nothing with training.records: the recorded episodes are "
                f"trained as they were served ({why})",
                hint=f"drop {name} from the experiment file or the --set (its default is {json.dumps(default)}), "
                "or drop training.records",
            )


def _check_lora(settings: Settings) -> None:
    """LoRA across sections. Invariant: every engine samples with the adapter the learner trains: the in-process HF
    engine shares the learner's module, HF rollout actors build the same adapter layout and get adapter-only syncs,
    a vLLM engine serves the base under a LoRA request refilled by every adapter-only sync (so the rank must be one
    vLLM can serve). DDP ranks each build it from the same seed and sum the adapter's gradients. Every path that would
    need another way to hold the adapter (DeepSpeed's partitioned ranks) or runs a step not checked with it (the
    fixed-shape decoders) is refused until it does."""
    r, b = settings.rollouts, settings.backend
    refusals = [
        (
            b.learner_backend == "deepspeed",
            "backend.learner_backend = 'deepspeed' (its ZeRO partitioning is not wired to the adapter yet)",
            "use learner_backend = 'local' or 'ddp'",
        ),
        (
            r.hf.decode in ("static", "cuda_graph", "compiled"),
            f"rollouts.hf.decode = {r.hf.decode!r} (the fixed-shape decode step does not apply adapters)",
            "use decode = 'dynamic' or 'auto'",
        ),
    ]
    for refused, what, hint in refusals:
        if refused:
            raise ConfigError(f"model.lora.enabled with {what}", hint=hint)


def _check_ratio_options(settings: Settings) -> None:
    """Invariant: no option that acts only through the importance ratio is accepted where the ratio is identically 1.
    With one optimizer step per iteration (``ppo_epochs x mini_batches == 1``), old log-probs recomputed by the
    weights being updated, and no stale batch, the ratio of every token is exactly 1 at that step, so the clip bounds
    and the entropy-balanced clip change nothing: the weights come out bit-identical with them on or off."""
    t, r = settings.training, settings.rollouts
    stale = r.asynchronous and r.max_staleness > 0
    if t.ppo_epochs * t.mini_batch_count != 1 or t.old_logprobs != "recompute" or stale:
        return
    defaults = TrainingConfig()
    inert = []
    if t.entropy_balanced_clip:
        inert.append("training.entropy_balanced_clip = true")
    if t.clip_high != t.clip_low:
        inert.append(f"training.clip_high = {t.clip_high} (clip-higher: unlike clip_low = {t.clip_low})")
    if t.clip_c != defaults.clip_c:
        inert.append(f"training.clip_c = {t.clip_c} (the dual clip's bound)")
    if inert:
        raise ConfigError(
            f"{'; '.join(inert)} would do nothing: with training.ppo_epochs x training.mini_batches = 1,"
            " old log-probs recomputed and no stale batch, the ratio is exactly 1, so no clip acts",
            hint=f"take several optimizer steps per batch: training.mini_batches = "
            f"{min(8, t.prompts_per_step)} (at most prompts_per_step), or training.ppo_epochs "
            "> 1; or remove the option",
        )


def _check_asynchronous(settings: Settings) -> None:
    """Asynchronous rollouts across sections: each refusal is a combination whose invariant the pipeline cannot keep
    (a batch is drawn before the update it overlaps, and scored under the version that sampled it)."""
    if settings.training.dynamic_sampling:
        raise ConfigError(
            "rollouts.asynchronous with training.dynamic_sampling: dynamic sampling decides after a "
            "round whether to draw more prompts, so the next batch's prompts are not known before the "
            "update it would overlap",
            hint="turn one of them off",
        )
    if settings.backend.distributed:
        raise ConfigError(
            f"rollouts.asynchronous with backend.learner_backend={settings.backend.learner_backend!r}:"
            " a stale batch is scored under the weights that sampled it, which only the local learner "
            "can swap in",
            hint="use learner_backend = 'local', or asynchronous = false",
        )


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nest(rest, value) if rest else value}


def _merge(into: dict[str, Any], values: Mapping[str, Any]) -> None:
    """Merge ``values`` into ``into``; a dotted key (``"hf.decode"``) lands in the sub-table it names."""
    for key, value in values.items():
        if "." in str(key):
            head, _, rest = str(key).partition(".")
            _merge(into, {head: _nest(rest, value)})
            continue
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def setting_rows() -> list[tuple[str, Any, Any, dataclasses.Field]]:
    """``(dotted name, type, default, field)`` of every setting: the registry the settings reference is made from."""
    rows = []
    for f in dataclasses.fields(Settings):
        rows += [r for r in dataclass_rows(type(f.default_factory()), f"{f.name}.") if r[0] != "tree.mode"]
    return rows
