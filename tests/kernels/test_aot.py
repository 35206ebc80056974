"""The ahead-of-time kernel check (megalite.kernels.aot): every kernel compiles for sm_80 and
sm_90a through the launches its launcher makes on a GPU, within shared memory (the
sliding-window and MLA attention cases on sm_100a as well); the check fails
on a planted shared-memory overflow and a planted compile error; the compiled IR multiplies
row indices by strides in int64 (finding 1 of issue 32).

Each test runs the check in a process of its own: under TRITON_INTERPRET=1 (this session)
`@triton.jit` builds interpreted functions, which cannot be compiled. The full sweep
(fp32/fp16/bf16, head dim 128, odd sizes, sm_100a) is `make bench` (bench/run_all.py).
"""

import json
import os
import re
import subprocess
import sys

import pytest
from megalite.kernels._triton import tl, triton

REPRESENTATIVE = ("sm_80", "sm_90a")
# A sweep compiles for minutes (the quick set: 300 s and more on a loaded 2-core machine under
# triton 3.8); the subprocess's own 1500 s limit catches a hang, not pytest's default 300 s.
SWEEP = pytest.mark.timeout(1800)


@triton.jit
def _planted_smem(A, B, C, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # A pipelined matmul whose stages need 4 x 2 x 128 x 256 x 2 bytes of shared memory.
    m, n, k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(A + m[:, None] * K + (k0 + k)[None, :])
        b = tl.load(B + (k0 + k)[:, None] * BN + n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(C + m[:, None] * BN + n[None, :], acc)


@triton.jit
def _planted_error(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, 3), 0.0)  # arange needs a power of 2: a compile error


def _planted_cases():
    import torch

    def smem():
        a, b = (torch.empty(1024, 1024, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        c = torch.empty(128, 128, dtype=torch.float32, device="cuda")
        _planted_smem[(1,)](a, b, c, 1024, BM=128, BN=128, BK=256, num_warps=8, num_stages=4)

    def error():
        _planted_error[(1,)](torch.empty(4, device="cuda"), BLOCK=4)

    return [("planted smem", smem), ("planted error", error)]


# Scalar arguments that multiply row or batch/head indices: each product must be int64.
_OFFSET_ARGS = re.compile(r"^(stride\w*|s[a-z]{0,3}|s\w*_[bh])$")
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (.*?) : (.*?) loc")


def int32_offset_products(ttir: str) -> list[str]:
    """TTIR lines that multiply (or add) a value derived from an offset argument (_OFFSET_ARGS)
    in int32, following splats, broadcasts, reshapes and earlier products."""
    header = next(line for line in ttir.splitlines() if "tt.func" in line)
    tainted = set(re.findall(r"(%\w+): i32", header))
    tainted = {t for t in tainted if _OFFSET_ARGS.match(t[1:])}
    bad = []
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, op, operands, ty = m.groups()
        used = set(re.findall(r"%[\w.]+", operands)) & tainted
        if not used:
            continue
        if op in ("arith.muli", "arith.addi"):
            if not re.search(r"i64>?$", ty.split("->")[-1].strip()):
                bad.append(line.strip())
            tainted.add(name)
        elif op in ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "arith.extsi"):
            tainted.add(name)
    return bad


def _ir_report() -> dict:
    """{kernel: its int32 offset products} for every kernel of the quick set on sm_90a."""
    import triton as tr
    from megalite.kernels import aot
    from megalite.kernels.aot_capture import ARCHS, capture
    from megalite.kernels.aot_cases import cases
    from triton.compiler import ASTSource, make_backend

    arch = ARCHS["sm_90a"]
    target = aot._target(arch)
    backend = make_backend(target)
    with capture(arch) as rec:
        for name, thunk in cases(False):
            if not name.startswith("grouped_mm"):  # int64 by construction, checked below anyway
                rec.case = name
                thunk()
    out = {}
    for launch in rec.launches:
        name = launch.fn.fn.__name__
        if name in out:
            continue
        sig, consts, attrs, opts = aot._bind(launch, backend)
        src = ASTSource(launch.fn, sig, consts, attrs)
        ttir = tr.compile(src, target=target, options=opts.__dict__).asm["ttir"]
        out[name] = int32_offset_products(ttir)
    return out


def _run(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # today's default, without its deprecation warning
    return subprocess.run(
        [sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=1500
    )


@SWEEP
def test_every_kernel_compiles_within_limits():
    run = _run("quick")
    assert run.returncode == 0, f"kernel check failed:\n{run.stdout[-6000:]}{run.stderr[-3000:]}"
    rows = json.loads(run.stdout.splitlines()[-1])
    names = {r["kernel"] for r in rows}
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_delta", "_ce_stats_kernel",
                   "_ce_grad_kernel", "_rms_norm_fwd", "_rms_norm_bwd", "_layer_norm_fwd",
                   "_layer_norm_bwd", "_swiglu_fwd", "_swiglu_bwd", "_gelu_fwd", "_gelu_bwd",
                   "_rotary_kernel", "_grouped_mm_kernel", "_grouped_dw_kernel"):  # fmt: skip
        assert kernel in names, f"{kernel} was never launched by the scenarios"
    # The GPU's choices were captured, not the interpreter's (ROWS > 1, 64 x 64 tiles).
    for r in rows:
        assert re.findall(r"ROWS=(\d+)", r["config"]) in ([], ["1"]), r
        if r["kernel"] == "attn_fwd":
            assert "BLOCK_M=128" in r["config"] or "BLOCK_M=64, BLOCK_N=32" in r["config"], r
    # Spills at the default (bf16) configurations were fixed on sm_80 and sm_90a.
    spilling = [f"{r['arch']} {r['kernel']} {r['config']}: {r['spill']} B" for r in rows
                if r["spill"]]  # fmt: skip
    assert not spilling, "\n".join(spilling)


@SWEEP
def test_window_and_mla_attention_compile_on_sm_100a():
    # The sliding-window and MLA (head dim 192) cases of the quick set on sm_100a too: they
    # compile, within shared memory (spills there are reported, not failed: no config is tuned
    # for sm_100a yet).
    run = _run("sm_100a")
    assert run.returncode == 0, f"kernel check failed:\n{run.stdout[-6000:]}{run.stderr[-3000:]}"
    rows = json.loads(run.stdout.splitlines()[-1])
    configs = {(r["kernel"], r["config"].split("; ")[1]) for r in rows}
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        assert any(k == kernel and "HEAD_D=192" in c for k, c in configs), (kernel, configs)
    assert {r["case"].split(" bf16")[0] for r in rows} >= {"attention window", "attention mla"}


def test_check_fails_on_planted_overflow_and_compile_error():
    run = _run("planted")
    assert run.returncode == 0, run.stderr[-3000:]
    failures = json.loads(run.stdout.splitlines()[-1])
    smem = [f for f in failures if "_planted_smem" in f]
    error = [f for f in failures if "_planted_error" in f]
    assert smem and "shared memory >" in smem[0], failures
    assert error and "Error" in error[0], failures
    assert len(failures) == 2, failures


def test_offsets_are_int64_in_compiled_ir():
    run = _run("ir")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert len(report) >= 15, report.keys()
    bad = {k: v for k, v in report.items() if v}
    assert not bad, f"int32 products of offset arguments: {json.dumps(bad, indent=1)}"


def test_ir_check_catches_int32_row_offsets():
    # The checker itself: an int32 `row * stride` (main before finding 1's fix) is caught.
    ttir = (
        "tt.func public @k(%X: !tt.ptr<bf16>, %stride: i32 loc(#a)) {\n"
        "    %r = tt.get_program_id x : i32 loc(#l)\n"
        "    %0 = arith.muli %r, %stride : i32 loc(#l)\n"
        "    %1 = arith.extsi %stride : i32 to i64 loc(#l)\n"
        "    %2 = tt.splat %1 : i64 -> tensor<4xi64> loc(#l)\n"
        "    %3 = arith.muli %2, %2 : tensor<4xi64> loc(#l)\n"
    )
    assert int32_offset_products(ttir) == ["%0 = arith.muli %r, %stride : i32 loc(#l)"]


if __name__ == "__main__":
    mode = sys.argv[1]
    from megalite.kernels import aot

    if mode == "quick":
        from megalite.kernels.aot_cases import cases

        results, failures = aot.check(cases(False), REPRESENTATIVE)
        print("\n".join(failures))
        print(json.dumps([r.__dict__ for r in results]))
        sys.exit(1 if failures else 0)
    if mode == "sm_100a":
        from megalite.kernels.aot_cases import cases

        picked = [c for c in cases(False) if " window " in c[0] or " mla " in c[0]]
        results, failures = aot.check(picked, ["sm_100a"])
        print("\n".join(failures))
        print(json.dumps([r.__dict__ for r in results]))
        sys.exit(1 if failures else 0)
    if mode == "planted":
        print(json.dumps(aot.check(_planted_cases(), ["sm_90a"])[1]))
    if mode == "ir":
        print(json.dumps(_ir_report()))
