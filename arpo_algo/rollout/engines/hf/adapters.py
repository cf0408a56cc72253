"""Several LoRA adapters on one base in the HF engine (``HFEngine(adapters=...)``): their names, the per-row adapter
of each forward, and the keys that keep one adapter's computation away from another's.

PEFT runs a batch whose rows use different adapters when each LoRA layer's forward gets ``adapter_names`` (one name
per row, ``"__base__"`` for the base alone). The engine calls the transformers model directly, so a forward
pre-hook on every LoRA layer passes the names of the rows of the forward being run (:meth:`NamedAdapters._rows_under`).

Invariant: what a row's KV and next-token logits depend on is its adapter and its tokens (:func:`context_key`); the
stored KV, identical contexts prefilled once and shared leading runs are all keyed by it, so nothing computed under
one adapter is ever reused under another.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any

from arpo_algo.rollout.engines.base import GenRequest
from arpo_algo.rollout.engines.hf.slot_prefill import SharedRun, plan_shared_runs
from arpo_base.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: A named adapter (a PEFT module-dict key: no dots).
ADAPTER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def context_key(req: GenRequest) -> tuple:
    """What a row's KV and next-token logits depend on: its adapter and its tokens (the key of shared prefills)."""
    return req.adapter, tuple(req.token_ids)


def plan_runs(requests: list[GenRequest]) -> dict[tuple, SharedRun]:
    """:func:`plan_shared_runs` within each adapter's requests, keyed by :func:`context_key`: a leading run is shared
    only by contexts of the same adapter."""
    plan: dict[tuple, SharedRun] = {}
    for adapter in dict.fromkeys(r.adapter for r in requests):
        group = plan_shared_runs([r for r in requests if r.adapter == adapter])
        plan.update(((adapter, ctx), run) for ctx, run in group.items())
    return plan


class NamedAdapters:
    """The adapter management of an engine built with ``adapters=`` (mixed into :class:`HFEngine`)."""

    adapters: dict[str, str] | None
    base_fingerprint: str
    model: Any
    _row_adapters: list[str] | None
    _hooked: set[int]

    def _invalidate(self) -> None:
        """Drop the stored KV (the engine's own; computed under the adapters loaded before)."""
        raise NotImplementedError

    def add_adapter(self, name: str, folder: str) -> None:
        """Load another adapter of this engine's base under ``name`` (engines built with ``adapters=``). Call it
        between :meth:`generate` calls (the caller serialises them); the stored KV is dropped."""
        from arpo_algo.models.lora import add_named_adapter

        if self.adapters is None:
            raise ConfigError("this engine serves one policy; build it with adapters={...} to hold several")
        if not ADAPTER_NAME.match(name):
            raise ConfigError(f"adapter name {name!r}: letters, digits and _ only, not starting with a digit")
        if name in self.adapters:
            raise ConfigError(f"an adapter named {name!r} is loaded already", hint="give each adapter its own name")
        add_named_adapter(self.model, folder, name, fingerprint=self.base_fingerprint)
        self.adapters[name] = str(folder)
        self._hook_adapter_layers()
        self._invalidate()

    def remove_adapter(self, name: str) -> None:
        """Unload the adapter ``name`` (between :meth:`generate` calls); a later request naming it is refused."""
        from arpo_algo.models.lora import remove_named_adapter

        if self.adapters is None or name not in self.adapters:
            raise ConfigError(f"no adapter named {name!r} is loaded")
        remove_named_adapter(self.model, name)
        del self.adapters[name]
        self._invalidate()

    def _hook_adapter_layers(self) -> None:
        """Give every LoRA layer (new ones too) the pre-hook that passes the rows' adapter names to PEFT."""
        from peft.tuners.lora import LoraLayer

        module: torch.nn.Module  # PEFT's LoraLayer is a mixin; the layers found here are also torch modules
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and id(module) not in self._hooked:
                module.register_forward_pre_hook(self._adapter_rows_hook, with_kwargs=True)
                self._hooked.add(id(module))

    def _adapter_rows_hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._row_adapters is not None:
            kwargs["adapter_names"] = self._row_adapters
        return args, kwargs

    @contextlib.contextmanager
    def _rows_under(self, adapters: list[str | None]) -> Any:
        """The forward inside runs row ``i`` under adapter ``adapters[i]`` (None: the base), on an engine with
        named adapters; a no-op otherwise."""
        if self.adapters is None:
            yield
            return
        self._row_adapters = [a if a is not None else "__base__" for a in adapters]
        try:
            yield
        finally:
            self._row_adapters = None
