"""Registries by name (as verl does): a new advantage estimator, policy loss or entropy estimator is one function
registered under one name, and configs select it by that name.

    from arpo_algo.core.advantages import register_advantage

    @register_advantage("my_estimator")
    def my_estimator(prompt_ids, responses, trained_masks, rewards, *, norm_by_std): ...

An unknown name is a :class:`~arpo_base.errors.ConfigError` that lists the registered names (and the closest one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from arpo_base.errors import ConfigError
from arpo_base.options import closest

F = TypeVar("F", bound=Callable[..., Any])


class Registry(dict[str, Callable[..., Any]]):
    """``{name: function}`` with a decorator to register and a lookup that explains unknown names.

    Args:
        kind: What is registered, for messages ("advantage estimator").
        option: The config option that selects an entry, for messages ("learner.advantage").
    """

    def __init__(self, kind: str, option: str) -> None:
        super().__init__()
        self.kind, self.option = kind, option
        self.meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[F], F]:
        """Decorator: register the function under ``name`` (with optional metadata, see :attr:`meta`)."""

        def deco(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self[name].__qualname__})")
            self[name] = fn
            self.meta[name] = dict(meta)
            return fn

        return deco

    def lookup(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name``; ConfigError listing the registered names otherwise."""
        if name not in self:
            near = closest(name, self) if isinstance(name, str) else None
            hint = (f"did you mean {near!r}? " if near else "") + f"registered: {', '.join(self)}"
            raise ConfigError(f"{self.option}: unknown {self.kind} {name!r}", hint=hint)
        return self[name]

    def check(self, name: Any, where: str) -> None:
        """Raise ConfigError (from ``where``) when ``name`` is not registered."""
        if not isinstance(name, str) or name not in self:
            near = closest(name, self) if isinstance(name, str) else None
            hint = (f"did you mean {near!r}? " if near else "") + f"registered: {', '.join(self)}"
            raise ConfigError(
                f"{where}: {self.option.split('.')[-1]}={name!r} is not a registered {self.kind}", hint=hint
            )
