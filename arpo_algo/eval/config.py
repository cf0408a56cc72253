"""``[evaluation]``: the held-out protocol of a training run (:class:`EvaluationConfig`).

``every`` is RLlib's ``evaluation_interval`` (the Algorithm config keeps the two equal); the rest is what
:func:`arpo_algo.eval.evaluation.evaluate_policy` reads. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from arpo_base.errors import ConfigError
from arpo_base.options import setting


@dataclass(frozen=True)
class EvaluationConfig:
    """``[evaluation]``: when and how the held-out split is scored during training."""

    every: int = setting(
        0, "Evaluate every N iterations (0 = never during training; `arpo train` always evaluates at the end)."
    )
    split: str = setting("test", "Environment split scored by evaluate().")
    num_prompts: int | None = setting(None, "Score the first N tasks of the split (None = all).")
    samples: int = setting(
        1, "Samples per task: pass@1 = mean correctness over all samples, pass@k = any sample correct."
    )
    temperature: float = setting(0.0, "0 = greedy (the reference's validation default); > 0 samples.")
    top_p: float = setting(1.0, "Nucleus mass when evaluation samples (1.0 = off).")
    max_response_tokens: int | None = setting(None, "Response budget in evaluation (None = rollouts'.)")

    def validate(self) -> None:
        """Ranges and combinations, each explained."""
        if self.every < 0:
            raise ConfigError(f"evaluation.every must be >= 0, got {self.every}")
        if self.samples < 1:
            raise ConfigError(f"evaluation.samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ConfigError(f"evaluation.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"evaluation.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and self.samples > 1:
            raise ConfigError(
                f"evaluation.samples={self.samples} with greedy decoding (temperature = 0) scores the "
                "same answer several times",
                hint="set evaluation.temperature > 0 or samples = 1",
            )
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError("evaluation.num_prompts must be >= 1 or None (all)")
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise ConfigError("evaluation.max_response_tokens must be >= 1 or None (rollouts')")
