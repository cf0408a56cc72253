"""Add a tool: one class and one registration line.

A tool is a callable that returns a ``ToolResult`` and describes its arguments with ``schema()`` (the ``Tool``
protocol in ``arpo_env/tools/base.py``). Registering it with a :class:`~arpo_env.tools.registry.ToolSpec` (its name,
its tag, the argument the tag's text is passed as, and what builds it) is all the rest of arpo needs: a
``tools.calculator`` section in the env config (``build_tools``, its keys checked against the constructor), the tag
protocol's ``<calc>...</calc>`` calls, stop string and result, the reward's format check, and the JSON protocol's
schema, once this module is imported.

This one evaluates arithmetic without running code: it walks the expression's syntax tree and accepts only numbers,
``+ - * / // % **`` and parentheses. Run one scripted episode of ToolMath with it::

    python -m examples.extend.tool
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable
from typing import Any

from arpo_env.tools.base import ToolResult, check_text_arg, function_schema, tolerant_call
from arpo_env.tools.registry import ToolSpec, register_tool

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """Evaluates an arithmetic expression; never runs code.

    Args:
        max_chars: Longer expressions are refused.
        max_bits: The largest power it computes, in bits of the result (``2**4096`` is the default's edge).
        digits: Significant digits of a non-integer result.
    """

    name = "calculator"

    def __init__(self, max_chars: int = 500, max_bits: int = 4096, digits: int = 12) -> None:
        self.max_chars, self.max_bits, self.digits = max_chars, max_bits, digits

    def schema(self) -> dict:
        return function_schema(self.name, self.__call__)

    @tolerant_call
    def __call__(self, expression: str) -> ToolResult:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers, + - * / // % ** and parentheses, e.g. (3 + 4) * 2**10.
        """
        start = time.monotonic()
        problem = check_text_arg(expression, "expression", self.max_chars)
        if problem:
            return ToolResult(text=problem, error=True, meta={"invalid_arguments": True})
        try:
            value = self._eval(ast.parse(expression.strip(), mode="eval").body)
            text = str(value) if isinstance(value, int) else f"{value:.{self.digits}g}"
        except (SyntaxError, ValueError, ArithmeticError) as e:  # str(huge int) raises ValueError
            return ToolResult(text=f"Error: {e}", error=True, latency_s=time.monotonic() - start)
        return ToolResult(text=text, latency_s=time.monotonic() - start)

    def _eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * math.log2(abs(left)) > self.max_bits:
                raise ValueError(f"the power has more than {self.max_bits} bits")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


SPEC = register_tool(ToolSpec("calculator", "expression", Calculator, tag="calc"))


def main() -> None:
    from arpo_env.core import ToolTextEnv

    env = ToolTextEnv(task="toolmath", levels=[1], tools={"calculator": {}}, reward="arpo_reference")
    question, info = env.reset(seed=0)
    expression = env.tasks.problem(info["task"]["index"]).steps[0][1]([])  # a scripted model: the task's own step
    result, *_ = env.step(f"<think>I compute it.</think> <calc>{expression}</calc>")
    answer = result.split("\n")[1]
    _, reward, *_ = env.step(f"<think>Done.</think> <answer>\\boxed{{{answer}}}</answer>")
    print(f"{question}\n{env.response}\nreward {reward}")


if __name__ == "__main__":
    main()
