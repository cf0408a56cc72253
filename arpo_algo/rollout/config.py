"""``[rollouts]``: how training trajectories are sampled (:class:`RolloutsConfig`), with one sub-table per engine.

The sampler (:class:`arpo_algo.rollout.sampler.TreeSampler`) and the engine factory
(:func:`arpo_algo.rollout.engines.build_engine`) receive this object as it is. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from arpo_algo.rollout.engines.config import HFEngineConfig, VLLMEngineConfig
from arpo_algo.rollout.engines.registry import EngineSpec, engine_spec
from arpo_base.errors import ConfigError
from arpo_base.options import setting


def check_custom_resources(name: str, tables: tuple[dict[str, float], ...], count: int, count_name: str) -> None:
    """Per-actor custom resources: none, one table for all, or one per actor; names that are not Ray's built-in
    resources, amounts > 0 (Ray reads 0 as "not requested", which would silently drop the placement)."""
    if not tables:
        return
    if len(tables) not in (1, count):
        raise ConfigError(
            f"{name} has {len(tables)} tables but {count_name} = {count}",
            hint="give one table (every actor) or exactly one per actor",
        )
    for table in tables:
        for key, amount in table.items():
            if key in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ConfigError(
                    f"{name}: {key!r} is a built-in Ray resource",
                    hint="CPUs and GPUs have their own settings; list custom resources only",
                )
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ConfigError(f"{name}: {key} = {amount!r} must be a number > 0")


def per_actor(tables: tuple[dict[str, float], ...], count: int) -> list[dict[str, float]]:
    """One custom-resource dict per actor (see :func:`check_custom_resources`)."""
    if not tables:
        return [{} for _ in range(count)]
    return [{k: float(v) for k, v in (tables[0] if len(tables) == 1 else tables[i]).items()} for i in range(count)]


def check_learner_scores_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Refuse training-rollout sampling the learner cannot score.

    Invariant: the learner's log-probs and entropies (old log-probs, ratios, the KL alarm, the entropy-aware terms) are
    ``log_softmax`` of the raw logits over the whole vocabulary, so the tokens it trains must come from exactly that
    distribution. A temperature other than 1 or a top-p/top-k truncation samples from another one (and the engines
    record it differently: HF tempered, vLLM raw), which would make every ratio and KL silently off-policy.
    """
    hint = (
        "the learner scores log_softmax(logits) over the full vocabulary (temperature 1, no truncation); "
        "sample training rollouts from that distribution (evaluation has its own temperature and top_p)"
    )
    if temperature != 1.0:
        raise ConfigError(
            f"rollouts.temperature={temperature}: training rollouts must be sampled at temperature 1.0", hint=hint
        )
    if top_p != 1.0:
        raise ConfigError(
            f"rollouts.top_p={top_p}: training rollouts cannot be truncated (top_p must be 1.0)", hint=hint
        )
    if top_k > 0:
        raise ConfigError(
            f"rollouts.top_k={top_k}: training rollouts cannot be truncated (top_k must be -1)", hint=hint
        )
    if top_k != -1:  # 0 reads as "off" elsewhere, but every engine request refuses it: -1 is the one off value
        raise ConfigError(
            f"rollouts.top_k={top_k}: -1 is the value that means off (no top-k truncation)",
            hint="set rollouts.top_k = -1, or leave it out",
        )


@dataclass(frozen=True)
class RolloutsConfig:
    """``[rollouts]``: sampling, engine and resources of training rollouts."""

    engine: str = setting(
        "hf",
        "Rollout engine, a registered name (arpo_algo.rollout.engines.registry): 'hf' (transformers, CPU or GPU) "
        "or 'vllm' (vLLM on CPU via scripts/install_vllm_cpu, or on GPU; needs tree.entropy_method = "
        "'topk_sum_lnV'). Evaluation uses the same engine.",
    )
    num_rollout_actors: int = setting(
        0,
        "0: generate in this process ('hf' shares the local learner's module; with a ddp/deepspeed learner it "
        "loads its own copy). N > 0: N Ray actors, each with its own engine copy; weights are sent after every "
        "update.",
    )
    num_cpus_per_rollout_actor: float = setting(1.0, "CPUs reserved per rollout actor (counted in a Tune trial).")
    actor_resources: tuple[dict[str, float], ...] = setting(
        (),
        "Ray custom resources per rollout actor, to place actors on chosen nodes: one table for every actor "
        "([{worker = 1}]) or one per actor ([{node_a = 1}, {node_b = 1}]); checked against the cluster before any "
        "actor starts.",
    )
    device: Literal["cpu", "cuda"] = setting("cpu", "Where the learner and the in-process engine run.")
    dtype: Literal["float32", "bfloat16"] = setting(
        "float32",
        "Engine compute dtype. float32 only where the in-process HF engine shares the local learner's "
        "float32 module; rollout actors, vLLM and the in-process engine of a ddp/deepspeed learner hold their own "
        "copy in this dtype.",
    )
    temperature: float = setting(
        1.0, "Sampling temperature of training rollouts; only 1.0, the distribution the learner scores (reference)."
    )
    top_p: float = setting(
        1.0,
        "Nucleus mass of training rollouts; only 1.0 (off, the reference): the learner scores the full distribution.",
    )
    top_k: int = setting(
        -1, "Top-k of training rollouts; only -1 (off, the reference): the learner scores the full distribution."
    )
    max_response_tokens: int = setting(
        512, "Response budget per trajectory (generated plus tool-result tokens), enforced per request."
    )
    tool_workers: int = setting(8, "Threads that run tool calls concurrently during rollouts.")
    prompt_overflow: Literal["error", "left_truncate"] = setting(
        "error", "A context longer than the model allows: raise, or drop the oldest tokens."
    )
    train_tool_limit_eos: bool = setting(
        True,
        "Loss mask of the EOS appended when the tool-call limit ends an episode (it was never sampled): "
        "True trains it (the reference), False gives it no gradient.",
    )
    schedule: Literal["rounds", "waves", "auto"] = setting(
        "rounds",
        "How the tree sampler feeds the engine: 'rounds' (one engine call per round of every prompt's tree: the "
        "roots, then each round of branches and fill-ups), 'waves' (one engine call per step, which a prompt's next "
        "round joins as soon as that prompt's paths have ended; the same trees; the in-process HF engine only) or "
        "'auto' (waves where the engine takes requests into a running call and tree.legacy_stale_baseline is off, "
        "else rounds).",
    )
    asynchronous: bool = setting(
        False,
        "Sample the next iteration's trees in a background thread while the learner updates on this one "
        "(needs num_rollout_actors > 0). Each trajectory records the policy version that sampled it; the learner "
        "scores a stale batch under that version's weights (docs/concepts/architecture.md#asynchronous-rollouts).",
    )
    max_staleness: int = setting(
        1,
        "With asynchronous: 1 starts the next batch before the update (its trajectories are one version behind "
        "the learner); 0 starts it after the update (no staleness: the synchronous update, overlapped with the work "
        "between iterations only). One batch is in flight, so 0 and 1 are the values.",
    )
    record_trees: bool = setting(
        True,
        "Record every iteration's trees after its update (tokens, log-probs, entropies, advantages, tool calls, "
        "rewards) for `arpo view` (docs/howto/view-trees.md).",
    )
    record_path: str | None = setting(
        None, "The tree folder record_trees writes; None = trees/ in the run folder (under Tune: the trial's folder)."
    )
    record_max_groups: int | None = setting(
        64, "At most this many groups (prompts) recorded per iteration, the first ones sampled; None = all."
    )
    record_every: int = setting(1, "Record every n-th iteration only.")
    hf: HFEngineConfig = field(default_factory=HFEngineConfig, metadata={"doc": "[rollouts.hf]: the HF engine."})
    vllm: VLLMEngineConfig = field(
        default_factory=VLLMEngineConfig, metadata={"doc": "[rollouts.vllm]: the vLLM engine."}
    )

    def __post_init__(self) -> None:
        engine_spec(self.engine)  # a registered engine, refused where it is set (naming the closest)

    @property
    def engine_spec(self) -> EngineSpec:
        """The registered engine this table selects (its capabilities and constructor)."""
        return engine_spec(self.engine)

    @property
    def engine_config(self) -> Any:
        """The settings of the selected engine: its ``[rollouts.<name>]`` table (a built-in engine's is a field
        here; another registered engine's settings dataclass with its defaults); None where it has none."""
        spec = self.engine_spec
        own = getattr(self, spec.name, None)
        if isinstance(own, spec.settings or ()):
            return own
        return spec.settings() if spec.settings is not None else None

    def validate(self) -> None:
        """Ranges and the combinations inside ``[rollouts]``, each explained."""
        for name in ("max_response_tokens", "tool_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollouts.{name} must be >= 1, got {getattr(self, name)}")
        if self.record_every < 1 or (self.record_max_groups is not None and self.record_max_groups < 1):
            raise ConfigError(
                "rollouts.record_every and rollouts.record_max_groups must be >= 1",
                hint="turn recording off with rollouts.record_trees = false",
            )
        if self.num_rollout_actors < 0:
            raise ConfigError(f"rollouts.num_rollout_actors must be >= 0, got {self.num_rollout_actors}")
        if self.num_cpus_per_rollout_actor <= 0:
            raise ConfigError("rollouts.num_cpus_per_rollout_actor must be > 0")
        check_custom_resources(
            "rollouts.actor_resources", self.actor_resources, self.num_rollout_actors, "rollouts.num_rollout_actors"
        )
        if self.temperature <= 0:
            raise ConfigError(
                f"rollouts.temperature must be > 0 for training rollouts, got {self.temperature}",
                hint="policy-gradient needs sampled trajectories; greedy decoding is for evaluation",
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollouts.top_p must be in (0, 1], got {self.top_p}")
        check_learner_scores_sampling(self.temperature, self.top_p, self.top_k)
        self._check_asynchronous()
        if self.schedule == "waves" and (not self.engine_spec.capabilities.joins_requests or self.num_rollout_actors):
            where = f"rollouts.engine={self.engine!r}" if self.num_rollout_actors == 0 else "rollout actors"
            raise ConfigError(
                f"rollouts.schedule='waves' needs an engine that takes requests into a running call; {where} does not",
                hint="use rollouts.schedule = 'auto' (waves where the engine can, rounds elsewhere) or 'rounds'",
            )
        self.hf.validate()
        self.vllm.validate()
        selected = self.engine_config
        if hasattr(selected, "check_device"):
            selected.check_device(self.device)
        if self.engine_spec.settings is not HFEngineConfig and self.hf != HFEngineConfig():
            changed = next(k for k, v in vars(self.hf).items() if v != getattr(HFEngineConfig(), k))
            raise ConfigError(
                f"rollouts.hf.{changed} is set but rollouts.engine={self.engine!r}",
                hint="[rollouts.hf] applies to engine = 'hf' only; remove it with vLLM",
            )

    def _check_asynchronous(self) -> None:
        """Invariant: a tree is sampled under one policy version, so the engine that samples in the background must
        hold its own weights (the in-process engine shares the module the learner is updating meanwhile)."""
        if self.max_staleness not in (0, 1):
            raise ConfigError(
                f"rollouts.max_staleness must be 0 or 1, got {self.max_staleness}",
                hint="one batch is in flight while the learner updates, so a batch is at most one "
                "version behind; 0 = no staleness",
            )
        if self.asynchronous and self.num_rollout_actors < 1:
            raise ConfigError(
                "rollouts.asynchronous needs rollout actors (num_rollout_actors > 0): the in-process "
                "engine shares the learner's module, which the update changes while the next batch "
                "is sampled",
                hint="set rollouts.num_rollout_actors >= 1, or asynchronous = false",
            )
