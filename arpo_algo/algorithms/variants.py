"""The algorithm variants by name: one registry that ``[experiment] algorithm = "name"``, the CLI, Tune and the
settings reference read.

A variant is one module: a config class (its tree mode, its preset of defaults, what it changes from ARPO with the
paper's section per knob) and an Algorithm class, then one registration line (``examples/extend/variant.py``)::

    class MyConfig(ARPOConfig):
        variant = "my_arpo"
        preset = {"tree.branch_policy": "random"}
        changes = {"tree.branch_policy": "branch at random (ablation of ARPO section 3.2)"}

    class MyAlgo(ARPO):
        pass

    register_variant(MyConfig, MyAlgo)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ALGORITHMS", "CONFIG_CLASSES", "VARIANTS", "VARIANT_DEFAULTS", "Variant", "preset_of", "register_variant"]


@dataclass(frozen=True)
class Variant:
    """One registered algorithm variant.

    Attributes:
        name: The ``[experiment] algorithm`` name.
        config_class: Its AlgorithmConfig subclass.
        algorithm: Its Algorithm subclass.
        tree_mode: The tree sampler family it runs (``tree.mode``, one of :data:`arpo_algo.core.tree.MODES`).
        defaults: Its settings that differ from the sections' own, by dotted name (its presets and its bases').
        changes: What it changes from ARPO, by dotted setting name, each with the paper's section.
    """

    name: str
    config_class: type
    algorithm: type
    tree_mode: str
    defaults: Mapping[str, Any]
    changes: Mapping[str, str]


#: Variants by name, in registration order.
VARIANTS: dict[str, Variant] = {}
#: ``{name: config class}``, ``{name: Algorithm class}`` and ``{name: defaults}``: views kept by
#: :func:`register_variant`, for the readers that want one of them.
CONFIG_CLASSES: dict[str, type] = {}
ALGORITHMS: dict[str, type] = {}
VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {}


_ALGORITHM_OF: dict[type, type] = {}


def algorithm_of(config_class: type) -> type | None:
    """The Algorithm class registered with ``config_class`` or its nearest registered base."""
    return next((_ALGORITHM_OF[k] for k in config_class.__mro__ if k in _ALGORITHM_OF), None)


def preset_of(config_class: type) -> dict[str, Any]:
    """The defaults of ``config_class``: the ``preset`` of each class along its bases, the most derived last (a
    variant built on another states only what it changes from that one)."""
    out: dict[str, Any] = {}
    for klass in reversed(config_class.__mro__):
        out.update(klass.__dict__.get("preset", {}))
    return out


def register_variant(config_class: type, algorithm: type) -> Variant:
    """Register a variant under ``config_class.variant`` and tie its two classes together (the config builds
    ``algorithm``: :func:`algorithm_of`; ``algorithm.get_default_config()`` builds the config), and register the
    Algorithm with Tune. Registering a name twice is an error."""
    name = config_class.variant
    if name in VARIANTS:
        raise ValueError(f"algorithm variant {name!r} is already registered ({VARIANTS[name].config_class.__name__})")
    # one direction only: a class attribute each way would make the two classes a cycle that Ray's actor export
    # (dis.dis over class attributes) recurses through forever; the config finds its Algorithm with algorithm_of()
    _ALGORITHM_OF[config_class] = algorithm
    algorithm.config_class = config_class
    changes: dict[str, str] = {}
    for klass in reversed(config_class.__mro__):
        changes.update(klass.__dict__.get("changes", {}))
    v = Variant(name, config_class, algorithm, config_class.tree_mode, preset_of(config_class), changes)
    VARIANTS[name], CONFIG_CLASSES[name], ALGORITHMS[name] = v, config_class, algorithm
    VARIANT_DEFAULTS[name] = dict(v.defaults)
    _register_with_tune(v)
    return v


def _register_with_tune(v: Variant) -> None:
    """``tune.Tuner("<Algorithm class name>")`` and ``tune.Tuner("<NAME>")`` run the variant (Tune's registry holds
    entries only: nothing starts Ray). The names go into RLlib's table of algorithms too, which Tune registers again
    on every lookup it cannot answer: an entry Tune wrote into a Ray session's store is gone after ``ray.shutdown()``,
    and the name must still be found then, as RLlib's own are."""
    from ray.rllib.algorithms.registry import ALGORITHMS
    from ray.tune import register_trainable

    for tune_name in {v.algorithm.__name__, v.name.upper()}:
        register_trainable(tune_name, v.algorithm)
        ALGORITHMS[tune_name] = functools.partial(_class_and_config, v)


def _class_and_config(v: Variant) -> tuple[type, Any]:
    """An entry of RLlib's table of algorithms: the Algorithm class and a default config."""
    return v.algorithm, v.config_class()
