"""Tools used by the shipped configs."""

from __future__ import annotations

import ast
import operator
import time

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".
    """
    # Parsed with ast and walked by hand: never eval(), whatever the model writes.
    value = _eval(ast.parse(expression, mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def flaky_lookup(key: int) -> str:
    """Look up the value stored under a key.

    Args:
        key: A key between 0 and 9.
    """
    if key % 4 == 0:
        time.sleep(3600)  # a hung backend: the tool timeout must cut it off
    if key % 4 == 1:
        raise ConnectionError(f"lookup backend refused key {key}")
    return f"value {key * 7}"
