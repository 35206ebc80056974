"""No Triton kernel depends on how a triton release types a bare literal.

Triton types a Python float literal inside `@triton.jit` code as fp32 only within fp32's normal
range (2^-126 .. 3.4e38; 0, inf and nan too) and an int literal as int32 only within int32;
anything else becomes fp64 / int64 and promotes whatever it meets. Triton 3.8 (torch 2.14.1's)
did so for the MXFP8 kernel's 2^-127 floor, which turned the whole block fp64: it failed to
compile for sm_80/90a/100a and gave wrong scales under the interpreter (issue 43). A constant
outside those ranges is written typed (`tl.full([], v, tl.float32)`), which this test accepts.
Run under triton 3.8 the behavioural tests (test_fp8_cast.py, test_aot.py) catch it too; this
one fails under any triton.
"""

import ast
import pathlib

import pytest

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"
FP32_NORMAL_MIN, FP32_MAX = 2.0**-126, 3.4028234663852886e38


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _constant(n: ast.AST) -> bool:
    """A literal, or an expression of literals only (`-1e-39`, `2.0**-127`, `1 << 40`)."""
    if isinstance(n, ast.Constant):
        return type(n.value) in (int, float)
    if isinstance(n, ast.UnaryOp):
        return _constant(n.operand)
    return isinstance(n, ast.BinOp) and _constant(n.left) and _constant(n.right)


def _is_tl_full(n: ast.AST) -> bool:
    return isinstance(n, ast.Call) and ast.unparse(n.func) == "tl.full"


def _past_fp32_or_int32(v) -> bool:
    if isinstance(v, float):
        return (
            v == v
            and v != 0
            and abs(v) != float("inf")
            and not (FP32_NORMAL_MIN <= abs(v) <= FP32_MAX)
        )
    return not -(2**31) <= v < 2**31


def untyped_literals(source: str) -> list[str]:
    """'fn:line value' for each literal in jit code that triton would type past fp32 / int32;
    the value of `tl.full(shape, value, dtype)` is typed where it stands."""
    bad = []

    def visit(n: ast.AST, fn: str):
        if _constant(n):
            v = eval(compile(ast.Expression(n), "<literal>", "eval"))  # literals only
            if _past_fp32_or_int32(v):
                bad.append(f"{fn}:{n.lineno} {v!r}")
            return
        for i, child in enumerate(ast.iter_child_nodes(n)):
            if not (_is_tl_full(n) and i == 2):  # children: func, shape, value, dtype
                visit(child, fn)

    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and _is_jit(fn):
            for stmt in fn.body:
                visit(stmt, fn.name)
    return bad


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_no_literal_outside_fp32_or_int32(path):
    bad = untyped_literals(path.read_text())
    assert not bad, f"{path.name}: type these literals explicitly: {bad}"


def test_the_check_catches_the_mxfp8_floor():
    # The MXFP8 kernel as it was before issue 43's fix, and what the fix wrote instead.
    before = (
        "@triton.jit\ndef k(x):\n"
        "    a = tl.maximum(tl.max(tl.abs(x), axis=0), 5.877471754111438e-39)\n"
        "    b = x * 1e39 + (1 << 40) + 2.0**-127\n"
    )
    assert untyped_literals(before) == [
        "k:3 5.877471754111438e-39",
        "k:4 1e+39",
        "k:4 1099511627776",
        "k:4 5.877471754111438e-39",
    ]
    after = "@triton.jit\ndef k(x):\n    a = tl.maximum(x, tl.full([], 2.0**-127, tl.float32))\n"
    assert untyped_literals(after) == []
    assert untyped_literals("def host():\n    return 1e-40\n") == []  # host code is torch's
