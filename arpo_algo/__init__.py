"""arpo_algo: ARPO, AEPO and GRPO for tool-using LLM agents as RLlib Algorithms.

Rooms, each importing only from the ones before it (``tests/test_layout.py`` enforces this)::

    core        pure math and decisions: tree rules, entropy, advantages, policy losses (registered by name)
    models      where weights come from: registry, pull, name-or-path resolution, tiny test models
    rollout     trajectory types, the agent loop, the token-layout rule, the tree sampler, metrics, engines
    train       learner, tree forward, optimizer and schedule, SFT
    eval        held-out evaluation on the rollout code path
    algorithms  ARPOConfig / AEPOConfig / GRPOConfig with their RLlib Algorithms
    run         experiment files, the run driver, checkpoints, plots
    cli         one module per ``arpo`` command
"""

import importlib.metadata as _md

try:
    __version__ = _md.version("arpo")
except _md.PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"


# ------------------------------------------------------------------------------------------------ Tune's names
# ``tune.Tuner("ARPO", ...)`` finds the built-in algorithms once ``arpo_algo`` is imported, as RLlib's own names are
# found once ``ray.rllib`` is. Registering must neither start Ray nor import it here (``import arpo_algo`` stays
# light): the entries are written into Tune's registry when ``ray.tune.registry`` loads, and each unpickles to its
# Algorithm class (importing the algorithms) only when Tune looks the name up. ``register_variant`` registers every
# variant's classes directly, those added later included.

import os as _os
import sys as _sys

#: The built-in variants' Tune names: their Algorithm class names.
TUNE_NAMES = ("ARPO", "AEPO", "GRPO")
#: Tune cuts a generated trial folder name to this many characters before the date (Tune's own setting, left as the
#: user sets it): the start of Tune's trial name (the trainable's name, then the environment's), without the
#: 130-character list of sampled values; Tune appends the date and keeps folder names unique. A fixed length: the
#: folder a trial gets does not depend on which variants the process registered before it.
TUNE_DIRNAME_LENGTH = "16"


def tune_trainable(name: str) -> type:
    """The Algorithm class of the registered variant whose class name or upper-case name is ``name``."""
    import importlib

    variants = importlib.import_module("arpo_algo.algorithms").VARIANTS
    for v in variants.values():
        if name in (v.algorithm.__name__, v.name.upper()):
            return v.algorithm
    raise KeyError(f"no registered algorithm variant is called {name!r}")


class _TuneName:
    """A Tune registry entry that unpickles to :func:`tune_trainable` of its name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple:
        return (tune_trainable, (self.name,))


def _tune_names() -> set[str]:
    """:data:`TUNE_NAMES` and every registered variant's class name and upper-case name."""
    names = set(TUNE_NAMES)
    variants = _sys.modules.get("arpo_algo.algorithms.variants")
    for v in getattr(variants, "VARIANTS", {}).values():
        names |= {v.algorithm.__name__, v.name.upper()}
    return names


def _register_tune_names(registry) -> None:
    """Enter the names in Tune's registry, now and after every later ``ray.init``: Tune moves its entries into the
    running cluster's store and forgets them, so a name registered during one Ray session was unknown in the next
    (``tune.Tuner("ARPO")`` failed after an earlier ``ray.shutdown()`` in the same process)."""
    _os.environ.setdefault("TUNE_MAX_LEN_IDENTIFIER", TUNE_DIRNAME_LENGTH)
    for name in sorted(_tune_names()):
        if not registry._global_registry.contains(registry.TRAINABLE_CLASS, name):
            registry._global_registry.register(registry.TRAINABLE_CLASS, name, _TuneName(name))
    hooks = _sys.modules["ray._private.worker"]._post_init_hooks  # run by ray.init, after Tune's own flush
    if _on_ray_init not in hooks:
        hooks.append(_on_ray_init)


def _on_ray_init() -> None:
    _register_tune_names(_sys.modules["ray.tune.registry"])


class _TuneRegistryHook:
    """Registers :data:`TUNE_NAMES` right after ``ray.tune.registry`` has loaded (then leaves ``sys.meta_path``)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "ray.tune.registry":
            return None
        _sys.meta_path.remove(self)
        for finder in _sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _register_tune_names(module)

        spec.loader.exec_module = exec_module
        return spec


if "ray.tune.registry" in _sys.modules:
    _register_tune_names(_sys.modules["ray.tune.registry"])
elif not any(isinstance(f, _TuneRegistryHook) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _TuneRegistryHook())
