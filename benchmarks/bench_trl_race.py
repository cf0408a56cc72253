"""Race on CPU: one ARPO step of arpo against one ``GRPOTrainer`` step of TRL, same model, task and trajectory count.

Benchmark only (not part of the test suite). Both sides train SmolLM2-135M-Instruct (``arpo model pull
smollm2-135m-instruct``) on ToolMath from ``arpo_env`` with its Python tool and its reward, ``prompts x generations``
trajectories per step, the same response budget, temperature 1, learning rate, fp32 on CPU, the same small k3 KL
term to the initial model (``--kl-coef``), and old log-probs taken from the rollout on both sides (TRL with
``num_iterations=1`` does not recompute them; ours is told ``old_logprobs = "rollout"``). The KL term is there because
an untrained model usually earns the same reward on every trajectory: ours then skips the update altogether (no
signal, no step), while TRL still runs forward and backward, and the race would time different work.

* **ours**: ``ARPOConfig`` with ``budget = generations`` trajectories per prompt (``initial = generations / 2``; the
  rest come from entropy-triggered branches and fill-ups), in-process HF engine, one ``algo.train()`` call.
* **theirs**: TRL's ``GRPOTrainer`` driven through its own multi-turn tool interface (``environment_factory``):
  arpo's TRL adapter (:func:`arpo_env.adapters.trl.trl_environment`) wraps the *same environment*
  (``arpo/ToolMath-v0``); its ``python`` method is the tool TRL exposes to the model, and it runs the call through
  ``env.step``, so the env's sandboxed Python tool and tool-call limit apply. The reward function
  (:func:`arpo_env.adapters.trl.trl_reward`) hands the final assistant message to ``env.step`` and returns the env's
  reward. One TRL step is one optimizer step: generation, tool loop, scoring, forward and backward.

Both sides use the chat-native JSON tool-call format (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``):
ours through the env's ``protocol = "json"``; TRL parses tool calls only for chat templates it knows, and SmolLM2's
own template drops tool calls, so TRL's tokenizer gets TRL's Qwen2.5 ChatML template (SmolLM2 uses the same
``<|im_start|>``/``<|im_end|>`` tokens). Timing: ours, theirs, ours, theirs, ... in one process, 1 thread each;
TRL's step is timed between its ``on_step_begin`` and ``on_step_end`` callbacks (its setup excluded), ours is one
``algo.train()`` (its setup excluded too).

Run (TRL in a private folder, see docs/results/speed.md)::

    pip install --target TRL_DIR --no-deps trl==1.16.* datasets dill xxhash multiprocess
    PYTHONPATH=$PWD:TRL_DIR nice -n 19 env OMP_NUM_THREADS=1 python -m benchmarks.bench_trl_race --out race.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo_env.adapters.trl import trl_environment, trl_reward

TRL_MISSING = (
    'TRL is not installed; this benchmark needs it (benchmark-only extra): pip install -e ".[bench]", or '
    "pip install --target TRL_DIR --no-deps trl==1.16.* datasets dill xxhash multiprocess and "
    "PYTHONPATH=TRL_DIR (any private folder)"
)
TRL_SYSTEM = (
    "Solve the problem step by step. To compute, call the python tool; its printed output comes back to you. "
    "Give the final answer as <answer>\\boxed{answer}</answer>."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_trl_race", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registered model name or local HF folder")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (both sides)")
    ap.add_argument(
        "--generations",
        type=int,
        default=4,
        help="trajectories per prompt: TRL num_generations, ARPO tree budget M (even, >= 2)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="response budget per trajectory (sampled + tool-result tokens) on both sides",
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (ours then theirs, each round)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="ToolMath levels")
    ap.add_argument("--max-tool-calls", type=int, default=3, help="tool-call limit per trajectory (both sides)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--kl-coef",
        type=float,
        default=0.001,
        help="k3 KL to the initial model on both sides (TRL beta). > 0 makes both sides run the whole "
        "update even when every reward is equal (ours skips an update without signal)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "rounds", "threads", "max_tool_calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kl_coef < 0:
        ap.error(f"--kl-coef must be >= 0, got {args.kl_coef}")
    if args.generations < 2 or args.generations % 2:
        ap.error(f"--generations must be even and >= 2 (ARPO starts from half of them), got {args.generations}")
    return args


def require_trl() -> None:
    """Exit with a clear message when TRL (or its ``datasets`` dependency) cannot be imported."""
    from arpo_base.errors import ArpoError
    from arpo_env.adapters.trl import require_trl as check

    try:
        check()
    except ArpoError as e:
        raise SystemExit(f"{TRL_MISSING}\n({e})") from None


def env_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ToolMath config both sides use (JSON tool calls, the same levels and tool-call limit)."""
    return {"levels": list(args.levels), "max_tool_calls": args.max_tool_calls, "protocol": "json"}


# ---------------------------------------------------------------------------------------------- TRL side
# arpo's TRL adapter (arpo_env.adapters.trl): the env behind TRL's environment_factory, one method per tool.


def build_trl(args: argparse.Namespace, model_dir: Path, tasks: list[dict[str, Any]], workdir: Path, on_step):
    """A GRPOTrainer that runs ``args.rounds`` optimizer steps; ``on_step(kind, seconds)`` is told each step."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen2_5_chat_template  # SmolLM2's template drops tool calls; same ChatML tokens
    tokenizer.padding_side = "left"
    environment = trl_environment("arpo/ToolMath-v0", **env_config(args))
    rows = [
        {
            "prompt": [{"role": "system", "content": TRL_SYSTEM}, {"role": "user", "content": t["question"]}],
            "task_index": t["index"],
        }
        for t in tasks
    ]
    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_steps=args.rounds,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=args.kl_coef,
        num_iterations=1,
        loss_type="dapo",
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=args.prompts,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        max_tool_calling_iterations=args.max_tool_calls,
        temperature=1.0,
        top_p=1.0,
        shuffle_dataset=False,
        gradient_checkpointing=False,  # TRL's default is True; ours does not checkpoint, so neither does TRL here
    )

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            on_step("theirs", time.perf_counter() - self.t0)

    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=trl_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory=environment,
        callbacks=[StepTimer()],
    )


# ---------------------------------------------------------------------------------------------- our side


def build_ours(args: argparse.Namespace, model_dir: Path):
    from arpo_algo.algorithms import ARPOConfig

    config = (
        ARPOConfig()
        .environment(env="arpo/ToolMath-v0", env_config=env_config(args))
        .training(
            model_path=str(model_dir),
            lr=args.lr,
            prompts_per_step=args.prompts,
            kl_coef=args.kl_coef,
            loss_agg="token_mean",
            grad_clip=1.0,
            weight_decay=0.01,
            old_logprobs="rollout",  # TRL with num_iterations=1 does not recompute them either
            # about TRL's micro-batch (per_device_train_batch_size = generations trajectories)
            micro_batch_tokens=args.generations * (args.max_new_tokens + 384),
        )
        .tree(budget=args.generations, initial=args.generations // 2, branch_factor=1)
        .llm_rollouts(
            max_response_tokens=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            hf={"max_batch_size": args.prompts * args.generations},
            num_rollout_actors=0,
        )
        .evaluation(every=0)
        .debugging(seed=args.seed)
    )
    return config.build_algo()


def _ours_stats(result: dict[str, Any]) -> dict[str, float]:
    from arpo_algo.rollout import learner_metrics as LK
    from arpo_algo.rollout import metrics as MK

    # The result nests each section: "rollout/branches" is result["rollout"]["branches"].
    rollout = result.get(MK.ROLLOUT.rstrip("/"), {})
    out = {k: float(result[k]) for k in (MK.TRAJECTORIES, MK.TOKENS_SAMPLED, MK.REWARD_MEAN) if k in result}
    in_rollout = [
        name.removeprefix(MK.ROLLOUT) for name in (MK.RESPONSE_TOKENS, MK.TOOL_CALLS, MK.BRANCHES, MK.TIME_TOTAL)
    ]
    out.update({k: float(rollout[k]) for k in in_rollout if k in rollout})
    learner = result.get(LK.PREFIX.rstrip("/"), {})
    out.update(
        {
            f"learner_{k}": float(learner[k])
            for k in (LK.SKIPPED_NO_SIGNAL, LK.UNIQUE_TOKENS, LK.MICRO_BATCHES)
            if k in learner
        }
    )
    return out


# ---------------------------------------------------------------------------------------------- the race


def _prompt_tokens(model_dir: Path, trl_tokenizer: Any, task: dict[str, Any], args: argparse.Namespace) -> dict:
    """Prompt length of the first task on each side (ours: the env's messages in SmolLM2's own template; TRL: its
    rows in its Qwen2.5 template with the tool schema), so the report shows both sides start from similar contexts."""
    from transformers import AutoTokenizer

    from arpo_algo.algorithms.components import make_env

    env = make_env("arpo/ToolMath-v0", env_config(args))
    _, info = env.reset(options={"task_index": task["index"]})
    ours_tok = AutoTokenizer.from_pretrained(model_dir)
    ours = ours_tok.apply_chat_template(info["messages"], tokenize=False, add_generation_prompt=True)
    trl_env = trl_environment("arpo/ToolMath-v0", **env_config(args))()
    theirs = trl_tokenizer.apply_chat_template(
        [{"role": "system", "content": TRL_SYSTEM}, {"role": "user", "content": task["question"]}],
        tools=[trl_env.python],
        tokenize=False,
        add_generation_prompt=True,
    )
    return {
        "ours": len(ours_tok(ours, add_special_tokens=False)["input_ids"]),
        "theirs": len(trl_tokenizer(theirs, add_special_tokens=False)["input_ids"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    require_trl()
    import torch

    from arpo_algo.algorithms.components import PromptIterator, make_env
    from arpo_algo.models.store import resolve_model_path

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = resolve_model_path(args.model)
    # The prompts our Algorithm will draw (its seeded PromptIterator), in order: TRL gets the same ones.
    data = make_env("arpo/ToolMath-v0", env_config(args)).tasks
    indices = PromptIterator(len(data), args.seed).next(args.prompts * args.rounds)
    tasks = [{**data[i], "index": i} for i in indices]

    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    ours_stats: list[dict[str, float]] = []
    algo = build_ours(args, model_dir)

    def ours_step() -> None:
        t0 = time.perf_counter()
        result = algo.train()
        times["ours"].append(time.perf_counter() - t0)
        ours_stats.append(_ours_stats(result))
        print(f"ours   step {len(times['ours'])}: {times['ours'][-1]:.1f} s {ours_stats[-1]}", flush=True)

    def on_step(kind: str, seconds: float) -> None:
        times[kind].append(seconds)
        print(f"theirs step {len(times['theirs'])}: {seconds:.1f} s", flush=True)
        if len(times["ours"]) < args.rounds:
            ours_step()  # interleave: ours, theirs, ours, theirs, ...

    with tempfile.TemporaryDirectory(prefix="trl_race_") as tmp:
        trainer = build_trl(args, model_dir, tasks, Path(tmp), on_step)
        prompt_tokens = _prompt_tokens(model_dir, trainer.processing_class, tasks[0], args)
        ours_step()
        trainer.train()
        trl_logs = [dict(x) for x in trainer.state.log_history]
    algo.stop()

    med_ours, med_theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
    result = {
        "setting": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model_dir": str(model_dir),
            "torch_threads": torch.get_num_threads(),
        },
        "prompt_tokens_first_task": prompt_tokens,
        "seconds": times,
        "median_ours_s": med_ours,
        "median_theirs_s": med_theirs,
        "ratio_ours_over_theirs": med_ours / med_theirs,
        "ours_rollout": ours_stats,
        "theirs_logs": [{k: v for k, v in x.items() if isinstance(v, (int, float))} for x in trl_logs],
    }
    print(
        f"\nper step, median of {args.rounds}: ours {med_ours:.1f} s, TRL GRPOTrainer {med_theirs:.1f} s, "
        f"ours/theirs = {result['ratio_ours_over_theirs']:.2f} (goal <= 0.5)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
