import os
import subprocess
import sys
import warnings

import megalite.kernels as K
import pytest
import torch
from megalite.kernels.activations import gelu_ref

from tests.kernels.helpers import assert_within, check_op, make


def test_select_modes():
    assert K.select("torch", "cpu") is K.TORCH_OPS
    assert K.select("auto", torch.device("cpu")) is K.TORCH_OPS
    assert K.select("triton", "cpu") is K.TRITON_OPS  # under TRITON_INTERPRET=1 (conftest)
    assert K.select("torch", "cuda") is K.TORCH_OPS
    with pytest.raises(ValueError, match="choose one of"):
        K.select("fast", "cpu")
    for name in vars(K.TORCH_OPS):
        assert callable(getattr(K.TRITON_OPS, name))


@pytest.mark.parametrize(
    "op,args",
    [
        ("attention", lambda: [make((1, 2, 9, 24), torch.float32) for _ in range(3)]),  # d=24
        ("gelu", lambda: [make((3, 5), torch.bfloat16)]),  # bf16 under the interpreter
        ("rms_norm", lambda: [make((3, 5), torch.float64), make((5,), torch.float64), 1e-5]),
    ],
)
def test_unsupported_falls_back_with_one_warning(op, args):
    fast, ref = getattr(K.TRITON_OPS, op), getattr(K.TORCH_OPS, op)
    a = args()
    with pytest.warns(UserWarning, match=f"megalite.kernels.{op}: .*torch reference"):
        out = fast(*a)
    torch.testing.assert_close(out, ref(*a), rtol=0, atol=0)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        fast(*a)
    assert not again  # warned once per op and reason


def test_attention_dropout_falls_back():
    q = make((1, 2, 9, 16), torch.float32)
    with pytest.warns(UserWarning, match="dropout"):
        out = K.TRITON_OPS.attention(q, q, q, dropout_p=0.5)
    assert out.shape == q.shape


def test_rule_rejects_a_small_error():
    # The accuracy rule must fail an op slightly worse than torch, or no test here could fail.
    x = make((4, 33), torch.float16)
    with pytest.raises(AssertionError, match="kernel error"):
        check_op(lambda t: gelu_ref(t) * (1 + 2e-3), gelu_ref, (x,))
    with pytest.raises(AssertionError, match="kernel error"):
        e = torch.zeros(3, dtype=torch.float64)
        assert_within("x", e + 1e-4, e.float(), e, 1e-5)


def test_import_without_triton():
    """megalite.kernels imports and select('triton') warns and returns the refs without triton."""
    code = (
        "import sys, warnings; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import megalite.kernels as K\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    ops = K.select('triton', 'cpu')\n"
        "    x = K.TRITON_OPS.gelu(__import__('torch').ones(3))\n"
        "assert ops is K.TORCH_OPS, ops\n"
        "assert any('triton is unavailable' in str(m.message) for m in w), [str(m) for m in w]\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
