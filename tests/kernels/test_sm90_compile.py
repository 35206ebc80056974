"""Every kernel compiles for a GPU (sm_90, Hopper) with its GPU block sizes, without a GPU.

The other tests run the kernels under the interpreter, which accepts code the compiler refuses
(gelu read a plain-float global on main). Triton compiles to PTX here (its bundled ptxas), in a
process of its own: under TRITON_INTERPRET=1 (this test session) `@triton.jit` builds
interpreted functions, which cannot be compiled.
"""

import importlib
import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KB)
FP32 = ("MEAN", "RSTD", "DW", "DB", "MAX", "SUMEXP", "TARGET", "LSE", "DLOSS", "DELTA")
INTS = {"LABELS": "*i64", "QP": "*i64", "KP": "*i64", "QD": "*i64", "KD": "*i64"}


def _signature(fn, consts, ptr):
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("CNT", "IDX"):
            sig[name] = "*i32"
        elif name in INTS:
            sig[name] = INTS[name]
        elif name in FP32:
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = ptr
        elif name in ("eps", "qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _cases():
    """(name, jit function, constexprs, compile options, pointer type) with GPU choices."""
    import torch

    names = ("activations", "attention_core", "cross_entropy", "layer_norm", "rms_norm")
    mod = {m: importlib.import_module(f"megalite.kernels.{m}") for m in names}
    row = {"BLOCK": 4096, "ROWS": 1}
    out = [
        ("layer_norm_fwd", mod["layer_norm"]._layer_norm_fwd, {**row, "HAS_BIAS": True}, 16),
        ("layer_norm_bwd", mod["layer_norm"]._layer_norm_bwd, {**row, "HAS_BIAS": True}, 16),
        ("rms_norm_fwd", mod["rms_norm"]._rms_norm_fwd, row, 16),
        ("rms_norm_bwd", mod["rms_norm"]._rms_norm_bwd, row, 16),
        ("gelu_fwd", mod["activations"]._gelu_fwd, {"BLOCK": 1024, "ROWS": 1}, 4),
        ("gelu_bwd", mod["activations"]._gelu_bwd, {"BLOCK": 1024, "ROWS": 1}, 4),
        ("swiglu_fwd", mod["activations"]._swiglu_fwd, {"BLOCK": 1024, "ROWS": 1}, 4),
        ("swiglu_bwd", mod["activations"]._swiglu_bwd, {"BLOCK": 1024, "ROWS": 1}, 4),
        ("ce_stats", mod["cross_entropy"]._ce_stats_kernel, {"BLOCK_V": 4096, "ROWS": 1}, 8),
        ("ce_grad", mod["cross_entropy"]._ce_grad_kernel, {"BLOCK_V": 4096, "ROWS": 1}, 8),
    ]
    cases = [(n, fn, c, {"num_warps": w}, "*bf16") for n, fn, c, w in out]
    core = mod["attention_core"]
    for d in (64, 128):
        # config reads only q's shape, dtype and device: a stand-in for a CUDA tensor.
        q = SimpleNamespace(shape=(1, 1, 1, d), dtype=torch.bfloat16, device=torch.device("cuda"))
        cfg = core.config(q)
        for kind, fn in (("fwd", core.attn_fwd), ("dkdv", core.attn_bwd_dkdv),
                         ("dq", core.attn_bwd_dq)):  # fmt: skip
            bm, bn, warps, stages = cfg[kind]
            consts = {"HAS_DOC": True, "D": d, "BLOCK_M": bm, "BLOCK_N": bn, "PREC": "tf32"}
            opts = {"num_warps": warps, "num_stages": stages}
            cases.append((f"attention_{kind}_d{d}", fn, consts, opts, "*bf16"))
        delta = {"D": d, "BLOCK_M": 64}
        cases.append((f"attention_delta_d{d}", core.attn_bwd_delta, delta, {}, "*bf16"))
    return cases


def _compile_all() -> list[str]:
    """Compile every case; the failures, one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, failures = GPUTarget("cuda", 90, 32), []
    for name, fn, consts, opts, ptr in _cases():
        try:
            src = ASTSource(fn, _signature(fn, consts, ptr), constexprs=consts)
            shared = triton.compile(src, target=target, options=opts).metadata.shared
            if shared > SHARED_MEMORY:
                failures.append(f"{name}: {shared} bytes of shared memory > {SHARED_MEMORY}")
        except Exception as e:  # noqa: BLE001 - report every kernel's failure, not the first
            failures.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    return failures


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # today's default, without its deprecation warning
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, f"kernels that do not compile for sm_90:\n{run.stdout}{run.stderr}"


if __name__ == "__main__":
    failed = _compile_all()
    print("\n".join(failed))
    sys.exit(1 if failed else 0)
