"""Reuse beyond ARPO: a plain REINFORCE loop drives ``arpo/ToolMath-v0`` through the Gymnasium API.

The policy is a softmax over four canned strategies (a bandit); each strategy turns the question into macro actions:

* ``guess``: answer at once with a made-up number (no tool);
* ``first_number``: answer with the first number in the question (no tool);
* ``tool_then_stop``: compute with Python, then end without an answer;
* ``tool_then_answer``: compute with Python, then box the printed result.

Only the last earns reward, so REINFORCE should move nearly all probability to it within a few dozen episodes.
numpy only (no torch); run ``python -m examples.reinforce_example --episodes 60``.
"""

from __future__ import annotations

import argparse
import re

import gymnasium as gym
import numpy as np

import arpo_env  # noqa: F401  (registers the arpo/* ids)

STRATEGIES = ("guess", "first_number", "tool_then_stop", "tool_then_answer")


def question_to_code(question: str) -> str:
    """A rule-based translation of a level-1 ToolMath question into Python (stands in for an LLM)."""
    q = question.removeprefix("What is ").rstrip("?")
    q = re.sub(r"(\d+) divided by (\d+), rounded down", r"\1 // \2", q)
    q = q.replace("×", "*").replace("^", "**").replace(" mod ", " % ")
    return f"print({q})"


def play(env: gym.Env, question: str, strategy: str) -> float:
    """Run one episode with a fixed strategy; returns the final reward."""
    if strategy in ("guess", "first_number"):
        value = "12345" if strategy == "guess" else re.findall(r"\d+", question)[0]
        return env.step(f"<think>I know it.</think><answer>\\boxed{{{value}}}</answer>")[1]
    code = question_to_code(question)
    obs, reward, terminated, truncated, info = env.step(f"<think>Compute.</think><python>{code}</python>")
    if terminated or truncated:
        return reward
    if strategy == "tool_then_stop":
        return env.step("<think>Done.</think>")[1]
    result = info["tool_output"].strip()
    return env.step(f"<think>The result is {result}.</think><answer>\\boxed{{{result}}}</answer>")[1]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    env = gym.make("arpo/ToolMath-v0", levels=[1])
    rng = np.random.default_rng(args.seed)
    logits = np.zeros(len(STRATEGIES))
    baseline, rewards = 0.0, []
    for episode in range(args.episodes):
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        choice = int(rng.choice(len(STRATEGIES), p=probs))
        question, _info = env.reset(seed=args.seed * 100_000 + episode)
        reward = play(env, question, STRATEGIES[choice])
        # REINFORCE with a running-mean baseline: grad log softmax = onehot - probs
        grad = -probs
        grad[choice] += 1.0
        logits += args.lr * (reward - baseline) * grad
        baseline = 0.9 * baseline + 0.1 * reward
        rewards.append(reward)
        if (episode + 1) % 10 == 0:
            print(
                f"episode {episode + 1:4d}  mean reward (last 10) {np.mean(rewards[-10:]):.2f}  "
                f"p(tool_then_answer) {probs[-1]:.2f}"
            )
    env.close()
    final = np.exp(logits - logits.max())
    final /= final.sum()
    summary = {name: float(p) for name, p in zip(STRATEGIES, final)}
    print("final policy:", {k: round(v, 3) for k, v in summary.items()})
    return summary


if __name__ == "__main__":
    main()
