"""The tools a policy may call in a multi-turn episode, each safe to run on untrusted input.

- `calculator`: an arithmetic expression (integers and decimals, + - * / // % **, unary
  signs, parentheses), evaluated by walking its syntax tree; no name, call or attribute is
  ever looked up, and powers and results are bounded, so no input can run code or exhaust the
  machine.
- `python`: a program run in the verifiers' sandbox (`cagrpo_ray/rewards/sandbox.py`: its own
  interpreter and process group, time and memory limits, no network); its stdout is the
  result.

Every call returns a `ToolResult` and never raises for what the policy wrote: a bad
expression, a crash, a program that hangs (cut at its time limit) or prints too much (cut at
`max_output_chars`) each become a clear message the policy reads, with a status that the run
counts (`env/tool_errors`, `env/tool_timeouts`).
"""

from __future__ import annotations

import ast
import operator
import time
from dataclasses import dataclass

MAX_OUTPUT_CHARS = 400  # what a tool may put back into the context
PYTHON_OUTPUT_BYTES = 1 << 16  # what a program may print at all (the sandbox stops it past it)
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the policy reads
    status: str  # "ok" | "error" | "timeout"
    seconds: float


class ToolError(ValueError):
    """The call was malformed or its computation refused; the message says why."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic `expression`; ToolError for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ToolError("the expression is nested too deeply") from None
    try:
        return _value(tree.body)
    except RecursionError:  # a chain of thousands of operators
        raise ToolError("the expression is nested too deeply") from None


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ToolError("the result is too large or not a real number")
        return result
    raise ToolError(f"{type(node).__name__} is not allowed: numbers and + - * / // % ** only")


def _shown(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(round(value, 10)) if isinstance(value, float) else str(value)


def _cut(text: str, max_chars: int) -> tuple[str, bool]:
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"... [output cut at {max_chars} characters]", True


def run_calculator(expression: str, max_output_chars: int = MAX_OUTPUT_CHARS) -> ToolResult:
    start = time.perf_counter()
    try:
        text, status = _shown(calculate(expression)), "ok"
    except ToolError as exc:
        text, status = f"error: {exc}", "error"
    return ToolResult(_cut(text, max_output_chars)[0], status, time.perf_counter() - start)


def run_python(
    code: str, wall_s: float = 2.0, max_output_chars: int = MAX_OUTPUT_CHARS
) -> ToolResult:
    """`code` in the sandbox with `wall_s` seconds; its stdout, or why it has none."""
    from cagrpo_ray.rewards.sandbox import SandboxLimits, run_solution

    start = time.perf_counter()
    limits = SandboxLimits(wall_s=wall_s, output_bytes=PYTHON_OUTPUT_BYTES)
    try:
        run = run_solution(code, inputs=[""], limits=limits)
    except RuntimeError as exc:  # the sandbox's own interpreter did not come up in time
        return ToolResult(f"error: the sandbox did not run it ({exc})", "timeout",
                          time.perf_counter() - start)  # fmt: skip
    seconds = time.perf_counter() - start
    if run.timed_out:
        return ToolResult(f"error: the program ran past its {wall_s:g} s limit", "timeout", seconds)
    if run.compile_error:
        return ToolResult(
            _cut(f"error: {run.compile_error}", max_output_chars)[0], "error", seconds
        )
    output, status = run.outputs[0], run.case_status[0]
    if status == "output limit":
        status = f"the program printed more than {PYTHON_OUTPUT_BYTES} bytes"
    if output is None or status != "ok":
        return ToolResult(_cut(f"error: {status}", max_output_chars)[0], "error", seconds)
    return ToolResult(_cut(output.strip(), max_output_chars)[0], "ok", seconds)


TOOLS = {"calculator": run_calculator, "python": run_python}
