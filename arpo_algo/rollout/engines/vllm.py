"""VLLMEngine: the :class:`~arpo_algo.rollout.engines.base.RolloutEngine` interface on vLLM 0.29 (GPU image only).

Token in, token out: contexts go in as ``TokensPrompt(prompt_token_ids=...)`` and nothing is re-tokenized. Stop
strings are matched by vLLM on the detokenized *new* text and kept (``include_stop_str_in_output=True``); the token
ids are never truncated. vLLM's automatic prefix caching is on, so ``prefix_key`` is accepted but not needed (vLLM
finds shared prefixes by block hashing); ``release`` is a no-op and ``cache_key`` is only an opaque handle.

Differences from :class:`~arpo_algo.rollout.engines.hf.HFEngine`, by design:

* Entropy: vLLM returns only top-k logprobs, so only ``entropy_method="topk_sum_lnV"`` exists here: each per-token
  entropy is the truncated summand ``-sum exp(l) l`` over the top-k entries plus the sampled token, ``top_logprobs``
  is always filled (``k = logprobs_topk`` or 10, the reference), and :func:`arpo_algo.core.entropy.topk_sum_lnV` gives
  the reference segment entropy. Asking for ``"full"`` raises :class:`ConfigError` (no silent switch).
* Logprobs: ``logprobs_mode="raw_logprobs"`` (vLLM's default) is ``log_softmax(raw logits)`` *without* temperature;
  it equals the HF engine's definition (``raw logits / T``, before top-k/top-p) at temperature 1, the training
  setting. ``"processed_logprobs"`` gives vLLM's post-temperature, post-truncation values instead.
* Weights: ``load_state_dict`` sends ``(name, tensor)`` pairs to the worker through ``collective_rpc`` into
  ``model.load_weights`` (via :class:`ArpoWorkerExtension`) and resets the prefix cache. A shared in-process module
  is not possible with vLLM.
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any

from arpo_algo.core.entropy import topk_token_term
from arpo_algo.rollout.engines.base import (
    Generation,
    GenRequest,
    TokenCallback,
    error_generation,
    replay_tokens,
    request_problem,
)
from arpo_env.errors import ArpoError, ConfigError

REFERENCE_TOPK = 10
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


class ArpoWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``) so weights can be replaced in place."""

    def arpo_load_weights(self, weights: list[tuple[str, Any]]) -> int:
        """Load HF-named tensors into the worker's model; returns how many were passed."""
        device = next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]
        self.model_runner.model.load_weights(weights=[(n, t.to(device)) for n, t in weights])  # type: ignore
        return len(weights)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ArpoError(f"the vLLM engine needs the vllm package, which is not installed ({e})",
                        hint="install the GPU image (pip install 'arpo[vllm]' on a CUDA machine), or use "
                             "engine='hf'") from e
    return vllm


class VLLMEngine:
    """vLLM-backed rollout engine (see the module docstring for the exact semantics).

    Args:
        model_or_path: A registered model name or a local HF folder.
        tokenizer: Unused except to override vLLM's tokenizer object exposed as ``self.tokenizer``.
        dtype: "bfloat16" (default on GPU), "float16" or "float32".
        entropy_method: Only "topk_sum_lnV" (vLLM has no full logits).
        gpu_memory_utilization: Fraction of GPU memory vLLM may take (leave room for a colocated learner).
        max_model_len: Context limit; None uses the model's.
        seed: Engine seed; also seeds requests whose ``SamplingParams.seed`` is None.
        logprobs_mode: "raw_logprobs" (default) or "processed_logprobs".
        tensor_parallel_size: GPUs per engine.
        enforce_eager: Skip CUDA graph capture (faster start, slower decode).
    """

    def __init__(self, model_or_path: Any, tokenizer: Any = None, *, dtype: str = "bfloat16",
                 entropy_method: str = "topk_sum_lnV", gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0, logprobs_mode: str = "raw_logprobs",
                 tensor_parallel_size: int = 1, enforce_eager: bool = False) -> None:
        if entropy_method != "topk_sum_lnV":
            raise ConfigError(f"entropy_method={entropy_method!r} is not available with vLLM, which returns only "
                              "top-k logprobs; use entropy_method='topk_sum_lnV' (or the HF engine for 'full')")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"unknown logprobs_mode {logprobs_mode!r}; choose one of {', '.join(LOGPROBS_MODES)}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"unknown dtype {dtype!r}; choose bfloat16, float16 or float32")
        vllm = _import_vllm()
        from arpo_algo.models import resolve_model_path

        path = resolve_model_path(os.fspath(model_or_path))
        kwargs: dict[str, Any] = dict(model=str(path), dtype=dtype, enable_prefix_caching=True, seed=seed,
                                      gpu_memory_utilization=gpu_memory_utilization, max_logprobs=64,
                                      logprobs_mode=logprobs_mode, tensor_parallel_size=tensor_parallel_size,
                                      enforce_eager=enforce_eager,
                                      worker_extension_cls=f"{__name__}.ArpoWorkerExtension")
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.entropy_method = entropy_method
        self._rng = random.Random(seed)
        self._next_key = 0
        self._stats: collections.Counter[str] = collections.Counter()

    def _validate(self, req: GenRequest) -> str | None:
        # vLLM needs room for at least one generated token inside max_model_len.
        return request_problem(req, max_context=self.max_model_len - 1, vocab_size=self.vocab_size)

    def _params(self, req: GenRequest) -> Any:
        p = req.params
        return self._vllm.SamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0,
            seed=p.seed if p.seed is not None else self._rng.getrandbits(62),
            max_tokens=min(p.max_new_tokens, self.max_model_len - len(req.token_ids)),
            stop=list(p.stop) or None, include_stop_str_in_output=True, skip_special_tokens=False,
            logprobs=p.logprobs_topk or REFERENCE_TOPK)

    def generate(self, requests: list[GenRequest], *, on_token: TokenCallback | None = None) -> list[Generation]:
        """Continue every request (results in request order); a bad request gets ``finish_reason="error"``.
        ``on_token`` is called for each token after the batch returns (this offline engine does not stream)."""
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        results: list[Generation | None] = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            problem = self._validate(req)
            if problem:
                self._stats["errors"] += 1
                results[i] = error_generation(req, problem)
            elif req.params.max_new_tokens <= 0:
                results[i] = Generation(req.request_id, [], [], [], "length")
            else:
                todo.append(i)
        if todo:
            prompts = [TokensPrompt(prompt_token_ids=list(requests[i].token_ids)) for i in todo]
            outs = self.llm.generate(prompts, [self._params(requests[i]) for i in todo], use_tqdm=False)
            for i, out in zip(todo, outs):
                results[i] = self._convert(requests[i], out)
        self._stats["requests"] += len(requests)
        self._stats["seconds"] += time.perf_counter() - t0
        replay_tokens(on_token, results)  # type: ignore[arg-type]
        return results  # type: ignore[return-value]

    def _convert(self, req: GenRequest, out: Any) -> Generation:
        comp = out.outputs[0]
        k = req.params.logprobs_topk or REFERENCE_TOPK
        tokens = list(comp.token_ids)
        logprobs, entropies, tops = [], [], []
        for tok, entry in zip(tokens, comp.logprobs or []):
            pairs = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()), key=lambda x: -x[1])
            top = pairs[:k]
            sampled = float(entry[tok].logprob)
            if tok not in {t for t, _ in top}:  # vLLM adds the sampled token to the top k; keep it last, like HF
                top.append((tok, sampled))
            logprobs.append(sampled)
            tops.append(top)
            entropies.append(topk_token_term(top))
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        self._stats["generated_tokens"] += len(tokens)
        self._stats["reused_tokens"] += cached
        self._stats["prefill_tokens"] += len(req.token_ids) - cached
        stop_string = None
        if comp.finish_reason == "length":
            finish = "length"
        elif comp.finish_reason == "stop" and isinstance(comp.stop_reason, str):
            finish, stop_string = "stop", comp.stop_reason
        elif comp.finish_reason == "stop":
            finish = "eos"  # stop_reason None (EOS) or an int stop token id
        else:
            self._stats["errors"] += 1
            return Generation(req.request_id, tokens, logprobs, entropies, "error",
                              error=f"request {req.request_id!r}: vLLM finished with {comp.finish_reason!r}")
        self._next_key += 1
        return Generation(req.request_id, tokens, logprobs, entropies, finish, stop_string=stop_string,  # type: ignore
                          top_logprobs=tops, cache_key=f"vllm:{self._next_key}",
                          metrics={"new_tokens": float(len(tokens)), "cached_prompt_tokens": float(cached)})

    @property
    def max_context(self) -> int:
        """The engine interface's context limit: vLLM's ``max_model_len``."""
        return self.max_model_len

    def close(self) -> None:
        """Drop the vLLM engine (its worker processes and GPU memory go with it). Idempotent."""
        self.__dict__.pop("llm", None)

    def release(self, cache_keys: list[Any]) -> None:
        """No-op: vLLM's prefix cache manages its own blocks."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load new weights into the vLLM worker(s) in place and drop the (now stale) prefix cache."""
        weights = [(name, t.detach().to("cpu")) for name, t in state_dict.items()]
        self.llm.collective_rpc("arpo_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        self._stats["weight_loads"] += 1

    def stats(self) -> dict[str, float]:
        """Counters since the last call."""
        out = {k: float(v) for k, v in self._stats.items()}
        self._stats.clear()
        return out
