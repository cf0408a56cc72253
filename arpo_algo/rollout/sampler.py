"""TreeSampler: grows ARPO/AEPO sampling trees (or GRPO groups) by driving a rollout engine and tool environments.

One environment per trajectory (``env_creator()`` + ``reset(options={"task_index": i})``, cloned with
``env.clone()`` at branch points); every live trajectory of a prompt decodes in each of that prompt's rounds, and the
tool calls of a round run concurrently. By default all prompts share one engine call per round; with
``schedule="waves"`` (an engine that takes requests into a running call: the HF engine) a prompt whose round has ended
starts its next round inside the same engine call, so the batch can stay full. Both grow the same trees.

Every question that shapes the tree is answered by the pure functions of
:mod:`arpo_algo.core.tree` and the branch-point policy in effect (:mod:`arpo_algo.core.branching`: the policy also says
when it is asked, after the look-ahead or right after the tool result); tree.py's docstring lists the deliberate
choices
(docs/concepts/reference-choices.md#deliberate-choices).

Tokenization (docs/concepts/arpo.md#token-layout) is :mod:`arpo_algo.rollout.layout`'s rule and each turn is handled by
the agent loop's code (:mod:`arpo_algo.rollout.agent_loop`: decode the action, step the env, append the result), so a
GRPO trajectory equals :func:`~arpo_algo.rollout.agent_loop.run_agents` with the same seeds. Nothing is ever
re-tokenized, so branch
prefixes are token-identical.

AEPO pre-monitoring without the reference's discarded trajectory (``aepo_premonitor_keep=False``): the first initial
sample of each prompt is the probe. It starts alone; ``H_root`` is the entropy of its first segment and ``H_tool`` the
entropy of its first segment after a tool result (``H_root`` when it ends without one). Then the other ``m - 1``
initial samples start. Nothing is thrown away; the price is latency for that prompt, not compute.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arpo_algo.core import tree as T
from arpo_algo.core.branching import mean_logprob_gain
from arpo_algo.rollout import layout
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.agent_loop import absorb, action_text, apply_turn, safe_call, turn_from_env
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.rollout.engines.base import Generation, GenRequest, RolloutEngine, SamplingParams, Tally, new_tally
from arpo_algo.rollout.stops import first_stop_end
from arpo_algo.rollout.tree_state import Path, PromptState, assemble_group
from arpo_algo.rollout.types import Group
from arpo_base.errors import ArpoError, ConfigError

log = logging.getLogger(__name__)
OVERFLOW_POLICIES = ("error", "left_truncate")
SCHEDULES = ("auto", "waves", "rounds")


class _RecordedRandom:
    """The prompt's branch RNG, keeping each draw for the recorded trees (the sequence of draws is unchanged)."""

    def __init__(self, rng: Any, draws: list[float]) -> None:
        self.rng, self.draws = rng, draws

    def random(self) -> float:
        u = self.rng.random()
        self.draws.append(u)
        return u


class TreeSampler:
    """Samples one :class:`~arpo_algo.rollout.types.Group` of exactly ``tree.budget`` trajectories per prompt.

    Args:
        engine: A :class:`~arpo_algo.rollout.engines.base.RolloutEngine` (its ``tokenizer`` is used for all text).
        env_creator: Returns a fresh tool environment with ``clone()`` and ``stop_sequences`` (an
            ``arpo_env.ToolTextEnv``, or ``gym.make(id).unwrapped``: Gymnasium wrappers do not forward ``clone``).
        tree: The tree settings (validated here).
        sampling: Temperature/top-p/top-k; ``max_new_tokens``, ``stop``, ``seed`` are set per request.
        max_response_tokens: Budget per trajectory of every token after the prompt (tool results included).
        tool_workers: Threads that run the environment steps (tool calls) of one round concurrently.
        prompt_overflow: "error" (raise :class:`ArpoError` naming the task) or "left_truncate" (keep the last
            ``max_prompt_tokens`` tokens) for prompts longer than ``max_prompt_tokens``.
        max_prompt_tokens: Prompt limit; ``None`` = the engine's ``max_context`` minus ``max_response_tokens``
            (no limit when ``max_context`` is None).
        train_tool_limit_eos: Train the EOS appended when the tool-call limit ends a trajectory (reference: True,
            docs/concepts/arpo.md#limit-eos); False masks it.
        seed: Base seed; per (seed, step, prompt, trajectory, request) seeds make the same seed give the same tree.
        schedule: "rounds" (the default: one engine call per round for all prompts), "waves" (one engine call per
            step: a prompt whose round ended starts its next one inside the running call, see :meth:`_run_waves`;
            engines whose ``joins_requests`` is True only) or "auto" (waves where the engine joins requests and the
            tree does not use ``legacy_stale_baseline``, whose baseline is keyed by lockstep batch positions; else
            rounds). Both grow the same trees (``rollouts.schedule`` in an experiment); waves took the quickstart's
            CPU step at 1.07x the tokens/s of rounds and its whole ARPO stage at 1.03x, idle
            (``python -m benchmarks.rollout_schedule``, docs/results/speed.md): too little for a default.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        env_creator: Callable[[], Any],
        tree: T.TreeConfig,
        sampling: SamplingParams,
        max_response_tokens: int,
        tool_workers: int = 8,
        prompt_overflow: str = "error",
        max_prompt_tokens: int | None = None,
        train_tool_limit_eos: bool = True,
        seed: int = 0,
        schedule: str = "rounds",
    ) -> None:
        tree.validate()
        limit = getattr(engine, "max_logprobs", None) if tree.entropy_method == "topk_sum_lnV" else None
        if limit is not None and tree.topk_logprobs > limit:
            # Invariant: every request the tree asks for is servable; an engine refuses more logprobs per token than
            # its max_logprobs, so each trajectory would end in an engine error instead of being sampled.
            raise ConfigError(
                f"tree.topk_logprobs={tree.topk_logprobs} is more than this rollout engine returns "
                f"(at most {limit} logprobs per token)",
                hint=f"lower tree.topk_logprobs to at most {limit} (the reference uses 10)",
            )
        if prompt_overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"prompt_overflow={prompt_overflow!r} is not one of {OVERFLOW_POLICIES}")
        if max_response_tokens < 1 or tool_workers < 1:
            raise ConfigError("max_response_tokens and tool_workers must be >= 1")
        self.schedule = _resolve_schedule(schedule, engine, tree)
        self.engine, self.env_creator, self.cfg, self.sampling = engine, env_creator, tree, sampling
        self.tok = engine.tokenizer
        self.max_response_tokens = max_response_tokens
        self.prompt_overflow = prompt_overflow
        if max_prompt_tokens is None and engine.max_context is not None:
            max_prompt_tokens = engine.max_context - max_response_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.train_tool_limit_eos = train_tool_limit_eos
        self.seed = seed
        self.vocab_size = len(self.tok.get_vocab())
        self.eos_id = self.tok.eos_token_id
        self._pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="arpo-tools")
        self._stale: dict[int, float] = {}  # legacy_stale_baseline: sampler-lifetime baseline by batch index
        self._timers: Tally = new_tally()
        self._keys: set[Any] = set()
        self._batch_index = 0
        self._policies: dict[T.TreeConfig, T.BranchPolicy] = {}

    @classmethod
    def from_config(
        cls,
        engine: RolloutEngine,
        env_creator: Callable[[], Any],
        tree: T.TreeConfig,
        rollouts: RolloutsConfig,
        *,
        seed: int = 0,
        schedule: str | None = None,
    ) -> TreeSampler:
        """The training sampler of a ``[tree]`` and a ``[rollouts]`` section, taken as they are (``schedule``:
        ``rollouts.schedule`` unless given)."""
        env = env_creator()
        sampling = SamplingParams(
            max_new_tokens=rollouts.max_response_tokens,
            temperature=rollouts.temperature,
            top_p=rollouts.top_p,
            top_k=rollouts.top_k,
            stop=tuple(env.stop_sequences),
        )
        return cls(
            engine,
            env_creator,
            tree,
            sampling,
            max_response_tokens=rollouts.max_response_tokens,
            tool_workers=rollouts.tool_workers,
            prompt_overflow=rollouts.prompt_overflow,
            train_tool_limit_eos=rollouts.train_tool_limit_eos,
            seed=seed,
            schedule=rollouts.schedule if schedule is None else schedule,
        )

    def close(self) -> None:
        """Stop the tool thread pool."""
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------------ public API
    def sample(
        self, task_indices: list[int], step: int, policy_version: int | None = None
    ) -> tuple[list[Group], dict[str, float]]:
        """Grow one tree per task; returns the groups (in ``task_indices`` order) and the step's rollout metrics.

        ``policy_version``: the version of the weights the engine holds; every group, node and trajectory records it
        (the caller changes the engine's weights only between calls, so a tree is sampled under one version)."""
        t0 = time.perf_counter()
        self._timers, self._batch_index, self._keys = new_tally(), 0, set()
        self.engine.stats()  # reset the engine counters so the step's numbers are this step's only
        prompts = [self._new_prompt(ti, step) for ti in task_indices]
        cfg = self.cfg
        lazy = cfg.premonitor_on and not cfg.aepo_premonitor_keep
        if cfg.premonitor_on and cfg.aepo_premonitor_keep:
            self._premonitor_reference(prompts, step)
        for ps in prompts:
            ps.pending_m = lazy
            n_first = 1 if lazy else (ps.m if ps.m is not None else cfg.initial)
            for _ in range(n_first):
                self._spawn(ps, "initial")
        try:
            self._run(prompts, cfg)
        finally:  # persistent interpreters end with the step, whatever ended it
            _close_envs([ps.template, *(p.env for p in ps.paths)] for ps in prompts)
        self.engine.release(sorted(self._keys, key=str))
        groups = [assemble_group(ps, step, policy_version) for ps in prompts]
        self._timers[MK.TIMER_TOTAL] = time.perf_counter() - t0
        metrics = MK.summarize(
            groups, paths=[p for ps in prompts for p in ps.paths], engine_stats=self.engine.stats(), timers=self._timers
        )
        from arpo_env.tools.interpreter import interpreter_metrics

        metrics.update(interpreter_metrics())  # persistent interpreters' forks, count and memory ({} without them)
        return groups, metrics

    # -------------------------------------------------------------------------------------------------- set-up
    def _new_prompt(self, task_index: int, step: int) -> PromptState:
        env = self.env_creator()
        if not callable(getattr(env, "clone", None)):
            raise ConfigError(
                f"env_creator returned {type(env).__name__}, which has no clone()",
                hint="return arpo_env.ToolTextEnv(...) or gym.make(id).unwrapped",
            )
        _, info = env.reset(options={"task_index": task_index})
        ids = layout.prompt_ids(self.tok, info["messages"])
        limit = self.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            if self.prompt_overflow == "error":
                raise ArpoError(
                    f"prompt of task {task_index} has {len(ids)} tokens, more than the {limit} allowed "
                    f"(context minus max_response_tokens={self.max_response_tokens})",
                    hint="shorten the prompt, lower max_response_tokens, or set prompt_overflow='left_truncate'",
                )
            ids = ids[-limit:]
        return PromptState(
            task_index=task_index,
            prompt_ids=ids,
            template=env,
            # with its answer, read from the task list: info withholds it unless the env config exposes it
            task=env.task_record(task_index) if hasattr(env, "task_record") else dict(info["task"]),
            step=step,
            rng=T.branch_rng(self.seed, step, task_index),
        )

    def _spawn(self, ps: PromptState, kind: str) -> Path:
        p = Path(tid=len(ps.paths), batch_index=self._batch_index, env=ps.template.clone(), kind=kind)
        # A root path's interpreters draw from (seed, step, prompt, trajectory); a branch's continue its parent's.
        seed_tools = getattr(p.env, "seed_tools", None)
        if callable(seed_tools):
            seed_tools(T.tools_seed(self.seed, ps.step, ps.task_index, p.tid))
        self._batch_index += 1
        ps.paths.append(p)
        ps.count += 1
        return p

    # ------------------------------------------------------------------------------------------------ main loop
    def _run(self, prompts: list[PromptState], cfg: T.TreeConfig) -> None:
        """Decoding rounds until every path of every prompt has ended and every budget is spent."""
        if self.schedule == "waves":
            self._run_waves(prompts, cfg)
            return
        while True:
            live = [(ps, p) for ps in prompts for p in ps.paths if not p.done]
            if not live:
                return
            reqs = [self._request(ps, p, cfg) for ps, p in live]
            t = time.perf_counter()
            gens = self.engine.generate(reqs)
            self._timers[MK.TIMER_GENERATE] += time.perf_counter() - t
            self._end_round([(ps, p, gen) for (ps, p), gen in zip(live, gens)], prompts, cfg, prompts)

    def _run_waves(self, prompts: list[PromptState], cfg: T.TreeConfig) -> None:
        """The rounds of :meth:`_run`, each prompt on its own clock inside one engine call: when the last request of
        a prompt's round finishes, that prompt's round ends (:meth:`_end_round`, the same code and order as in
        lockstep) and its next requests join the running call while other prompts' rows still decode. A prompt's
        round still waits for all of its own requests, its decisions draw from its own RNG and every request has
        its own seed, so each tree is the one lockstep rounds grow (up to floating-point ties in the batch)."""
        owner: list[tuple[PromptState, int]] = []  # by request index in the call: its prompt and place in the round
        rounds: dict[int, list[list[Any]]] = {}  # id(prompt) -> [path, generation or None] of its running round
        waiting: dict[int, int] = {}
        hooks = 0.0

        def start(ps: PromptState) -> list[GenRequest]:
            live = [p for p in ps.paths if not p.done]
            rounds[id(ps)], waiting[id(ps)] = [[p, None] for p in live], len(live)
            owner.extend((ps, j) for j in range(len(live)))
            return [self._request(ps, p, cfg) for p in live]

        def on_finish(i: int, gen: Generation) -> list[GenRequest]:
            nonlocal hooks
            ps, j = owner[i]
            rounds[id(ps)][j][1] = gen
            waiting[id(ps)] -= 1
            if waiting[id(ps)]:
                return []
            t = time.perf_counter()
            self._end_round([(ps, p, g) for p, g in rounds.pop(id(ps))], [ps], cfg, prompts)
            more = start(ps) if any(not p.done for p in ps.paths) else []
            hooks += time.perf_counter() - t
            return more

        reqs = [r for ps in prompts for r in start(ps)]
        t = time.perf_counter()
        if reqs:
            self.engine.generate(reqs, on_finish=on_finish)  # type: ignore[call-arg]
        self._timers[MK.TIMER_GENERATE] += time.perf_counter() - t - hooks  # the prompts' rounds count as their own

    def _end_round(
        self,
        done: list[tuple[PromptState, Path, Generation]],
        ended: list[PromptState],
        cfg: T.TreeConfig,
        prompts: list[PromptState],
    ) -> None:
        """End the round of the prompts in ``ended`` whose requests are all in (``done``, in path order): absorb,
        decide, step the tool envs, start fill-ups; then give back the KV no live path of any of ``prompts`` holds.
        Only ``ended``'s own paths, RNGs and counters change, so ending prompts together or one by one grows the
        same trees."""
        from arpo_env.tools.interpreter import live_interpreters, sample_interpreter_memory

        to_step: list[tuple[PromptState, Path]] = []
        lookaheads: list[tuple[PromptState, Path, int]] = []
        for ps, p, gen in done:
            self._absorb(ps, p, gen, cfg, to_step, lookaheads)
        gained = {id(ps): False for ps in ended}
        for ps, p, bp in lookaheads:  # look-ahead policies: decide before the source's env moves on (clones copy it)
            gained[id(ps)] |= self._decide(ps, p, bp, cfg)
        for ps, p in self._step_envs(to_step, cfg):  # the other policies: right after the tool result
            if not self._policy(cfg).lookahead:
                gained[id(ps)] |= self._decide(ps, p, len(p.response), cfg)
        for ps in ended:
            if ps.pending_m:
                self._resolve_premonitor(ps)
            alive = any(not p.done for p in ps.paths)
            n_new = 0 if ps.pending_m else T.fillup_count(cfg, ps.count, alive)
            for _ in range(n_new):
                self._spawn(ps, "fillup")
            ps.consecutive = T.next_prompt_consecutive(ps.consecutive, gained[id(ps)] or n_new > 0)
        self._release_unused(prompts)
        if live_interpreters():  # the round's calls and forks are done, its finished paths not yet closed
            sample_interpreter_memory()
        _close_envs([p.env for p in ps.paths if p.done] for ps in ended)  # a finished path holds no tool state

    def _path_seed(self, ps: PromptState, p: Path) -> int:
        """The sampling seed of a path's next request. Invariant: no two paths of a step share one; the discarded
        pre-monitoring path (its own trajectory numbering starts at 0 too) draws from a namespace of its own, so it
        is an independent sample and not a replay of trajectory 0."""
        if p.kind == "premonitor":
            return T.derive_seed(self.seed, ps.step, ps.task_index, "premonitor", p.tid, p.n_requests)
        return T.derive_seed(self.seed, ps.step, ps.task_index, p.tid, p.n_requests)

    def _request(self, ps: PromptState, p: Path, cfg: T.TreeConfig) -> GenRequest:
        room = self.max_response_tokens - len(p.response)
        params = dataclasses.replace(
            self.sampling,
            max_new_tokens=min(room, cfg.entropy_tokens) if p.lookahead else room,
            stop=tuple(p.env.stop_sequences),
            seed=self._path_seed(ps, p),
            logprobs_topk=cfg.topk_logprobs if cfg.entropy_method == "topk_sum_lnV" else self.sampling.logprobs_topk,
        )
        return p.request((ps.task_index, p.tid, p.n_requests + 1), ps.prompt_ids, params)

    def _absorb(
        self, ps: PromptState, p: Path, gen: Generation, cfg: T.TreeConfig, to_step: list, lookaheads: list
    ) -> None:
        """Append one generation to its path and sort the path: continue, look-ahead decision, or env step."""
        start = absorb(p, gen)
        if gen.cache_key is not None:
            self._keys.add(gen.cache_key)
        was_lookahead, p.lookahead = p.lookahead, False
        if start > p.turn_start and gen.finish_reason != "error":  # a continuation: a stop may span the boundary
            cut = first_stop_end(self.tok, p.response[p.turn_start :], start - p.turn_start, p.env.stop_sequences)
            if cut is not None and p.turn_start + cut < len(p.response):
                p.truncate(p.turn_start + cut)  # see arpo_algo.rollout.stops
                p.cache_key, p.last_finish = p.prev_key, "stop"
                self._timers[MK.TIMER_STOP_BOUNDARY_CUTS] += 1
        if gen.finish_reason == "error":
            log.warning("engine error for task %s trajectory %s: %s", ps.task_index, p.tid, gen.error)
            to_step.append((ps, p))
            return
        if p.turn_start == start:  # a turn's first generation is the segment the entropy rule measures
            h = T.segment_entropy(
                gen.entropies, gen.top_logprobs, cfg.entropy_method, cfg.entropy_tokens, self.vocab_size
            )
            p.record_turn_entropy(h, cfg, self._stale, list(gen.entropies[: cfg.entropy_tokens]))
        if was_lookahead:
            lookaheads.append((ps, p, start))
            if gen.finish_reason == "length" and len(p.response) < self.max_response_tokens:
                return  # the look-ahead only paused the turn; it continues next round
        to_step.append((ps, p))

    # ----------------------------------------------------------------------------------------------- decisions
    def _policy(self, cfg: T.TreeConfig) -> T.BranchPolicy:
        """The branch-point policy of ``cfg`` (one per config: the pre-monitoring probe runs under its own)."""
        if cfg not in self._policies:
            self._policies[cfg] = T.branch_policy(cfg)
        return self._policies[cfg]

    def _decide(self, ps: PromptState, p: Path, bp: int, cfg: T.TreeConfig) -> bool:
        """One branch decision for candidate ``p`` at branch point ``bp``; returns whether clones were made."""
        if ps.pending_m or p.h_init is None or p.turn_h is None or p.engine_error or p.done:
            return False
        scope_l = p.consecutive if cfg.aepo_penalty_scope == "path" else ps.consecutive
        roots = sum(q.parent is None for q in ps.paths)
        free = cfg.budget - ps.count - max(0, cfg.min_roots - roots)  # min_roots: slots kept for fresh roots
        draws: list[float] = []
        policy = self._policy(cfg)
        before = after = None
        if policy.needs_logprobs:  # the sampled tokens' log-probs before the tool result, and the look-ahead's
            before = [lp for lp, m in zip(p.logprobs[:bp], p.mask[:bp]) if m]
            after = list(p.logprobs[bp:]) if policy.lookahead else None
        n = T.num_branches(
            cfg,
            p.turn_h - p.h_init,
            p.depth,
            scope_l,
            free,
            _RecordedRandom(ps.rng, draws) if ps.rng is not None else None,
            policy=policy,
            h_init=p.h_init,
            h_now=p.turn_h,
            h_before=p.ent_before[-1] if p.ent_before else None,
            logprobs=before,
            lookahead_logprobs=after,
        )
        gain = {}  # a log-prob look-ahead policy's G: the look-ahead's gain over the last k sampled tokens
        if before is not None and after is not None:
            gain["logprob_gain"] = mean_logprob_gain(before, after, cfg.entropy_tokens)
        if free > 0 and (cfg.max_depth is None or p.depth < cfg.max_depth):
            self._timers[MK.TIMER_BRANCH_DECISIONS] += 1  # a decision that could have branched
            ps.decisions.append(
                {
                    "trajectory": p.tid,
                    "at": bp,
                    "h_init": p.h_init,
                    "h_now": p.turn_h,
                    "penalty_l": scope_l,
                    "rule": cfg.branch_policy or cfg.decision_rule,
                    "alpha": cfg.alpha,
                    "beta": cfg.beta,
                    "tau": cfg.tau,
                    "draws": draws,
                    "cap": min(cfg.branch_factor, free),  # the clones the policy could make here
                    "branches": n,
                    **gain,
                }
            )
        p.consecutive = p.consecutive + 1 if n else 0
        key = p.cache_key if bp == len(p.response) else p.prev_key  # a key whose context is a prefix of the clone's
        for _ in range(n):
            c = p.copy_prefix(bp, tid=len(ps.paths), batch_index=self._batch_index, env=p.env.clone(), key=key)
            if policy.fresh_baseline or cfg.legacy_stale_baseline:
                c.h_init = None  # the branch's baseline is its own first segment after the branch point
            self._batch_index += 1
            ps.paths.append(c)
            ps.count += 1
            ps.branches_by_depth[c.depth] += 1
        return n > 0

    def _resolve_premonitor(self, ps: PromptState) -> None:
        """Lazy AEPO pre-monitoring: once the probe (path 0) has its post-tool entropy or ended, start m - 1 more."""
        probe = ps.paths[0]
        if not probe.done and (probe.h_root is None or probe.h_after_tool is None):
            return
        h_root = probe.h_root if probe.h_root is not None else 0.0
        h_tool = probe.h_after_tool if probe.h_after_tool is not None else h_root
        ps.m = T.aepo_initial_samples(self.cfg.budget, h_root, h_tool)
        ps.pending_m = False
        for _ in range(ps.m - 1):
            self._spawn(ps, "initial")

    def _premonitor_reference(self, prompts: list[PromptState], step: int) -> None:
        """AEPO reference pre-monitoring: an ``H_root`` probe, then one extra, discarded full trajectory per prompt
        whose mean segment entropy is ``H_tool``. Its tokens and tool calls count in the step's metrics."""
        cfg = self.cfg
        reqs = [
            GenRequest(
                ("premonitor", ps.task_index),
                ps.prompt_ids,
                dataclasses.replace(
                    self.sampling,
                    max_new_tokens=cfg.aepo_premonitor_tokens,
                    stop=tuple(ps.template.stop_sequences),
                    seed=T.derive_seed(self.seed, step, ps.task_index, "root"),
                    logprobs_topk=cfg.topk_logprobs if cfg.entropy_method == "topk_sum_lnV" else 0,
                ),
            )
            for ps in prompts
        ]
        t = time.perf_counter()
        gens = self.engine.generate(reqs)
        self._timers[MK.TIMER_GENERATE] += time.perf_counter() - t
        probe_cfg = dataclasses.replace(
            cfg,
            mode="grpo",
            budget=1,
            initial=1,
            branch_factor=0,
            aepo_premonitor_keep=False,
            decision_rule="reference",
            branch_policy=None,  # the probe never branches (GRPO's policy), whatever policy the tree uses
        )
        shadows = [
            dataclasses.replace(
                ps, paths=[], count=0, branches_by_depth=Counter(), decisions=[], task_index=ps.task_index
            )
            for ps in prompts
        ]
        for sh in shadows:
            self._spawn(sh, "premonitor")
        self._run(shadows, probe_cfg)
        for ps, sh, gen in zip(prompts, shadows, gens):
            h_root = T.segment_entropy(
                gen.entropies, gen.top_logprobs, cfg.entropy_method, cfg.entropy_tokens, self.vocab_size
            )
            segs = sh.paths[0].segment_entropy
            ps.m = T.aepo_initial_samples(cfg.budget, h_root, sum(segs) / len(segs) if segs else h_root)
            ps.premonitor_tool_calls = len(sh.paths[0].tool_calls)
            ps.premonitor_tokens = sh.paths[0].generated + len(gen.token_ids)
            if gen.cache_key is not None:
                self._keys.add(gen.cache_key)

    # ---------------------------------------------------------------------------------------------- environment
    def _step_envs(self, items: list[tuple[PromptState, Path]], cfg: T.TreeConfig) -> list[tuple[PromptState, Path]]:
        """Step every finished turn's environment concurrently (tools run in the pool; tokenization stays on this
        thread: a shared fast tokenizer is not safe to call from several threads); returns the paths that got a
        tool result."""
        if not items:
            return []
        t = time.perf_counter()
        actions = [action_text(self.tok, p, self.eos_id) for _, p in items]
        futures = [self._pool.submit(safe_call, p.env.step, a) for (_, p), a in zip(items, actions)]
        results = [f.result() for f in futures]
        self._timers[MK.TIMER_TOOLS] += time.perf_counter() - t
        return [item for item, res in zip(items, results) if self._apply_step(*item, res, cfg)]

    def _apply_step(self, ps: PromptState, p: Path, res: tuple | BaseException, cfg: T.TreeConfig) -> bool:
        """Append the env's observation or end the path (:func:`~arpo_algo.rollout.agent_loop.apply_turn`, the
        agent loop's rule). True = a tool result was appended."""
        if isinstance(res, BaseException):  # the env contract says never; if it happens, end this path only
            log.error("environment step failed for task %s trajectory %s: %r", ps.task_index, p.tid, res)
            p.finish("error", 0.0, {"env_error": repr(res)})
            return False
        turn = turn_from_env(res, len(p.tool_calls))
        k = cfg.entropy_tokens

        def entropy_before(c: Any) -> None:
            c.ent_before.append(MK.mean(c.entropies[max(c.turn_start, len(c.entropies) - k) :]))

        status, reason = apply_turn(
            p,
            turn,
            self.tok,
            self.eos_id,
            max_response_tokens=self.max_response_tokens,
            train_eos=self.train_tool_limit_eos,
            before_observation=entropy_before,
        )
        if status == "finished":
            p.finish(reason, turn.reward, turn.reward_info)
            return False
        if status == "ended":
            return self._end_episode(p, reason)
        p.lookahead = self._policy(cfg).lookahead and cfg.branch_factor > 0
        return True

    def _end_episode(self, p: Path, reason: str) -> bool:
        """End a path whose env still runs (budget spent, EOS after an invalid call, engine error): an empty action
        is plain text to the env, which then scores the whole response through its own reward path."""
        _, reward, terminated, truncated, info = p.env.step("")
        if not (terminated or truncated):
            raise ArpoError(f"the environment did not end its episode on an empty action ({type(p.env).__name__})")
        p.finish(reason, float(reward), dict(info.get("reward_info", {})))
        return False

    def _release_unused(self, prompts: list[PromptState]) -> None:
        """Give the engine back every cached prefix no live path can extend."""
        held = {p.cache_key for ps in prompts for p in ps.paths if not p.done}
        dead = [k for k in self._keys if k not in held]
        if dead:
            self.engine.release(dead)
            self._keys -= set(dead)


def _resolve_schedule(schedule: str, engine: RolloutEngine, tree: T.TreeConfig) -> str:
    """ "rounds" or "waves" for the ``schedule`` argument (see :class:`TreeSampler`)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    joins = bool(getattr(engine, "joins_requests", False))
    if schedule == "waves" and not joins:
        raise ConfigError(
            f"schedule='waves' needs an engine that takes requests into a running call; {type(engine).__name__} "
            "does not",
            hint="use schedule='rounds' (or 'auto'), or the HF engine",
        )
    if schedule == "waves" and tree.legacy_stale_baseline:
        raise ConfigError(
            "schedule='waves' cannot reproduce tree.legacy_stale_baseline (its baseline is keyed by the batch "
            "positions of lockstep rounds)",
            hint="use schedule='rounds' (or 'auto') with legacy_stale_baseline",
        )
    if schedule == "auto":
        return "waves" if joins and not tree.legacy_stale_baseline else "rounds"
    return schedule


def _close_envs(groups: Any) -> None:
    """End the tool sessions of every env in ``groups`` (lists of envs): their persistent interpreters end (closing
    twice is harmless). Only the session: a caller's own env type keeps whatever else it holds."""
    for envs in groups:
        for env in envs:
            close = getattr(getattr(env, "session", None), "close", None)
            if callable(close):
                close()
