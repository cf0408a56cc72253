"""RLlib's ``compute_single_action`` / ``compute_actions`` for an LLM agent: a prompt in, the agent's response out.

The invariant: an algorithm answers a prompt as ``arpo serve`` serves its policy. The policy's current weights (the
rollout engine, synced to the learner first), the system prompt, tools, protocol and tool-call limit of the
environment it trains in, and the same agent loop (:func:`arpo_algo.rollout.agent_loop.run_agents`); greedy unless
``explore=True``, which samples as the rollouts do (temperature 1).
"""

from __future__ import annotations

from typing import Any

from arpo_base.errors import ArpoError

#: RLlib's compute_single_action arguments that name RLModule or Policy machinery arpo does not build.
_RLLIB_ONLY = ("state", "prev_action", "prev_reward", "info", "input_dict", "full_fetch", "episode", "timestep")


def check_prompts(prompts: list[Any], rllib_kwargs: dict[str, Any]) -> None:
    """Refuse an observation that is not text and RLlib arguments that would change nothing."""
    given = [k for k in _RLLIB_ONLY if rllib_kwargs.get(k) not in (None, False)]
    if given:
        raise ArpoError(
            f"compute_single_action: {', '.join(given)} belong to RLlib's RLModule and Policy inference, which arpo "
            "does not build",
            hint="pass the user's prompt as the observation: algo.compute_single_action('What is 2 + 3?')",
        )
    bad = [p for p in prompts if not isinstance(p, str)]
    if bad:
        raise ArpoError(
            f"the observation must be the user's prompt (a str), got {type(bad[0]).__name__}",
            hint="algo.compute_single_action('What is 2 + 3?')",
        )


def answer_prompts(algo: Any, prompts: list[str], *, explore: bool = False, max_response_tokens: int | None = None):
    """The agent's whole response to each prompt (its text, tool calls and their results, decoded), in order."""
    from arpo_algo.core.tree import tools_seed
    from arpo_algo.rollout.agent_loop import run_agents
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.layout import prompt_ids

    if algo.rollout_pipeline is not None:  # a batch in flight finishes under the weights it started with
        algo.rollout_pipeline.wait()
    algo._sync_weights()
    env = algo._train_env()
    session = getattr(env, "unwrapped", env).session
    tok = algo.learner.tokenizer
    system = algo.served_defaults["system_prompt"]
    ids = [prompt_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": p}]) for p in prompts]
    sessions = []
    for _ in prompts:
        s = session.clone()
        s.reset()
        # One seed for every prompt: an answer's tool draws depend on its prompt, never on its place in the batch.
        s.seed_tools(tools_seed(algo.config.seed, 0, 0, 0))
        sessions.append(s)
    budget = max_response_tokens or algo.config.settings.rollouts.max_response_tokens
    try:
        traces = run_agents(
            algo.engine,
            sessions,
            ids,
            SamplingParams(temperature=1.0 if explore else 0.0, seed=algo.config.seed),
            max_response_tokens=budget,
        )
    finally:
        for s in sessions:
            s.close()
        env.close()
    failed = [t.error for t in traces if t.finish_reason == "error"]
    if failed:
        raise ArpoError(f"the engine failed while answering: {failed[0]}")
    return [t.text for t in traces]
