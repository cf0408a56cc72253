"""BackendConfig: where and how the learner runs (one process, data parallel over Ray, or DeepSpeed ZeRO), and the
placement check that runs before any worker starts. The backends themselves: :mod:`arpo_algo.train.backends`.

These settings are an experiment's ``[backend]`` section (``learner_backend = "ddp"``, ``learner_workers = 2``, ...)
and ``ARPOConfig.backend(...)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.options import check_choice, dataclass_from_dict

BACKENDS = ("local", "ddp", "deepspeed")
PLACEMENTS = ("colocated", "split")
OFFLOADS = ("none", "optimizer", "optimizer_and_parameters")


@dataclass(frozen=True)
class BackendConfig:
    """Learner backend settings.

    Attributes:
        learner_backend: "local" (default: the learner in the main process, CPU or GPU, as before), "ddp" (data
            parallel: ``learner_workers`` Ray actors, each with a full model replica; ``torch.distributed`` with gloo
            on CPU and NCCL on GPU; the step equals the local step) or "deepspeed" (ZeRO stage ``deepspeed_stage``
            over ``learner_workers`` actors, gloo on CPU and NCCL on GPU; needs the ``deepspeed`` extra).
        learner_workers: Number of learner ranks (1 with "local").
        learner_placement: Where ddp/deepspeed ranks go on GPU: "split" = every rank has a GPU of its own, apart
            from the rollout's; "colocated" = ranks share GPUs with the rollout engine, each reserving
            ``learner_gpus_per_worker`` (< 1) of a device.
        learner_gpus_per_worker: The GPU share each rank reserves (None = 1 with device="cuda"; must stay None on
            CPU).
        learner_cpus_per_worker: CPUs each rank reserves.
        deepspeed_stage: ZeRO stage, 2 (optimizer state and gradients sharded) or 3 (parameters too).
        deepspeed_offload: ZeRO-Offload on GPU: "none", "optimizer" (optimizer state and step in CPU memory) or
            "optimizer_and_parameters" (ZeRO-3 only: the parameter shards too). Refused on CPU, where it would move
            tensors into the memory they are already in.
        worker_resources: Ray custom resources per learner rank, to place ranks on chosen nodes: one table for every
            rank or one per rank (``[{node_a = 1}, {node_b = 1}]`` puts the two ranks on the nodes that offer them);
            checked against the cluster before any rank starts.
        collective_timeout_s: How long a rank waits in a collective (all-reduce) for the others before it fails: the
            bound on a step whose peer rank is unreachable but not known dead (a dead peer fails it at once).
        main_resources: Ray custom resources the main process asks for (``{node_a = 1}``): under ``arpo tune`` a
            trial's own process (the Algorithm, and the learner when it is local) runs on a node that offers them.
            Only a Tune trial can be placed: an Algorithm that runs in the driver (``arpo train``, ``build()`` in a
            script) refuses it, since the driver stays on the node where it was started.
    """

    learner_backend: str = "local"
    learner_workers: int = 1
    learner_placement: str = "split"
    learner_gpus_per_worker: float | None = None
    learner_cpus_per_worker: float = 1.0
    deepspeed_stage: int = 2
    deepspeed_offload: str = "none"
    worker_resources: tuple[dict[str, float], ...] = ()
    collective_timeout_s: float = 1800.0
    main_resources: dict[str, float] = field(default_factory=dict, hash=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BackendConfig:
        """Build from a dict; unknown keys and wrong types raise ConfigError."""
        cfg = dataclass_from_dict(cls, d, "backend")
        cfg.validate()
        return cfg

    @property
    def distributed(self) -> bool:
        """True when the learner runs in worker actors rather than in this process."""
        return self.learner_backend != "local"

    def validate(self) -> None:
        """Checks that do not depend on the device or the cluster (those: :func:`check_placement`)."""
        check_choice("learner_backend", self.learner_backend, BACKENDS, "backend")
        check_choice("learner_placement", self.learner_placement, PLACEMENTS, "backend")
        check_choice("deepspeed_stage", self.deepspeed_stage, (2, 3), "backend")
        check_choice("deepspeed_offload", self.deepspeed_offload, OFFLOADS, "backend")
        if self.deepspeed_offload != "none" and self.learner_backend != "deepspeed":
            raise ConfigError(
                f"backend.deepspeed_offload={self.deepspeed_offload!r} with learner_backend="
                f"{self.learner_backend!r}: only the deepspeed backend offloads",
                hint="set learner_backend='deepspeed', or leave deepspeed_offload='none'",
            )
        if self.deepspeed_offload == "optimizer_and_parameters" and self.deepspeed_stage != 3:
            raise ConfigError(
                f"backend.deepspeed_offload='optimizer_and_parameters' needs deepspeed_stage=3 (got "
                f"{self.deepspeed_stage}): ZeRO-2 keeps every parameter on each rank's GPU",
                hint="set deepspeed_stage=3, or deepspeed_offload='optimizer'",
            )
        if self.learner_workers < 1:
            raise ConfigError(f"backend.learner_workers must be >= 1, got {self.learner_workers}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"backend.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.learner_cpus_per_worker <= 0:
            raise ConfigError(f"backend.learner_cpus_per_worker must be > 0, got {self.learner_cpus_per_worker}")
        if self.learner_gpus_per_worker is not None and not self.learner_gpus_per_worker > 0:
            raise ConfigError(
                f"backend.learner_gpus_per_worker must be > 0 or None, got {self.learner_gpus_per_worker}"
            )
        from arpo_algo.rollout.config import check_custom_resources

        check_custom_resources(
            "backend.worker_resources", self.worker_resources, self.learner_workers, "backend.learner_workers"
        )
        check_custom_resources(
            "backend.main_resources", (self.main_resources,) if self.main_resources else (), 1, "one main process"
        )
        if not self.distributed:
            changed = [
                k
                for k, v in (
                    ("learner_workers", self.learner_workers != 1),
                    ("worker_resources", bool(self.worker_resources)),
                    ("collective_timeout_s", self.collective_timeout_s != 1800.0),
                    ("learner_placement", self.learner_placement != "split"),
                    ("learner_gpus_per_worker", self.learner_gpus_per_worker is not None),
                    ("learner_cpus_per_worker", self.learner_cpus_per_worker != 1.0),
                )
                if v
            ]
            if changed:
                raise ConfigError(
                    f"backend.{changed[0]} is set but learner_backend='local' runs one learner in the main process",
                    hint="set learner_backend='ddp' (or 'deepspeed' on GPUs)",
                )

    def check_device(self, device: str) -> None:
        """The device-dependent checks (offload only from GPUs; GPU shares only on GPUs and as the placement
        allows)."""
        if self.deepspeed_offload != "none" and device != "cuda":
            raise ConfigError(
                f"backend.deepspeed_offload={self.deepspeed_offload!r} with device={device!r}: the "
                "learner already runs in CPU memory, so offloading to it would move nothing",
                hint="leave deepspeed_offload='none' on CPU (it is for rollouts.device='cuda')",
            )
        if self.learner_backend == "deepspeed":
            require_deepspeed()
        self.gpus_per_worker(device)

    def gpus_per_worker(self, device: str) -> float:
        """The GPU share one rank reserves on ``device`` (device-dependent checks included)."""
        g = self.learner_gpus_per_worker
        if device != "cuda":
            if g is not None:
                raise ConfigError(
                    f"backend.learner_gpus_per_worker={g} with device={device!r}",
                    hint="GPU shares need rollouts.device='cuda'; leave it unset on CPU",
                )
            return 0.0
        g = 1.0 if g is None else float(g)
        if self.learner_placement == "split" and g != 1.0:
            raise ConfigError(
                f"backend.learner_gpus_per_worker={g} with learner_placement='split': a data-parallel "
                "rank drives exactly one GPU of its own",
                hint="leave it unset (1), or use learner_placement='colocated' with a share < 1",
            )
        if self.learner_placement == "colocated" and g >= 1.0:
            raise ConfigError(
                f"backend.learner_gpus_per_worker={g} with learner_placement='colocated' leaves no "
                "share of the GPU for the rollout engine",
                hint="use a share such as 0.5, or learner_placement='split'",
            )
        return g

    def worker_bundles(self, device: str) -> list[dict[str, float]]:
        """One Ray resource bundle per learner rank (none for "local": the learner is the main process)."""
        if not self.distributed:
            return []
        from arpo_algo.rollout.config import per_actor

        bundle = {"CPU": float(self.learner_cpus_per_worker)}
        gpu = self.gpus_per_worker(device)
        if gpu:
            bundle["GPU"] = gpu
        return [{**bundle, **custom} for custom in per_actor(self.worker_resources, self.learner_workers)]


def require_deepspeed() -> None:
    """Refuse the deepspeed backend where its package is missing (checked with the settings, before any worker)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "learner_backend='deepspeed' needs the deepspeed package, which is not installed",
            hint="pip install 'arpo[deepspeed]' (the deepspeed extra), or use learner_backend='ddp'",
        )


def cluster_resources() -> tuple[dict[str, float], str]:
    """What exists: ``ray.cluster_resources()`` when Ray runs, else this machine; and a name for it."""
    import ray

    if ray.is_initialized():
        have = {k: float(v) for k, v in ray.cluster_resources().items()}
        return {**have, "CPU": have.get("CPU", 0.0), "GPU": have.get("GPU", 0.0)}, "the Ray cluster"
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}, "this machine"


def check_placement(
    cfg: BackendConfig, device: str, *, others: dict[str, float] | None = None, others_label: str = "the rest"
) -> None:
    """Refuse, before any worker starts, a learner that the cluster cannot hold.

    Args:
        cfg: The backend settings.
        device: "cpu" or "cuda".
        others: CPUs/GPUs the rest of the run reserves besides the learner ranks (main process, rollout actors).
        others_label: How the message names ``others``.

    Raises:
        ConfigError: Listing what was asked and what exists: more GPUs or CPUs than the cluster has, or fewer GPUs
            than data-parallel ranks (each rank needs a device of its own), or DeepSpeed offload on CPU.
    """
    cfg.validate()
    cfg.check_device(device)
    bundles = cfg.worker_bundles(device)
    others = others or {}
    need = {k: sum(b.get(k, 0.0) for b in bundles) + float(others.get(k, 0.0)) for k in ("CPU", "GPU")}
    have, where = cluster_resources()
    asked = (
        f"learner_backend={cfg.learner_backend!r}, learner_placement={cfg.learner_placement!r}, device="
        f"{device!r}: {len(bundles)} learner worker(s) x {bundles[0] if bundles else {}} + "
        f"{ {k: float(v) for k, v in others.items() if v} } for {others_label} = {need['GPU']:g} GPU(s), "
        f"{need['CPU']:g} CPU(s)"
    )
    exists = f"{where} has {have['GPU']:g} GPU(s), {have['CPU']:g} CPU(s)"
    hint = (
        "lower backend.learner_workers / backend.learner_cpus_per_worker, use rollouts.device='cpu', or start "
        "Ray on a bigger cluster"
    )
    if need["GPU"] > have["GPU"] + 1e-9 or need["CPU"] > have["CPU"] + 1e-9:
        raise ConfigError(f"the learner placement cannot be satisfied: asked {asked}; {exists}", hint=hint)
    if device == "cuda" and bundles and len(bundles) > have["GPU"]:
        raise ConfigError(
            f"{len(bundles)} data-parallel ranks need {len(bundles)} distinct GPUs (NCCL cannot put "
            f"two ranks on one device); asked {asked}; {exists}",
            hint=hint,
        )
