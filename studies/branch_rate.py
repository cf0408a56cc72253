"""How often does each branch-point policy branch in one setting: branches per candidate and per group.

    python -m studies.branch_rate --model runs/quickstart/sft --policies paper random appo --match-random paper \
        --prompts 8 --steps 2 --set tree.budget=8 --set tree.initial=2 --set tree.branch_factor=2 \
        --output runs/branch_rate

Samples ``--steps`` rollout steps of the same ``--prompts`` tasks under each policy, with one model, one seed and one
``[tree]`` (the defaults, changed by ``--set tree.key=value``), and counts over all of them what the training
iterations report one step at a time (docs/concepts/arpo.md#branch-point-policies): candidates, opportunities (the
sum of the caps), branches, and the ratios of those sums. ``--match-random ARM`` gives the ``random`` arm the rate
that makes it an equal-count control for ARM (its measured branches per opportunity; ARM is sampled first), and the
report then says how far their branches per group lie apart. Writes ``branch_rate.json`` and ``branch_rate.md``.

A policy is any registered name: ``paper`` and ``reference`` select ARPO's rules through ``tree.decision_rule``,
``aepo_paper`` and ``aepo_reference`` AEPO's, ``never`` GRPO's independent samples (``tree.budget`` of them), and any
other name ``tree.branch_policy``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from arpo_algo.core.tree import MODE_POLICIES, TreeConfig
from arpo_algo.rollout import metrics as MK
from arpo_base.errors import ArpoError, ConfigError
from arpo_base.options import dataclass_from_dict, parse_override

#: The counts summed over steps, by the name the report gives them.
COUNTS = {
    "candidates": MK.BRANCH_CANDIDATES,
    "opportunities": MK.BRANCH_OPPORTUNITIES,
    "branches": MK.BRANCHES,
}


def arm_config(base: TreeConfig, policy: str) -> TreeConfig:
    """``base`` with ``policy`` in effect: an algorithm's own rule through mode and ``decision_rule`` (the two
    settings may not disagree), GRPO for ``never``, any other registered policy through ``branch_policy``. The
    overrides are shared by every arm, so another policy's own knobs (``tree.random_lookahead`` for the paper arm)
    stay at their defaults in this arm."""
    if policy == "never":
        return TreeConfig.grpo(base.budget)
    for mode, rules in MODE_POLICIES.items():
        for rule, name in rules.items():
            if name == policy and mode != "grpo":
                arm = dataclasses.replace(base, mode=mode, decision_rule=rule, branch_policy=None)
                return arm.without_unread_knobs().validate()
    return dataclasses.replace(base, branch_policy=policy).without_unread_knobs().validate()


def rates(step_metrics: list[dict[str, float]], groups: int) -> dict[str, float]:
    """The counts summed over steps and their ratios: branches per candidate, per opportunity and per group."""
    out = {name: sum(m.get(key, 0.0) for m in step_metrics) for name, key in COUNTS.items()}
    out["groups"] = float(groups)
    out["branches_per_candidate"] = out["branches"] / out["candidates"] if out["candidates"] else 0.0
    out["branches_per_opportunity"] = out["branches"] / out["opportunities"] if out["opportunities"] else 0.0
    out["branches_per_group"] = out["branches"] / groups if groups else 0.0
    return out


def sample_arm(model: str, make_env: Any, tree: TreeConfig, prompts: int, steps: int, tokens: int, seed: int) -> dict:
    """Sample ``steps`` steps of tasks ``0..prompts-1`` under ``tree`` and return the counts and rates."""
    from arpo_algo.models import resolve_model_path
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.sampler import TreeSampler

    engine = HFEngine(str(resolve_model_path(model)), seed=seed)
    sampler = TreeSampler(
        engine, make_env, tree, SamplingParams(temperature=1.0), max_response_tokens=tokens, seed=seed
    )
    try:
        per_step = [sampler.sample(list(range(prompts)), step=s)[1] for s in range(steps)]
    finally:
        sampler.close()
    return rates(per_step, prompts * steps)


def base_tree(overrides: list[str]) -> TreeConfig:
    """The default ``[tree]`` changed by ``tree.key=value`` overrides (TOML values; unknown keys and wrong types are
    refused). Each arm validates its own config (:func:`arm_config`): the overrides may hold several policies' knobs."""
    values: dict[str, Any] = {}
    for item in overrides:
        _, key, value = parse_override(item, ["tree"])
        values[key] = value
    return dataclass_from_dict(TreeConfig, values, "tree config")


def report(arms: dict[str, dict], matched: tuple[str, float] | None) -> str:
    """The markdown table of the arms (and the equal-count check when a random arm was matched)."""
    lines = [
        "| policy | candidates | opportunities | branches | per candidate | per opportunity | per group |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in arms.items():
        lines.append(
            f"| {name} | {r['candidates']:.0f} | {r['opportunities']:.0f} | {r['branches']:.0f} | "
            f"{r['branches_per_candidate']:.3f} | {r['branches_per_opportunity']:.3f} | {r['branches_per_group']:.3f} |"
        )
    if matched is not None:
        target, rate = matched
        a, b = arms[target]["branches_per_group"], arms["random"]["branches_per_group"]
        # the equal-count check is relative to the matched arm's count; with no branch there it has no scale
        gap = f"differ by {abs(b - a) / a:.1%} of {target}'s" if a else f"are {a:.3f} ({target}) and {b:.3f} (random)"
        lines.append(f"\nrandom ran at p = {rate:.4f} ({target}'s branches per opportunity); branches per group {gap}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a policy folder or a model name `arpo model pull` knows")
    ap.add_argument("--policies", nargs="+", default=["paper", "random"], help="registered branch policies")
    ap.add_argument("--match-random", metavar="ARM", help="set random's rate to ARM's branches per opportunity")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="tree.key=value (TOML value)")
    ap.add_argument("--data", default="toolmath", help="toolmath (level 3, default) or an `arpo eval --data` set")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--max-response-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=Path("runs/branch_rate"))
    args = ap.parse_args(argv)
    try:
        if args.prompts < 1 or args.steps < 1 or args.max_response_tokens < 1:
            raise ConfigError("--prompts, --steps and --max-response-tokens must be >= 1")
        base = base_tree(args.overrides)
        policies = list(dict.fromkeys(args.policies))
        trees = {p: arm_config(base, p) for p in policies}  # every arm is checked before any is sampled
        matched = None
        if args.match_random is not None:
            if "random" not in policies or args.match_random not in policies or args.match_random == "random":
                raise ConfigError(
                    f"--match-random {args.match_random!r} needs both 'random' and that arm in --policies",
                    hint=f"e.g. --policies {args.match_random} random --match-random {args.match_random}",
                )
            policies.remove(args.match_random)
            policies.insert(0, args.match_random)  # measured first: its rate sets random's
        from studies.entropy_after_tools import env_factory

        make_env = env_factory(args.data, args.prompts)
        arms: dict[str, dict] = {}
        for p in policies:
            tree = trees[p]
            if p == "random" and args.match_random is not None:
                rate = arms[args.match_random]["branches_per_opportunity"]
                tree, matched = dataclasses.replace(tree, random_rate=rate).validate(), (args.match_random, rate)
            arms[p] = {
                **sample_arm(args.model, make_env, tree, args.prompts, args.steps, args.max_response_tokens, args.seed),
                "tree": dataclasses.asdict(tree),
            }
    except ArpoError as e:
        print(f"error: {e}" + (f"\nhint: {e.hint}" if getattr(e, "hint", None) else ""), file=sys.stderr)
        return 2
    table = report(arms, matched)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "branch_rate.md").write_text(table, encoding="utf-8")
    res = {
        "arms": arms,
        "command": ["python", "-m", "studies.branch_rate", *(argv if argv is not None else sys.argv[1:])],
    }
    (args.output / "branch_rate.json").write_text(json.dumps(res, indent=2), encoding="utf-8")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
