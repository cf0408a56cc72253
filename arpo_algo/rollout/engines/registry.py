"""The engine registry: each rollout engine registered once, under its name, with what it can do.

Everything that differs between engines and matters outside the engine itself is an :class:`EngineCapabilities`
field: the settings checks, the algorithm's engine builder, evaluation and serving read these, never an engine's
name. Adding an engine is one module holding the engine class plus one line::

    register_engine(EngineSpec("scripted", ScriptedEngine, EngineCapabilities(max_logprobs=None)))

after which ``rollouts.engine = "scripted"``, :func:`arpo_algo.rollout.engines.build_engine` and the CLI's
``--engine`` choices accept it. Pure Python: the built-in engines are named by import path and imported only when
built, so importing the registry imports neither torch nor vLLM.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from arpo_algo.rollout.engines.config import (
    VLLM_LORA_RANKS,
    VLLM_MAX_LOGPROBS,
    HFEngineConfig,
    VLLMEngineConfig,
    fitting_lora_rank,
)
from arpo_base.errors import ConfigError
from arpo_base.options import choice_error


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, as far as the settings, the learner and serving must know.

    Attributes:
        max_logprobs: The most top-k log-probs it returns per token (a request for more is refused when the settings
            are validated); None = up to the whole vocabulary.
        full_entropy: Whether it computes the entropy over the whole vocabulary; False = only the top-k estimator
            (``tree.entropy_method = 'topk_sum_lnV'``) can be used with it.
        lora_ranks: The LoRA ranks it can serve: ``"any"``; a tuple of the ranks it is built for (an adapter of rank r
            is served under the smallest one >= r, so the largest is the limit, and the engine is sized for its
            adapters up front: ``max_loras`` and ``max_lora_rank``); ``()`` = no LoRA.
        shares_module: Whether it can sample from the learner's own module in this process (``model=``), so an
            in-process engine over the local learner needs no weight copy and no push (and runs in its dtype).
        loads_adapter_folders: Whether it can load a LoRA adapter folder as its model.
        joins_requests: Whether requests may join a running ``generate`` call (its ``on_finish``), which
            ``rollouts.schedule = 'waves'`` needs; the engine class says the same by its ``joins_requests``.
    """

    max_logprobs: int | None = None
    full_entropy: bool = True
    lora_ranks: tuple[int, ...] | Literal["any"] = ()
    shares_module: bool = False
    loads_adapter_folders: bool = True
    joins_requests: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """One registered engine.

    Attributes:
        name: The name ``rollouts.engine`` and ``--engine`` take.
        constructor: The engine class (or any callable returning a
            :class:`~arpo_algo.rollout.engines.base.RolloutEngine`), or its ``"module:attr"`` import path, imported
            on first use. It takes the model (``model_or_path``) and its settings as keyword arguments.
        capabilities: What it can do (:class:`EngineCapabilities`).
        settings: The dataclass of its ``[rollouts.<name>]`` table (its user-facing keyword arguments, with
            ``validate()``, ``engine_kwargs()`` and optionally ``check_device(device)``); None = it has none.
        label: How messages name it ("the vLLM engine"); defaults to ``name``.
        check_available: Raises a ConfigError with a hint when the engine cannot run here (a missing package), so a
            command fails before it starts replicas or loads a model; None = always available.
    """

    name: str
    constructor: Callable[..., Any] | str
    capabilities: EngineCapabilities = field(default_factory=EngineCapabilities)
    settings: type | None = None
    label: str = ""
    check_available: Callable[[], None] | None = None

    @property
    def title(self) -> str:
        """The engine as messages name it."""
        return self.label or self.name

    def engine_class(self) -> Callable[..., Any]:
        """The constructor, imported now if it was given by import path."""
        if isinstance(self.constructor, str):
            module, _, attr = self.constructor.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.constructor

    def keywords(self) -> list[str]:
        """The keyword-only arguments its constructor takes (the settings a caller may pass)."""
        params = inspect.signature(self.engine_class()).parameters
        return [k for k, p in params.items() if p.kind is p.KEYWORD_ONLY]

    def lora_rank(self, rank: int) -> int:
        """The ``max_lora_rank`` that serves an adapter of ``rank`` (``rank`` itself where any rank is served), or a
        ConfigError naming what it can serve."""
        ranks = self.capabilities.lora_ranks
        if ranks == "any":
            return rank
        if not ranks:
            raise ConfigError(
                f"the {self.title} engine cannot serve LoRA adapters",
                hint="disable model.lora, or pick an engine that serves them",
            )
        return fitting_lora_rank(rank, ranks, self.title)


#: Engine name -> its :class:`EngineSpec`, in registration order (the built-ins first).
ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Register ``spec`` under its name (a second registration of a name replaces the first, so a module that
    registers can be imported again)."""
    if not spec.name.isidentifier():
        raise ConfigError(f"engine name {spec.name!r} must be an identifier (it names a [rollouts.<name>] table)")
    ENGINES[spec.name] = spec
    return spec


def engine_spec(name: str, where: str = "rollouts") -> EngineSpec:
    """The registered engine ``name``, or a ConfigError naming the registered ones and the closest."""
    if name not in ENGINES:
        raise choice_error("engine", name, list(ENGINES), where)
    return ENGINES[name]


def engine_names() -> tuple[str, ...]:
    """The registered engines' names (the CLI's ``--engine`` choices)."""
    return tuple(ENGINES)


def _check_vllm() -> None:
    from arpo_algo.rollout.engines.vllm.support import check_vllm_installed

    check_vllm_installed()


register_engine(
    EngineSpec(
        "hf",
        "arpo_algo.rollout.engines.hf.engine:HFEngine",
        EngineCapabilities(
            max_logprobs=None, full_entropy=True, lora_ranks="any", shares_module=True, joins_requests=True
        ),
        settings=HFEngineConfig,
    )
)
register_engine(
    EngineSpec(
        "vllm",
        "arpo_algo.rollout.engines.vllm.engine:VLLMEngine",
        EngineCapabilities(
            max_logprobs=VLLM_MAX_LOGPROBS,
            full_entropy=False,
            lora_ranks=VLLM_LORA_RANKS,
            shares_module=False,
            loads_adapter_folders=False,
        ),
        settings=VLLMEngineConfig,
        label="vLLM",
        check_available=_check_vllm,
    )
)
