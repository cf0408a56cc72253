"""The ``deepspeed`` learner backend: the ranks of :mod:`arpo_algo.train.ddp`, with the model wrapped by
``deepspeed.initialize`` (ZeRO stage 2 or 3). Needs ``pip install 'arpo[deepspeed]'``; runs on GPUs (NCCL) and on
CPU (gloo, ``DS_ACCELERATOR=cpu``, set by each rank itself).

How the update keeps the single-process objective:

* The loss of every micro-batch is already divided by the whole step's normaliser (global over ranks through the
  :class:`~arpo_algo.train.ddp.DistributedLearner` hooks). ZeRO AVERAGES gradients over ranks, so each backward is
  of ``loss x world_size``, which makes the reduced gradient the sum, as in :mod:`arpo_algo.train.ddp`.
* Every rank issues the same sequence of collectives. ZeRO reduces gradients in backward hooks (ZeRO-2 and 3) and
  gathers parameters in every forward (ZeRO-3, ``no_grad`` ones included), so before the first pass of a step the
  ranks agree on the largest micro-batch count (``_all_max``), and a rank with fewer (or none, or one cut short by a
  non-finite loss) runs zero-weighted passes over a one-token batch up to it; every rank then ends the step with
  one more such pass that is the gradient-accumulation boundary (``gradient_accumulation_steps`` in the generated
  config is only nominal: the boundary is set by hand). The forward-only passes of an update (recomputed old
  log-probs, the mismatch check) are padded the same way, without backward.
* Clipping (``gradient_clipping`` = ``grad_clip``) and the optimizer step run inside ``engine.step()``; the
  optimizer is arpo's AdamW and its schedule is stepped by the learner, as in one process. ``grad_norm`` is
  DeepSpeed's global norm, read after the step: a non-finite one raises instead of skipping (DeepSpeed has already
  stepped). Under ZeRO-3 ``param_change_norm`` is not measured (parameters are sharded) and reads 0.
* The forward passes go through the engine (``engine(...)``), as DeepSpeed requires: its forward registers the
  hooks that open and close each backward pass.
* State: ``get_state`` holds every rank's optimizer shard (``optimizer`` is a list) and the ZeRO stage and world
  size; it restores only into a DeepSpeed backend with the same stage and rank count.
* On CPU, DeepSpeed JIT-builds a small C++ extension (its shared-memory collectives) the first time a rank starts;
  it is built once per virtual environment, into ``<venv>/torch_extensions`` (:func:`extensions_dir`), unless
  ``TORCH_EXTENSIONS_DIR`` names another place.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.train.backend_config import BackendConfig, require_deepspeed
from arpo_algo.train.ddp import DDPBackend, DistributedLearner
from arpo_algo.train.learner import LearnerConfig
from arpo_algo.train.tree_forward import SeqSpec, build_padded_batch, forward_token_stats
from arpo_base.errors import ArpoError, ConfigError

__all__ = ["DeepSpeedBackend", "DeepSpeedLearner", "deepspeed_config", "extensions_dir"]


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-built extensions are cached: ``TORCH_EXTENSIONS_DIR`` when set, else inside the
    virtual environment (``sys.prefix``), so every run and CI job of that environment reuses one build."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def import_deepspeed(device: str) -> Any:
    """``deepspeed``, imported with its accelerator chosen from ``device`` (not guessed from the machine) and its
    extension cache in :func:`extensions_dir`; refuses if an earlier import in this process chose another one."""
    os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    got = get_accelerator().device_name()
    if got != os.environ["DS_ACCELERATOR"]:
        raise ArpoError(
            f"DeepSpeed's accelerator in this process is {got!r}, not {os.environ['DS_ACCELERATOR']!r} "
            f"as device={device!r} needs",
            hint="run the learner ranks in fresh processes",
        )
    return deepspeed


class _EngineView:
    """The learner's ``model``: calls go through the DeepSpeed engine (its forward registers the backward hooks
    ZeRO needs); attributes (``config``, ``parameters``, ``save_pretrained``, ...) come from the HF module."""

    def __init__(self, engine: Any) -> None:
        self.__dict__["engine"] = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.module, name)


def deepspeed_config(config: LearnerConfig, stage: int, *, bf16: bool = False, offload: str = "none") -> dict[str, Any]:
    """The DeepSpeed config for one rank: ZeRO ``stage``, bf16 when ``bf16`` (the learner's resolved
    ``training.precision``; else fp32), one packed micro-batch per pass, arpo's clipping, ZeRO-Offload as
    ``offload`` (``BackendConfig.deepspeed_offload``). Every key is set explicitly (no DeepSpeed "auto" values)."""
    if stage not in (2, 3):
        raise ConfigError(f"deepspeed_stage must be 2 or 3, got {stage}")
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
    }
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=1e5)
    extra: dict[str, Any] = {}
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if offload == "optimizer_and_parameters":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        extra["zero_force_ds_cpu_optimizer"] = False  # arpo's torch AdamW steps the offloaded state
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 1,  # one packed micro-batch (whole groups, <= micro_batch_tokens)
        "gradient_accumulation_steps": 1,  # nominal: the learner sets the boundary itself
        "gradient_clipping": float(config.grad_clip),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # arpo's torch AdamW
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedLearner(DistributedLearner):
    """A rank's learner with the model inside a DeepSpeed engine (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        config: LearnerConfig,
        device: str = "cuda",
        seed: int = 0,
        *,
        stage: int = 2,
        offload: str = "none",
    ) -> None:
        if config.head_chunk_tokens:  # its chunked head calls the model body directly, past the engine's hooks
            raise ConfigError(
                "learner.head_chunk_tokens is not supported by the deepspeed backend",
                hint="leave training.head_chunk_tokens unset, or use the local or ddp backend",
            )
        import torch.distributed as dist

        deepspeed = import_deepspeed(device)
        super().__init__(model_path, config, device=device, seed=seed)
        self.stage, self.world_size = stage, dist.get_world_size()
        self.measures_param_change = stage != 3  # ZeRO-3 parameters are shards, gathered and freed around passes
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model,
            optimizer=self.optimizer,
            config=deepspeed_config(config, stage, bf16=self.precision == "bf16", offload=offload),
            dist_init_required=False,
        )
        self.model = _EngineView(self.engine)
        pad = self.pad_id
        self._pad_batch = build_padded_batch([SeqSpec(0, 0, [pad], [pad], [1], [0.0], [1.0], [0.0])], pad).to(
            self.device
        )

    def _pad_pass(self) -> torch.Tensor:
        """One forward through the engine over the one-token batch (the same modules, so the same collectives)."""
        lp, _ = forward_token_stats(self.model, self._pad_batch, with_entropy=False)
        return lp

    def _score(self, model: torch.nn.Module, batches: list[Any]) -> list[torch.Tensor]:
        if model is not self.model:  # the frozen reference is a plain module: its forwards are not collectives
            return super()._score(model, batches)
        # ZeRO-3 gathers parameters in every forward: as many passes as the busiest rank, the count agreed before
        # the first one (the agreement is itself a collective and must not meet another rank's gather)
        most = int(self._all_max(len(batches)))
        out = super()._score(model, batches)
        with torch.no_grad():
            for _ in range(most - len(batches)):
                self._pad_pass()
        return out

    def _before_micro_batches(self, count: int) -> None:
        # Agreed before any forward of the step: a collective here, once every rank is in its passes, would meet
        # another rank's gradient reduction or parameter gather instead.
        self._most = int(self._all_max(count))

    def _backward(self, loss: torch.Tensor, index: int, count: int) -> None:
        self.engine.set_gradient_accumulation_boundary(False)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def _after_backward(self, done: int) -> None:
        # No collective of our own in here: the other ranks may still be in their passes (see _before_micro_batches).
        for k in range(self._most - done + 1):  # fill up to the busiest rank, then the boundary pass
            self.engine.set_gradient_accumulation_boundary(k == self._most - done)
            self.engine.backward(self._pad_pass().sum() * 0.0, scale_wrt_gas=False)

    def _clip_grads(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return 0.0  # engine.step() clips; the norm is read after it (see _epoch)

    def _optimizer_step(self) -> None:
        self.engine.step()

    def _epoch(self, *args: Any, **kwargs: Any) -> dict[str, float] | None:
        acc = super()._epoch(*args, **kwargs)
        if acc is not None:
            norm = self.engine.get_global_grad_norm()
            acc[LK.GRAD_NORM] = float(norm) if norm is not None else 0.0
            if not math.isfinite(acc[LK.GRAD_NORM]):
                raise ArpoError(
                    "DeepSpeed stepped on a non-finite gradient norm",
                    hint="check the rewards for NaN, lower the learning rate, or disable bf16",
                )
        return acc

    def _gathered(self):
        import deepspeed

        if self.stage != 3:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        with self._gathered():
            return {k: v.detach().float().cpu().clone() for k, v in self.engine.module.state_dict().items()}

    def save_pretrained(self, out_dir: str | Path) -> Path:
        import torch.distributed as dist

        with self._gathered():
            if dist.get_rank() == 0:
                super().save_pretrained(out_dir)
        return Path(out_dir)

    def load_pretrained(self, path: str) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        params = list(self.engine.module.parameters())
        if self.stage == 3:
            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
        else:
            ctx = contextlib.nullcontext()
        with ctx, torch.no_grad():
            self.engine.module.load_state_dict(saved)
        if hasattr(self.optimizer, "refresh_fp32_params"):  # the optimizer's fp32 master copy follows the weights
            self.optimizer.refresh_fp32_params()

    def get_state(self, *, include_model: bool = False) -> dict[str, Any]:
        state = super().get_state(include_model=False)
        state["deepspeed"] = {"stage": self.stage, "world_size": self.world_size}
        if include_model:
            state["model"] = self.cpu_state_dict()
        return state

    def _fp32_shards(self) -> list[torch.Tensor]:
        """This rank's flat fp32 master partitions (what AdamW steps; the module's weights follow them)."""
        opt = self.optimizer
        return opt.fp32_partitioned_groups_flat if self.stage == 3 else opt.single_partition_of_fp32_groups

    def _optimizer_state(self) -> dict[str, Any]:
        # Not DeepSpeed's own state_dict: it holds objects (its loss scaler, enums, slice mappings) that a
        # checkpoint, read as data only, refuses. This rank's shard is AdamW's state over the flat fp32 partitions
        # plus those partitions themselves: tensors and plain values.
        return {
            "adamw": self.optimizer.optimizer.state_dict(),
            "fp32": [t.detach().clone() for t in self._fp32_shards()],
        }

    def _load_optimizer_state(self, state: Any) -> None:
        import torch.distributed as dist

        mine = state[dist.get_rank()]  # every rank's shard, in rank order (DeepSpeedBackend.get_state)
        shards = self._fp32_shards()
        if [t.shape for t in mine["fp32"]] != [t.shape for t in shards]:
            raise ArpoError(
                "this learner state's optimizer shards do not match this model's partitions",
                hint="resume with the model, ZeRO stage and learner_workers that wrote the checkpoint",
            )
        self.optimizer.optimizer.load_state_dict(mine["adamw"])
        with torch.no_grad():
            for t, saved in zip(shards, mine["fp32"]):
                t.copy_(saved)

    def set_state(self, state: dict[str, Any]) -> None:
        meta = state.get("deepspeed")
        if meta != {"stage": self.stage, "world_size": self.world_size}:
            raise ArpoError(
                f"this learner state was written by {meta or 'a non-DeepSpeed backend'}; this run is "
                f"DeepSpeed ZeRO-{self.stage} on {self.world_size} ranks",
                hint="resume with the backend, ZeRO stage and learner_workers that wrote the checkpoint",
            )
        if "model" in state:
            raise ArpoError(
                "restoring weights through set_state is not supported under DeepSpeed",
                hint="weights come back through load_pretrained (the checkpoint's policy/ folder)",
            )
        super().set_state(state)  # each rank takes its own shard of the list (_load_optimizer_state)


class DeepSpeedBackend(DDPBackend):
    """``learner_workers`` ranks (GPU or CPU) with DeepSpeed ZeRO (see the module docstring)."""

    kind = "deepspeed"

    def __init__(
        self,
        model_path: str | Path,
        config: LearnerConfig,
        backend: BackendConfig,
        *,
        device: str = "cuda",
        seed: int = 0,
    ) -> None:
        self.learner_cls = functools.partial(
            DeepSpeedLearner, stage=backend.deepspeed_stage, offload=backend.deepspeed_offload
        )
        super().__init__(model_path, config, backend, device=device, seed=seed)

    def _check_available(self, config: LearnerConfig, backend: BackendConfig) -> None:
        require_deepspeed()

    def _rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._on_ranks(method, *args, every=True, **kwargs)[0]  # ZeRO-3 gathers are collective

    def replica_weights(self, rank: int) -> dict[str, torch.Tensor]:
        return self._on_ranks("cpu_state_dict")[rank]  # every rank joins the ZeRO-3 gather

    def get_state(self, *, include_model: bool = False) -> dict[str, Any]:
        states = self._on_ranks("get_state", include_model=include_model)
        state = dict(states[0])
        state["optimizer"] = [s["optimizer"] for s in states]
        return state


def build_cpu_extension() -> Path:
    """Build (or find already built) the C++ extension DeepSpeed needs on CPU, into :func:`extensions_dir`; a test
    or CI job calls this first so that no rank's start carries the one-off build. Returns the cache folder."""
    import_deepspeed("cpu")
    from deepspeed.comm.torch import build_shm_op

    if build_shm_op() is None:
        raise ArpoError(
            "DeepSpeed has no CPU communication extension for this machine",
            hint="check g++ and ninja are installed (pip install ninja), then run this again",
        )
    return extensions_dir()


if __name__ == "__main__":  # python -m arpo_algo.train.deepspeed_learner: build the CPU extension once
    print(build_cpu_extension())
