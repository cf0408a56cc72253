"""Add a rollout engine: one class and one registration line.

An engine turns token ids into token ids with their log-probs and entropies (the ``RolloutEngine`` protocol in
``arpo_algo/rollout/engines/base.py``: ``tokenizer``, ``max_context``, ``generate``, ``release``,
``load_state_dict``, ``stats``, ``close``). Registering it under a name with what it can do
(:class:`~arpo_algo.rollout.engines.registry.EngineCapabilities`) is all the rest of arpo needs:
``[rollouts] engine = "recording"`` in an experiment file, ``build_engine("recording", ...)``, the settings checks
(which read the capabilities: here full entropy, any top-k, no LoRA, its own weights) and the CLI's ``--engine``
choices once this module is imported.

This one wraps the HF engine and records every request it serves (prompt length, tokens generated): the shape of an
engine that adds something around another (a cache, a trace, a rate limit). Run it on the quickstart's model::

    python -m examples.extend.engine smollm2-135m-instruct
"""

from __future__ import annotations

import sys
from typing import Any

from arpo_algo.rollout.engines import EngineCapabilities, EngineSpec, register_engine
from arpo_algo.rollout.engines.base import Generation, GenRequest, TokenCallback


class RecordingEngine:
    """The HF engine, with a record of every request served: ``(request_id, prompt tokens, generated tokens)``.

    Its keyword-only arguments are the settings a caller may pass (the algorithm passes ``entropy_method``, ``seed``,
    ``dtype`` and, because it is taken here, ``device``)."""

    def __init__(
        self,
        model_or_path: Any,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 8,
        entropy_method: str = "full",
        seed: int = 0,
    ) -> None:
        from arpo_algo.rollout.engines.hf import HFEngine

        self.inner = HFEngine(
            model_or_path,
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            entropy_method=entropy_method,
            seed=seed,
        )
        self.tokenizer = self.inner.tokenizer
        self.max_context = self.inner.max_context
        self.served: list[tuple[str, int, int]] = []

    def generate(self, requests: list[GenRequest], *, on_token: TokenCallback | None = None) -> list[Generation]:
        out = self.inner.generate(requests, on_token=on_token)
        self.served += [(g.request_id, len(r.token_ids), len(g.token_ids)) for r, g in zip(requests, out)]
        return out

    def release(self, cache_keys: list[Any]) -> None:
        self.inner.release(cache_keys)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


register_engine(EngineSpec("recording", RecordingEngine, EngineCapabilities(max_logprobs=None, full_entropy=True)))


if __name__ == "__main__":
    from arpo_algo.rollout.engines import build_engine
    from arpo_algo.rollout.engines.base import SamplingParams

    engine = build_engine("recording", model_or_path=sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct")
    ids = engine.tokenizer("2 + 2 =")["input_ids"]
    (gen,) = engine.generate([GenRequest("demo", ids, SamplingParams(max_new_tokens=8, seed=0))])
    print(repr(engine.tokenizer.decode(gen.token_ids)), engine.served)
    engine.close()
