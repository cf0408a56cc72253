"""``arpo env check``: Gymnasium's ``check_env``, a seeded determinism check and a garbage-action run per env id."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

import arpo_env
from arpo_base.errors import ArpoError, MissingDataError

# Policy output that must never crash the env: malformed, nested, unclosed, several calls, unknown tags, huge,
# invalid Unicode, control characters.
GARBAGE_ACTIONS: tuple[str, ...] = (
    "",
    "<python>",
    "</python>",
    "<python></python>",
    "<python>   </python>",
    "<python><python>print(1)</python></python>",
    "<search><python>print(1)</python></search>",
    "<python>print(1)</python><python>print(2)</python>",
    "<python>print(1)</python> and then more text",
    "<calculator>1+1</calculator>",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "<answer>no box</answer>",
    "<answer>\\boxed{unclosed</answer>",
    "\ud800 lone surrogate <python>print(1)</python>",
    "\x00\x08\x1b[31m control characters",
    "<python>" + "x = 1\n" * 20_000 + "</python>",
    "a" * 200_000,
    "<search>" + "q" * 50_000 + "</search>",
)

# A deterministic episode used by the determinism check: a real tool call, then a final answer.
PROBE_ACTIONS: tuple[str, ...] = ("<think>compute</think> <python>print(6*7)</python>", "<answer>\\boxed{42}</answer>")


@dataclass
class CheckResult:
    env_id: str
    status: str  # "ok" | "failed" | "skipped"
    detail: str = ""
    seconds: float = 0.0
    steps: dict[str, Any] = field(default_factory=dict)


def _rollout(env: gym.Env, seed: int, actions: tuple[str, ...]) -> list[tuple]:
    obs, info = env.reset(seed=seed)
    trace: list[tuple] = [(obs, info["task"]["id"])]
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        trace.append((obs, reward, terminated, truncated, info["parse_status"]))
        if terminated or truncated:
            break
    return trace


def check_determinism(env_id: str, config: dict[str, Any] | None = None, seed: int = 123) -> None:
    """Two fresh envs with the same seed give identical tasks, observations and rewards (AssertionError if not)."""
    traces = []
    for _ in range(2):
        env = gym.make(env_id, config=dict(config or {}))
        try:
            traces.append(_rollout(env, seed, PROBE_ACTIONS))
        finally:
            env.close()
    if traces[0] != traces[1]:
        raise AssertionError(f"same seed, different episodes:\n{traces[0]}\n{traces[1]}")


def run_garbage(env: gym.Env, seed: int = 0) -> dict[str, int]:
    """Step every garbage action (resetting when an episode ends); returns counts by parse status."""
    counts: dict[str, int] = {}
    base = env.unwrapped
    base.reset(seed=seed)
    for action in GARBAGE_ACTIONS:
        obs, reward, terminated, truncated, info = base.step(action)
        if not isinstance(obs, str) or not isinstance(reward, float):
            raise AssertionError(f"bad step return types for action {action[:40]!r}")
        counts[info["parse_status"]] = counts.get(info["parse_status"], 0) + 1
        if terminated or truncated:
            base.reset()
    return counts


def check_env_id(env_id: str, config: dict[str, Any] | None = None) -> CheckResult:
    """All checks for one registered id; data-backed ids without data are reported as skipped."""
    t0 = time.perf_counter()
    try:
        env = gym.make(env_id, config=dict(config or {}))
    except MissingDataError as e:
        return CheckResult(env_id, "skipped", f"data missing, run `arpo data pull` ({e.message})")
    except ArpoError as e:
        return CheckResult(env_id, "failed", f"construction: {e}", time.perf_counter() - t0)
    steps: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # check_env warns about things we accept (e.g. no render on reset)
            from gymnasium.utils.env_checker import check_env

            check_env(env.unwrapped, skip_render_check=True)
        steps["check_env"] = "ok"
        check_determinism(env_id, config)
        steps["determinism"] = "ok"
        steps["garbage"] = run_garbage(env)
    except Exception as e:  # report every failure as a result line instead of stopping the whole check
        return CheckResult(env_id, "failed", f"{type(e).__name__}: {e}", time.perf_counter() - t0, steps)
    finally:
        env.close()
    return CheckResult(
        env_id, "ok", "check_env, determinism and garbage actions passed", time.perf_counter() - t0, steps
    )


def check_all(env_ids: list[str] | None = None, config: dict[str, Any] | None = None) -> list[CheckResult]:
    """Run :func:`check_env_id` for each id (default: every registered arpo id)."""
    ids = env_ids or list(arpo_env.ENV_IDS)
    unknown = [i for i in ids if i not in arpo_env.ENV_IDS]
    if unknown:
        raise ArpoError(f"unknown env id(s): {', '.join(unknown)}", hint=f"known: {', '.join(arpo_env.ENV_IDS)}")
    return [check_env_id(i, config) for i in ids]
