"""The ``ddp`` learner backend: data parallel over Ray actors with ``torch.distributed`` (gloo on CPU, NCCL on GPU).

**Why the step equals the single-process step.** :class:`~arpo_algo.train.learner.Learner` already divides every
micro-batch's loss by the normaliser of the WHOLE update (token mean over all trained tokens of the step, or the
sequence count for ``seq_mean``/``dr_grpo``) and accumulates gradients by summing micro-batches. A rank is one more
level of the same split: each rank gets whole groups (advantages and the entropy-aware z-score are per group),
:class:`DistributedLearner` makes the normalisers global (``_all_sum``/``_all_max`` of the counts), and the
gradients are SUMMED across ranks (not averaged), so the summed gradient is exactly the single-process accumulated
gradient up to float summation order. Clipping, the optimizer and the schedule then run on identical gradients on
every rank, so the replicas stay identical. The decisions are global too: no signal anywhere -> every rank skips; a
non-finite loss on any rank -> no rank steps. A parameter that got no gradient on any rank stays ``grad=None`` on
every rank, as in one process (AdamW skips it).

**Split.** The update's mini-batches are the single-process learner's
(:func:`~arpo_algo.train.learner.mini_batch_parts`, same seed and step); each is cut across the ranks, so every
optimizer step trains the same groups as in one process. Within a mini-batch, :func:`split_groups` gives each group
to the least-loaded rank, largest first, counting tokens as the learner packs them (prefix-trie nodes with
``dedup_prefix``, else padded tokens). A rank may get no group; it still joins every collective. Metrics: sums
over ranks for the weighted sums (losses, clip fractions, token counts), rank 0's value for what is identical
(grad_norm, lr, step, ...), pooled means for the advantage statistics; any other key is averaged over ranks.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

import torch

from arpo_algo.core.advantages import build_token_trie
from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.rollout.types import Group
from arpo_algo.train.backend_base import LearnerBackend
from arpo_algo.train.backend_config import BackendConfig, check_placement
from arpo_algo.train.learner import Learner, LearnerConfig, mini_batch_parts
from arpo_base.errors import ArpoError, ConfigError

__all__ = ["DDPBackend", "DistributedLearner", "combine_metrics", "split_groups"]

#: Elements per gradient all-reduce bucket (64 MiB of fp32).
BUCKET_ELEMENTS = 1 << 24
SUMMED = frozenset({LK.TOKENS, LK.TRAINED_TOKENS, LK.UNIQUE_TOKENS, LK.MICRO_BATCHES, *LK.STEP_SUMS})
#: A rank's trajectory count, sent with its metrics to weight the combined means (never logged).
_NUM_SEQS = "_num_seqs"
SAME = frozenset({LK.GRAD_NORM, LK.LR, LK.PARAM_CHANGE_NORM, LK.STEP, LK.SKIPPED_NAN, LK.SKIPPED_NO_SIGNAL})


# ------------------------------------------------------------------------------------------------ the rank's learner


class DistributedLearner(Learner):
    """A :class:`Learner` whose normalisers, decisions and gradients are global over the process group."""

    allow_empty_update = True

    def _reduce(self, x: float, op: Any) -> float:
        import torch.distributed as dist

        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def _all_sum(self, x: float) -> float:
        import torch.distributed as dist

        return self._reduce(x, dist.ReduceOp.SUM)

    def _all_max(self, x: float) -> float:
        import torch.distributed as dist

        return self._reduce(x, dist.ReduceOp.MAX)

    def _clip_grads(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        sum_gradients(params, self.device)
        return super()._clip_grads(params, max_norm)

    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        """This replica's weights as CPU tensors (with LoRA the adapter's only: the frozen base never changes)."""
        return {k: v.detach().cpu() for k, v in self.trainable_state().items()}

    def load_pretrained(self, path: str) -> None:
        from arpo_algo.models.lora import load_into_learner

        load_into_learner(self, path)


def sum_gradients(params: list[torch.nn.Parameter], device: torch.device, bucket: int = BUCKET_ELEMENTS) -> None:
    """All-reduce (sum) the gradients, flattened into buckets; a parameter with a gradient on some rank gets zeros
    where it has none, one without a gradient anywhere keeps ``None``."""
    import torch.distributed as dist

    has = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    live = []
    for p, flag in zip(params, has.tolist()):
        if flag:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            live.append(p)
    chunk: list[torch.nn.Parameter] = []

    def flush() -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in chunk])
        dist.all_reduce(flat)
        offset = 0
        for p in chunk:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
        chunk.clear()

    size = 0
    for p in live:
        if chunk and (size + p.numel() > bucket or p.grad.dtype != chunk[0].grad.dtype):
            flush()
            size = 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        flush()


# ------------------------------------------------------------------------------------------------------ the actor


class LearnerWorker:
    """One rank (a Ray actor): joins the process group, then holds a learner of ``learner_cls``."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.learner = rank, world_size, None

    def endpoint(self) -> dict[str, Any]:
        """Node, a free port on it, and the GPUs Ray gave this rank."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "port": port,
            "node": ctx.get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def setup(
        self,
        init_method: str,
        dist_backend: str,
        learner_cls: type,
        model_path: str,
        config: LearnerConfig,
        device: str,
        seed: int,
        timeout_s: float = 1800.0,
        lora: Any = None,
    ) -> None:
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes only this rank's GPU
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        # The variables a launcher (torchrun, deepspeed) gives each rank, which DeepSpeed reads and asserts:
        # LOCAL_RANK is the index of this rank's device among those Ray exposes to it (its one GPU, or the CPU).
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0", MASTER_ADDR=host, MASTER_PORT=port
        )
        dist.init_process_group(
            dist_backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # every rank seeds before injecting the adapter, so the replicas start from the same adapter weights
        extra = {"lora": lora} if lora is not None else {}
        self.learner = learner_cls(model_path, config, device=device, seed=seed, **extra)

    def update(self, groups: list[Group], parts: list[list[int]] | None = None) -> dict[str, float]:
        metrics = self.learner.update(groups, parts=parts)
        metrics[_NUM_SEQS] = float(sum(len(g.trajectories) for g in groups))
        return metrics

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``learner.<method>(*args, **kwargs)`` (get_state, set_state, cpu_state_dict, save_pretrained, ...)."""
        return getattr(self.learner, method)(*args, **kwargs)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- split and combine


def group_cost(group: Group, dedup_prefix: bool) -> int:
    """Tokens the learner runs for ``group`` (as its micro-batch packing counts them)."""
    seqs = [list(group.prompt_ids) + list(t.response_ids) for t in group.trajectories]
    if not seqs:
        return 0
    return build_token_trie(seqs).num_nodes if dedup_prefix else len(seqs) * max(map(len, seqs))


def split_groups(costs: list[int], num_ranks: int) -> list[list[int]]:
    """Group indices per rank: largest first onto the least-loaded rank (ties: lower index); each rank's indices in
    their original order."""
    loads, parts = [0] * num_ranks, [[] for _ in range(num_ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(num_ranks), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += costs[i]
    return [sorted(p) for p in parts]


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks' (see the module docstring)."""
    out: dict[str, float] = {}
    seqs = [m.pop(_NUM_SEQS, 0.0) for m in per_rank]
    trained = [m.get(LK.TRAINED_TOKENS, 0.0) for m in per_rank]
    for key in per_rank[0]:
        vals = [m.get(key, 0.0) for m in per_rank]
        if key in SUMMED:
            out[key] = sum(vals)
        elif key in SAME:
            out[key] = vals[0]
        elif key == LK.TRAJ_WITH_GRAD_FRAC:
            out[key] = sum(v * n for v, n in zip(vals, seqs)) / max(sum(seqs), 1.0)
        elif key not in (LK.ADV_MEAN, LK.ADV_SD):
            out[key] = sum(vals) / len(vals)
    if LK.ADV_MEAN in per_rank[0]:
        n = sum(trained)
        mean = sum(m[LK.ADV_MEAN] * t for m, t in zip(per_rank, trained)) / n if n else 0.0
        second = sum((m[LK.ADV_SD] ** 2 + m[LK.ADV_MEAN] ** 2) * t for m, t in zip(per_rank, trained)) / n if n else 0.0
        out[LK.ADV_MEAN], out[LK.ADV_SD] = mean, max(second - mean * mean, 0.0) ** 0.5
    return out


# ---------------------------------------------------------------------------------------------------- the backend


class DDPBackend(LearnerBackend):
    """``learner_workers`` Ray actors, one replica each (see the module docstring). Needs Ray running.

    ``save_pretrained`` and ``load_pretrained`` run in the ranks, so their paths must be reachable from the ranks'
    nodes (any path on a one-node cluster).
    """

    learner_cls: type = DistributedLearner
    kind = "ddp"

    def __init__(
        self,
        model_path: str | Path,
        config: LearnerConfig,
        backend: BackendConfig,
        *,
        device: str = "cpu",
        seed: int = 0,
        lora: Any = None,
    ) -> None:
        import ray
        from transformers import AutoTokenizer

        from arpo_algo.models import resolve_model_path

        config.validate()
        self._check_available(config, backend)
        if not ray.is_initialized():
            raise ConfigError(
                f"learner_backend={self.kind!r} needs a running Ray cluster",
                hint="call ray.init() first (ARPO's Algorithm starts Ray itself when needed)",
            )
        check_placement(backend, device)
        self.config, self.backend, self.step, self.seed, self._workers = config, backend, 0, seed, []
        self.rank_nodes: list[str] = []
        #: Each rank's own metrics of the last update (diagnostics: what each rank did).
        self.last_rank_metrics: list[dict[str, float]] = []
        path = str(resolve_model_path(model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        #: The modules the adapter is on (empty: full weights), checked here before any rank loads a weight.
        self.lora_targets: tuple[str, ...] = ()
        if lora is not None and lora.enabled:
            from arpo_algo.models.lora import resolve_targets

            self.lora_targets = resolve_targets(lora, path)
        n, gpus = backend.learner_workers, backend.gpus_per_worker(device)
        actor = ray.remote(num_cpus=backend.learner_cpus_per_worker, num_gpus=gpus)(LearnerWorker)
        from arpo_algo.rollout.config import per_actor

        self._workers = [
            actor.options(resources=res).remote(rank, n) if res else actor.remote(rank, n)
            for rank, res in enumerate(per_actor(backend.worker_resources, n))
        ]
        try:
            ends = ray.get([w.endpoint.remote() for w in self._workers])
            #: The Ray node of each rank, in rank order (where ``backend.worker_resources`` placed them).
            self.rank_nodes = [e["node"] for e in ends]
            self._check_devices(ends, device)
            host = "127.0.0.1" if len({e["node"] for e in ends}) == 1 else ends[0]["ip"]
            init = f"tcp://{host}:{ends[0]['port']}"
            dist_backend = "nccl" if device == "cuda" else "gloo"
            ray.get(
                [
                    w.setup.remote(
                        init,
                        dist_backend,
                        self.learner_cls,
                        path,
                        config,
                        device,
                        seed,
                        backend.collective_timeout_s,
                        lora,
                    )
                    for w in self._workers
                ]
            )
        except BaseException:
            self.close()
            raise

    def _check_available(self, config: LearnerConfig, backend: BackendConfig) -> None:
        """Backend-specific checks before any actor starts (DeepSpeed: the package)."""

    @staticmethod
    def _check_devices(ends: list[dict[str, Any]], device: str) -> None:
        if device != "cuda":
            return
        seen: dict[tuple[str, str], int] = {}
        for rank, e in enumerate(ends):
            for gpu in e["gpus"]:
                if (e["node"], gpu) in seen:
                    raise ConfigError(
                        f"Ray placed learner ranks {seen[e['node'], gpu]} and {rank} on the same GPU "
                        f"({gpu}); NCCL needs one device per rank",
                        hint="learner_placement='split', or a colocated share that Ray cannot pack twice onto one GPU",
                    )
                seen[e["node"], gpu] = rank

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def update(self, groups: list[Group]) -> dict[str, float]:
        import ray

        if not groups:
            raise ArpoError("update() got no groups")
        costs = [group_cost(g, self.config.dedup_prefix) for g in groups]
        ranks = len(self._workers)
        # The single-process learner's mini-batches, each cut across the ranks: every optimizer step is the same
        # step on the same groups as in one process (a rank's share of a mini-batch may be empty).
        rank_groups: list[list[int]] = [[] for _ in range(ranks)]
        rank_parts: list[list[list[int]]] = [[] for _ in range(ranks)]
        for part in mini_batch_parts(len(groups), self.config.mini_batch_count, self.seed, self.step):
            for r, share in enumerate(split_groups([costs[i] for i in part], ranks)):
                rank_parts[r].append(list(range(len(rank_groups[r]), len(rank_groups[r]) + len(share))))
                rank_groups[r].extend(part[j] for j in share)
        per_rank = ray.get(
            [
                w.update.remote([groups[i] for i in mine], parts)
                for w, mine, parts in zip(self._workers, rank_groups, rank_parts)
            ]
        )
        self.last_rank_metrics = [dict(m) for m in per_rank]
        out = combine_metrics(per_rank)
        out[LK.LEARNER_WORKERS] = float(ranks)
        out[LK.RANK_TOKEN_IMBALANCE] = max(sum(costs[i] for i in mine) for mine in rank_groups) / max(
            sum(costs) / ranks, 1
        )
        self.step = int(out.get(LK.STEP, self.step))
        return out

    def _on_ranks(self, method: str, *args: Any, every: bool = True, **kwargs: Any) -> list[Any]:
        """``learner.<method>(*args, **kwargs)`` on every rank (or on rank 0 only), in rank order."""
        import ray

        workers = self._workers if every else self._workers[:1]
        return ray.get([w.call.remote(method, *args, **kwargs) for w in workers])

    def _rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """What rank 0 returns; DDP asks rank 0 alone (replicas are identical), DeepSpeed asks all (gathers)."""
        return self._on_ranks(method, *args, every=False, **kwargs)[0]

    def get_state(self, *, include_model: bool = False) -> dict[str, Any]:
        return self._rank0("get_state", include_model=include_model)

    def set_state(self, state: dict[str, Any]) -> None:
        import ray

        for key in ("optimizer", "scheduler", "step", "nan_streak", "skipped_total", "rng"):
            if key not in state:
                raise ArpoError(f"learner state lacks {key!r}", hint="pass a dict produced by get_state()")
        ref = ray.put(state)
        ray.get([w.call.remote("set_state", ref) for w in self._workers])
        self.step = int(state["step"])

    def save_pretrained(self, out_dir: str | Path) -> Path:
        return Path(self._rank0("save_pretrained", str(out_dir)))

    def load_pretrained(self, path: str | Path) -> None:
        self._on_ranks("load_pretrained", str(path))

    def rollout_weights(self) -> dict[str, Any]:
        return self._rank0("cpu_state_dict")

    def replica_weights(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s weights (CPU tensors); every rank holds the same after each step."""
        import ray

        return ray.get(self._workers[rank].call.remote("cpu_state_dict"))

    def close(self) -> None:
        import ray

        workers, self._workers = self._workers, []
        if workers:
            try:
                ray.get([w.close.remote() for w in workers], timeout=10)
            except Exception:  # noqa: BLE001 - a rank that died cannot leave its group; the kill below still runs
                pass
            for w in workers:
                ray.kill(w)
