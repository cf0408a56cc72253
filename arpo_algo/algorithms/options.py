"""The settings of ARPOConfig (and AEPO/GRPO): every option with its default, type and meaning, and their checks.

RLlib and Tune require an :class:`~ray.rllib.algorithms.algorithm_config.AlgorithmConfig`, so that is where every
setting lives. The knobs come in four groups, each with its own setter:

* ``.training(...)``: the model and the learner. Every field of :class:`arpo_algo.train.learner.LearnerConfig` (``lr`` and
  ``grad_clip`` reuse RLlib's fields of the same name), of :class:`arpo_algo.train.backend_config.BackendConfig`
  (``learner_backend``, ``learner_workers``, ...) plus ``model_path`` and ``prompts_per_step``.
* ``.tree(...)``: branching. Every field of :class:`arpo_algo.core.tree.TreeConfig` except ``mode``, which is the
  algorithm (ARPO, AEPO or GRPO: pick the config class).
* ``.llm_rollouts(...)``: sampling, engine and resources (:data:`ROLLOUT_OPTIONS`).
* ``.evaluation(...)``: RLlib's ``evaluation_interval`` plus the held-out protocol (:data:`EVAL_OPTIONS`).

The environment is RLlib's standard ``.environment(env="arpo/ToolMath-v0", env_config={...})``.

The tree and learner fields are *derived* from the TreeConfig/LearnerConfig dataclasses (names, defaults, types and
documentation live there, once). Strictness: unknown keys are rejected in every setter and in
:meth:`ARPOConfig.update_from_dict` (the path Tune uses, which RLlib leaves permissive), naming the key and the
closest valid name; wrong types are rejected; :meth:`ARPOConfig.validate` explains illegal combinations.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any, Literal

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

from arpo_algo.core.tree import TreeConfig
from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.learner import LearnerConfig
from arpo_base.options import check_type, unknown_key_error

__all__ = ["ALL_OPTIONS", "BACKEND_OPTIONS", "EVAL_OPTIONS", "LEARNER_OPTIONS", "OWN_OPTIONS", "ROLLOUT_OPTIONS", "TRAINING_OPTIONS",
           "TREE_OPTIONS", "Option", "check_value", "unknown_key_error"]

#: Keys RLlib's update_from_dict sends through .training() (see there).
_RLLIB_TRAINING_DICT_KEYS = ("model", "optimizer", "replay_buffer_config")
#: Learner fields stored in RLlib's own AlgorithmConfig attributes of the same name.
SHARED_WITH_RLLIB = ("lr", "grad_clip")


@dataclasses.dataclass(frozen=True)
class Option:
    """One ARPOConfig field that is not a TreeConfig/LearnerConfig field: name, default, type and meaning."""

    name: str
    default: Any
    hint: Any
    doc: str


TRAINING_OPTIONS: tuple[Option, ...] = (
    Option("model_path", None, str | None,
           "Policy to train: a local Hugging Face folder or a registered name (`arpo model list`). Required."),
    Option("prompts_per_step", 4, int,
           "Prompts per training iteration; each yields one group of `budget` trajectories (reference: 128)."),
    Option("dynamic_sampling", False, bool,
           "DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the batch "
           "is full (arpo_algo.algorithms.stabilizers). Off: the paper's/reference's behaviour."),
    Option("dynamic_sampling_max_rounds", 3, int, "Cap of sampling rounds per iteration with dynamic_sampling."),
)

ROLLOUT_OPTIONS: tuple[Option, ...] = (
    Option("engine", "hf", Literal["hf", "vllm"],
           "Rollout engine (arpo_algo.rollout.engines.build_engine): 'hf' (transformers, CPU or GPU) or 'vllm' (vLLM "
           "0.29 on CPU via scripts/install_vllm_cpu or on GPU; needs tree entropy_method='topk_sum_lnV'). Eval uses the same engine."),
    Option("num_rollout_actors", 0, int,
           "0: generate in-process (engine='hf' shares the learner's module; no Ray cluster). "
           ">0: that many Ray actors, each with its own engine copy; weights are broadcast after every update."),
    Option("num_cpus_per_rollout_actor", 1.0, float, "CPUs reserved per rollout actor (counts in the Tune trial)."),
    Option("device", "cpu", Literal["cpu", "cuda"], "Where the learner and the in-process engine run."),
    Option("dtype", "float32", Literal["float32", "bfloat16"], "Engine compute dtype."),
    Option("max_batch_size", 16, int, "Most sequences the engine decodes at once."),
    Option("linear_layout", "auto", Literal["auto", "native", "transposed"],
           "Engine weight layout for nn.Linear: 'transposed' decodes through (in, out) copies of the weights, "
           "1.3-1.5x faster per decoding step on CPU for one more copy of them; 'auto' = transposed on CPU, native "
           "on GPU."),
    Option("decode", "auto", Literal["auto", "dynamic", "static", "cuda_graph"],
           "How engine='hf' decodes (arpo_algo/rollout/engines/static_decode.py): 'dynamic' (left-padded growing KV "
           "cache), 'static' (fixed-shape steps over a preallocated [max_batch_size, static_cache_tokens] KV cache, "
           "same results), 'cuda_graph' (those steps captured and replayed as CUDA graphs; device='cuda' only); "
           "'auto' = cuda_graph on CUDA when the model supports it, else dynamic."),
    Option("static_cache_tokens", None, int | None,
           "Tokens per sequence of the static KV cache (decode='static'/'cuda_graph'); it becomes the engine's "
           "context limit. None = the model's max_position_embeddings."),
    Option("temperature", 1.0, float, "Sampling temperature for training rollouts (reference: 1.0)."),
    Option("top_p", 1.0, float, "Nucleus mass for training rollouts (1.0 = off; reference: 1.0)."),
    Option("top_k", -1, int, "Top-k for training rollouts (-1 = off; reference: -1)."),
    Option("max_response_tokens", 512, int,
           "Response budget per trajectory (generated plus tool-result tokens), enforced per request "
           "(ARPO_SPEC §10.21; the reference shares one max_tokens per generation round)."),
    Option("tool_workers", 8, int, "Threads that run tool calls concurrently during rollouts."),
    Option("prompt_overflow", "error", Literal["error", "left_truncate"],
           "A context longer than the model allows: raise (default) or drop the oldest tokens."),
    Option("train_tool_limit_eos", True, bool,
           "ARPO_SPEC §10.8: the loss-mask value of the EOS appended when the tool-call limit ends an episode "
           "(it was never sampled). True (default, reference): mask 1, it is trained. False: mask 0, no gradient."),
    Option("dump_trees", False, bool,
           "Append every sampled group (its tree) as a JSON line to `dump_path`."),
    Option("dump_path", None, str | None,
           "The file dump_trees writes; None = trees.jsonl in the Algorithm's log folder (the Tune trial folder). "
           "`arpo train` sets it to trees.jsonl in the run folder."),
)

EVAL_OPTIONS: tuple[Option, ...] = (
    Option("eval_split", "test", str, "Environment split scored by evaluate()."),
    Option("eval_num_prompts", None, int | None, "Score the first N tasks of the split (None = all)."),
    Option("eval_samples", 1, int,
           "Samples per task. pass@1 = mean correctness over all samples; pass@k = any sample correct "
           "(ARPO_SPEC §10.23)."),
    Option("eval_temperature", 0.0, float, "0 = greedy (reference validation default); >0 samples."),
    Option("eval_max_response_tokens", None, int | None, "Response budget in evaluation (None = training's)."),
)

OWN_OPTIONS: dict[str, Option] = {o.name: o for o in TRAINING_OPTIONS + ROLLOUT_OPTIONS + EVAL_OPTIONS}


def _dataclass_options(cls: type, skip: Iterable[str]) -> dict[str, Option]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            raise TypeError(f"{cls.__name__}.{f.name} needs a default to be an ARPOConfig field")
        out[f.name] = Option(f.name, default, hints[f.name], f"see {cls.__module__}.{cls.__name__}.{f.name}")
    return out


TREE_OPTIONS: dict[str, Option] = _dataclass_options(TreeConfig, skip=("mode",))
LEARNER_OPTIONS: dict[str, Option] = _dataclass_options(LearnerConfig, skip=())
#: Where the learner runs (arpo_algo.train.backend_config.BackendConfig), in the same .training() group.
BACKEND_OPTIONS: dict[str, Option] = _dataclass_options(BackendConfig, skip=())

_GROUPS: dict[str, dict[str, Option]] = {
    "training": {**LEARNER_OPTIONS, **BACKEND_OPTIONS, **{o.name: o for o in TRAINING_OPTIONS}},
    "tree": TREE_OPTIONS,
    "llm_rollouts": {o.name: o for o in ROLLOUT_OPTIONS},
    "evaluation": {o.name: o for o in EVAL_OPTIONS},
}
ALL_OPTIONS: dict[str, Option] = {k: v for group in _GROUPS.values() for k, v in group.items()}


def _check_no_collisions() -> None:
    """A field that shadows an RLlib attribute would silently change RLlib behaviour (RAY_NOTES §1.4.1)."""
    base = AlgorithmConfig()
    taken = set(vars(base)) | set(dir(AlgorithmConfig))
    clash = sorted((set(ALL_OPTIONS) - set(SHARED_WITH_RLLIB)) & taken)
    if clash:
        raise RuntimeError(f"ARPOConfig fields collide with RLlib AlgorithmConfig names: {clash}")
    sizes = sum(len(g) for g in _GROUPS.values())
    if sizes != len(ALL_OPTIONS):
        raise RuntimeError("an ARPOConfig field name appears in two setter groups")


_check_no_collisions()


# --------------------------------------------------------------------------------------------------- type checks


def _is_search_space(value: Any) -> bool:
    """Tune search-space objects may sit in a config until Tune resolves them (RAY_NOTES §2)."""
    from ray.tune.search.sample import Domain

    return isinstance(value, Domain) or (isinstance(value, dict) and set(value) == {"grid_search"})


def check_value(name: str, value: Any, where: str = "ARPOConfig") -> Any:
    """Type-check one field value and return it (coerced); ConfigError naming the field otherwise."""
    if _is_search_space(value):
        return value
    opt = ALL_OPTIONS[name]
    return check_type(name, value, opt.hint, where, doc=opt.doc)
