"""ToolMath: short generated problems that need a Python tool (their demonstrations: :mod:`arpo_env.demonstrations`).

Problems are easy to state and hard to do in the head for a small model (large-number arithmetic, chained
percentages, compound interest, unit conversions), so a 135M model can learn to call Python and copy the result.

* Levels: 1 = one exact integer computation; 2 = one multi-step formula (2-decimal answer); 3 = two dependent tool
  calls (the second uses the first result); 4 = three dependent calls. Higher levels make branching after tool
  results meaningful.
* Level 5 (stateful): a list too long to print is built in the first call and used again in the second; a
  persistent interpreter (``tools.python.persistent``) keeps it, a stateless one must rebuild it, at more tokens.
  Its demonstrations (:mod:`arpo_env.demonstrations`) take the form that fits the env's Python tool. Not among the
  default levels.
* Determinism: problem ``g`` is drawn from ``random.Random(f"toolmath:{g}:{level}")``; the same config and index
  always give the same problem.
* Splits are disjoint by construction: a problem belongs to "test" iff the SHA-256 of its question text falls in the
  lowest ~10% (``TEST_FRACTION``), so no question text can occur in both splits.
* Answers: integers are exact (``tolerance=0``); 2-decimal answers accept ``tolerance=0.01`` (absolute), so
  ``261.2``, ``261.20`` and ``261.199`` all match ``261.20``; see :func:`arpo_env.rewards.math_equiv`.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arpo_base.errors import ConfigError

TEST_FRACTION = 0.1
ALL_LEVELS = (1, 2, 3, 4, 5)
DEFAULT_LEVELS = (1, 2, 3)
DEFAULT_NUM_TASKS = {"train": 10_000, "test": 500}

SYSTEM_PROMPT = (
    "Solve the problem. Think inside <think> </think>. To compute, write Python code inside <python> </python>; "
    "its printed output appears inside <result> </result>. Give the final answer as <answer>\\boxed{answer}</answer>."
)

# A step: (thought, function from earlier tool outputs to a Python expression that the tool prints).
Step = tuple[str, Callable[[list[str]], str]]


@dataclass
class Problem:
    question: str
    steps: list[Step]
    tolerance: float
    kind: str
    level: int
    #: The steps for a persistent interpreter (later ones use names earlier ones defined); None: ``steps`` fit both.
    stateful_steps: list[Step] | None = None


def _constant(expr: str) -> Callable[[list[str]], str]:
    """A step's code that does not depend on earlier outputs."""
    return lambda _out: expr


def _evaluate(expr: str) -> str:
    # Our own generated expressions only (no user input), evaluated the way `print(expr)` would show them.
    safe = {
        "__builtins__": {},
        "round": round,
        "sum": sum,
        "int": int,
        "str": str,
        "len": len,
        "max": max,
        "range": range,
    }
    return str(eval(expr, safe))


# ----------------------------------------------------------------------------------------------- generators


def _level1(r: random.Random) -> Problem:
    kind = r.choice(["mul", "addsub", "powmod", "floordiv"])
    if kind == "mul":
        a, b = r.randint(10_000, 999_999), r.randint(1_000, 99_999)
        q, expr, thought = f"What is {a} × {b}?", f"{a}*{b}", f"I need {a} times {b}."
    elif kind == "addsub":
        a, b, c = (r.randint(1_000_000, 9_999_999) for _ in range(3))
        q, expr, thought = f"What is {a} + {b} - {c}?", f"{a}+{b}-{c}", "I add and subtract the numbers."
    elif kind == "powmod":
        a, k, m = r.randint(3, 19), r.randint(20, 60), r.choice([997, 1000, 1009, 9973])
        q, expr, thought = f"What is {a}^{k} mod {m}?", f"{a}**{k} % {m}", f"I need {a}**{k} modulo {m}."
    else:
        a, b = r.randint(10**8, 10**9), r.randint(13, 997)
        q, expr, thought = f"What is {a} divided by {b}, rounded down?", f"{a}//{b}", f"Integer division of {a} by {b}."
    return Problem(q, [(thought, _constant(expr))], 0.0, kind, 1)


def _level2(r: random.Random) -> Problem:
    kind = r.choice(["percent", "interest", "convert", "speed"])
    if kind == "percent":
        p, up, down = r.randint(50, 900), r.randint(3, 40), r.randint(3, 40)
        q = f"A price of {p} rises by {up}% and then falls by {down}%. What is the new price? Round to 2 decimals."
        expr = f"round({p}*(1+{up}/100)*(1-{down}/100), 2)"
    elif kind == "interest":
        p, rate, years = r.randint(5, 90) * 100, r.randint(2, 9), r.randint(3, 15)
        q = (
            f"{p} dollars earn {rate}% interest per year, compounded yearly. What is the balance after {years} years? "
            "Round to 2 decimals."
        )
        expr = f"round({p}*(1+{rate}/100)**{years}, 2)"
    elif kind == "convert":
        unit, factor, target = r.choice(
            [
                ("miles", 1.609344, "kilometers"),
                ("pounds", 0.45359237, "kilograms"),
                ("inches", 2.54, "centimeters"),
                ("gallons", 3.785411784, "liters"),
            ]
        )
        x = r.randint(11, 999)
        one = unit[:-1] if unit != "inches" else "inch"
        q = f"Convert {x} {unit} to {target} (1 {one} = {factor} {target}). Round to 2 decimals."
        expr = f"round({x}*{factor}, 2)"
    else:
        d1, t1, d2, t2 = r.randint(40, 400), r.randint(2, 9) / 2, r.randint(40, 400), r.randint(2, 9) / 2
        q = (
            f"A car drives {d1} km in {t1} hours, then {d2} km in {t2} hours. What is its average speed in km/h? "
            "Round to 2 decimals."
        )
        expr = f"round(({d1}+{d2})/({t1}+{t2}), 2)"
    return Problem(q, [("I compute it with Python.", _constant(expr))], 0.01, kind, 2)


def _digit_sum_step(out: list[str]) -> str:
    return f"sum(int(d) for d in str({out[-1]}))"


def _level3(r: random.Random) -> Problem:
    kind = r.choice(["digitsum", "taxed_interest"])
    if kind == "digitsum":
        a, b = r.randint(100_000, 999_999), r.randint(10_000, 99_999)
        q = f"Let N = {a} × {b}. What is the sum of the digits of N?"
        steps: list[Step] = [
            ("First I compute N.", lambda _o: f"{a}*{b}"),
            ("Now I sum the digits of N.", _digit_sum_step),
        ]
        return Problem(q, steps, 0.0, kind, 3)
    p, rate, years, tax = r.randint(5, 90) * 100, r.randint(2, 9), r.randint(3, 15), r.choice([10, 15, 20, 25, 30])
    q = (
        f"{p} dollars grow by {rate}% per year for {years} years, compounded yearly. Then {tax}% of the gain is "
        "paid as tax. What is left? Round to 2 decimals."
    )
    steps = [
        ("First the balance before tax.", lambda _o: f"round({p}*(1+{rate}/100)**{years}, 2)"),
        ("Now subtract the tax on the gain.", lambda o: f"round({o[-1]} - {tax}/100*({o[-1]}-{p}), 2)"),
    ]
    return Problem(q, steps, 0.01, kind, 3)


def _level4(r: random.Random) -> Problem:
    a, b, c = r.randint(100_000, 999_999), r.randint(10_000, 99_999), r.randint(3, 9)
    q = f"Let N = {a} × {b} and S = the sum of the digits of N. What is S^{c}?"
    steps: list[Step] = [
        ("First I compute N.", lambda _o: f"{a}*{b}"),
        ("Now S, the digit sum of N.", _digit_sum_step),
        (f"Finally S to the power {c}.", lambda o: f"{o[-1]}**{c}"),
    ]
    return Problem(q, steps, 0.0, "digitsum_power", 4)


def _level5(r: random.Random) -> Problem:
    a, b, m = r.randint(3, 97), r.randint(3, 97), r.choice([9973, 10007, 65521, 99991])
    k, d = r.randint(300, 900), r.randint(3, 9)
    build = f"[({a}*i*i + {b}*i) % {m} for i in range({k})]"
    q = (
        f"Let L be the list of (({a}·i² + {b}·i) mod {m}) for i = 0, 1, ..., {k - 1}, and M the largest element of "
        f"L. What is L[0] + L[{d}] + L[{2 * d}] + ... (every element at a position divisible by {d}), modulo M?"
    )
    first = ("First I build L and find M.", lambda _o: f"max(L := {build})")
    then = f"Now every element at a position divisible by {d}, summed, modulo M; "
    steps: list[Step] = [first, (then + "I rebuild L.", lambda o: f"sum({build}[::{d}]) % {o[-1]}")]
    stateful: list[Step] = [first, (then + "L is still defined.", lambda o: f"sum(L[::{d}]) % {o[-1]}")]
    return Problem(q, steps, 0.0, "list_reuse", 5, stateful)


_GENERATORS = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def make_problem(g: int, level: int) -> Problem:
    """Problem number ``g`` at ``level`` (deterministic)."""
    return _GENERATORS[level](random.Random(f"toolmath:{g}:{level}"))


def split_of(question: str) -> str:
    """ "test" for ~10% of question texts (by SHA-256), "train" for the rest."""
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return "test" if h < TEST_FRACTION else "train"


def solve(problem: Problem) -> tuple[list[str], str]:
    """In-process solution: the expression of each step and the final printed value (the ground truth)."""
    outputs: list[str] = []
    exprs = []
    for _thought, make_expr in problem.steps:
        expr = make_expr(outputs)
        exprs.append(expr)
        outputs.append(_evaluate(expr))
    return exprs, outputs[-1]


@functools.lru_cache(maxsize=32)
def _split_indices(split: str, levels: tuple[int, ...], n: int) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    g = 0
    while len(out) < n:
        level = levels[g % len(levels)]
        if split_of(make_problem(g, level).question) == split:
            out.append((g, level))
        g += 1
    return tuple(out)


class ToolMathTasks:
    """The task list of one split (a sequence of task dicts, generated on demand).

    Args:
        split: "train" or "test".
        levels: difficulty levels to mix, round-robin (subset of 1..5).
        num_tasks: number of tasks in the split (default 10 000 train / 500 test).
    """

    system_prompt = SYSTEM_PROMPT

    def __init__(self, split: str = "train", levels: Sequence[int] = DEFAULT_LEVELS, num_tasks: int | None = None):
        if split not in DEFAULT_NUM_TASKS:
            raise ConfigError(f"split must be 'train' or 'test', got {split!r}")
        levels = tuple(int(x) for x in levels)
        if not levels or any(x not in ALL_LEVELS for x in levels):
            raise ConfigError(f"levels must be a non-empty subset of {ALL_LEVELS}, got {levels!r}")
        n = DEFAULT_NUM_TASKS[split] if num_tasks is None else int(num_tasks)
        if n < 1:
            raise ConfigError(f"num_tasks must be >= 1, got {num_tasks!r}")
        self.split, self.levels, self.n = split, levels, n

    def __len__(self) -> int:
        return self.n

    def problem(self, index: int) -> Problem:
        g, level = _split_indices(self.split, self.levels, self.n)[index]
        return make_problem(g, level)

    def __getitem__(self, index: int) -> dict[str, Any]:
        g, level = _split_indices(self.split, self.levels, self.n)[index]
        p = make_problem(g, level)
        _exprs, answer = solve(p)
        return {
            "id": f"toolmath-{self.split}-{g}",
            "question": p.question,
            "ground_truth": answer,
            "split": self.split,
            "level": p.level,
            "kind": p.kind,
            "reward_kwargs": {"tolerance": p.tolerance},
        }
