"""The scenarios the ahead-of-time check drives the launchers through (aot.py compiles them).

Each scenario calls a launcher as the model does (forward and backward), on fake CUDA tensors
inside aot_capture.capture; the launches it makes are what gets compiled. `cases(full)` lists
(name, thunk): the quick set covers every kernel at bf16 and the default shapes, with a sliding
window and at MLA's head dim 192 for attention, and the FP8 quantise kernels (sm_89+); the full
set adds fp32/fp16, head dim 128, GQA and odd sizes.
"""

import importlib

import torch
from megalite.kernels.aot_capture import forward_backward

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _mod(name):
    return importlib.import_module(f"megalite.kernels.{name}")


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda")


def _attention(dtype, d, hq, hkv, s, docs=False, window=0):
    attn = _mod("attention")
    q, k, v = (
        _t(2, hq, s, d, dtype=dtype),
        _t(2, hkv, s, d, dtype=dtype),
        _t(2, hkv, s, d, dtype=dtype),
    )
    if docs:  # document-masked, ids per batch row
        pos = torch.zeros(2, s, dtype=torch.int64, device="cuda")
        ids = (pos, pos, pos, pos)
    else:
        ids = (None,) * 4
    forward_backward(attn._MaskedAttention, q, k, v, d**-0.5, *ids, window)


def _ring_block(dtype, d, hq, hkv, s, window=0):
    # One ring-attention step: fp32 block results, positions as the ring passes them.
    blocks = _mod("attention_blocks")
    q, k, v = (
        _t(1, hq, s, d, dtype=dtype),
        _t(1, hkv, s, d, dtype=dtype),
        _t(1, hkv, s, d, dtype=dtype),
    )
    pos = torch.zeros(2, s, dtype=torch.int64, device="cuda")
    out, lse = blocks.attention_block_fwd(q, k, v, pos[0], pos[1], window=window or None)
    blocks.attention_block_bwd(q, k, v, out, lse, torch.empty_like(q), pos[0], pos[1],
                               window=window or None)  # fmt: skip


def _cross_entropy(dtype, tokens, vocab):
    ce = _mod("cross_entropy")
    labels = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    forward_backward(ce._CrossEntropy, _t(tokens, vocab, dtype=dtype), labels, -100)


def _norms(dtype, rows, n):
    ln, rms = _mod("layer_norm"), _mod("rms_norm")
    x, w = _t(rows, n, dtype=dtype), _t(n, dtype=dtype)
    forward_backward(rms._RMSNorm, x, w, 1e-5)
    forward_backward(ln._LayerNorm, x, w, w, 1e-5)
    forward_backward(ln._LayerNorm, x, w, None, 1e-5)


def _activations(dtype, rows, n):
    act = _mod("activations")
    fused = _t(rows, 2 * n, dtype=dtype)  # gate/up halves of one projection: strided views
    gate, up = fused.narrow(1, 0, n), fused.narrow(1, n, n)
    forward_backward(act._SwiGLU, gate, up)
    for exact in (False, True):  # GPT-2's tanh GELU and the exact (erf) one
        forward_backward(act._GELU, _t(rows, n, dtype=dtype), exact)


def _rotary(dtype, heads, d):
    rot = _mod("rotary")
    s = 256
    forward_backward(rot._Rotary, _t(2, s, heads, d, dtype=dtype), _t(s, d // 2), _t(s, d // 2))


def _grouped_mm(dtype, tokens, experts, n, k):
    gg = _mod("grouped_gemm")
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device="cuda")
    forward_backward(gg._GroupedMM, _t(tokens, k, dtype=dtype), _t(experts, n, k, dtype=dtype),
                     offsets)  # fmt: skip


def _fp8_casts(dtype, rows, n):
    """The FP8 quantise kernels as the recipes call them (kernels/fp8_cast.py TRITON_CASTS):
    tensorwise amax and casts to e4m3 (x, w) and e5m2 (the gradient), MXFP8 blocks. FP8 needs
    sm_89+ (no FP8 run starts below it, kernels/fp8.py device_problem): nothing on sm_80/86."""
    if torch.cuda.get_device_capability() < (8, 9):
        return
    fc = _mod("fp8_cast")
    x = _t(rows, n, dtype=dtype)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        fc.TRITON_CASTS(x, fp8)
    fc.TRITON_CASTS.mx(x, torch.float8_e4m3fn)


# gpt-oss's window (Mistral's is 4096): the window is a runtime int, so one size stands for all.
WINDOW = 128


def _windowed(dt, name) -> list[tuple[str, object]]:
    """Sliding-window attention: causal, document-masked and one ring block (d 64, s 512)."""
    d, hq, hkv, s = 64, 16, 4, 512
    tag = f"{name} d{d} h{hq}/{hkv} s{s} w{WINDOW}"
    return [
        (f"attention window {tag}", lambda: _attention(dt, d, hq, hkv, s, window=WINDOW)),
        (
            f"attention docs window {tag}",
            lambda: _attention(dt, d, hq, hkv, s, docs=True, window=WINDOW),
        ),  # fmt: skip
        (f"ring block window {tag}", lambda: _ring_block(dt, d, hq, hkv, s, window=WINDOW)),
    ]


def _mla(dt, name) -> list[tuple[str, object]]:
    """MLA's shape: q/k/v padded to d = 192 (DeepSeek-V3's 128 + 64), as many kv heads as q."""
    d, h, s = 192, 16, 512
    tag = f"{name} d{d} h{h}/{h} s{s}"
    return [
        (f"attention mla {tag}", lambda: _attention(dt, d, h, h, s)),
        (f"ring block mla {tag}", lambda: _ring_block(dt, d, h, h, s)),
    ]


def cases(full: bool) -> list[tuple[str, object]]:
    """(name, thunk) for the quick set, or the full sweep."""
    dtypes = list(DTYPES) if full else ["bf16"]
    out = []
    for name in dtypes:
        dt = DTYPES[name]
        heads = [(64, 16, 16, 512), (64, 32, 8, 300)]  # (d, hq, hkv, s): MHA; GQA, odd length
        if full:
            heads += [(128, 32, 8, 4096), (128, 8, 1, 1000)]
        for d, hq, hkv, s in heads:
            tag = f"{name} d{d} h{hq}/{hkv} s{s}"
            out.append((f"attention {tag}", lambda dt=dt, a=(d, hq, hkv, s): _attention(dt, *a)))
            out.append((f"attention docs {tag}",
                        lambda dt=dt, a=(d, hq, hkv, s): _attention(dt, *a, docs=True)))  # fmt: skip
            out.append((f"ring block {tag}", lambda dt=dt, a=(d, hq, hkv, s): _ring_block(dt, *a)))
        out += _windowed(dt, name)
        out += _mla(dt, name)
        vocabs = [(8192, 50304)] + ([(4096, 128256), (1000, 32001)] if full else [])
        for tokens, vocab in vocabs:
            out.append((f"cross_entropy {name} {tokens}x{vocab}",
                        lambda dt=dt, a=(tokens, vocab): _cross_entropy(dt, *a)))  # fmt: skip
        sizes = [(4096, 4096)] + ([(1000, 1000), (2048, 8192), (512, 65536)] if full else [])
        for rows, n in sizes:
            tag = f"{name} {rows}x{n}"
            out.append((f"norms {tag}", lambda dt=dt, a=(rows, n): _norms(dt, *a)))
            out.append((f"activations {tag}", lambda dt=dt, a=(rows, n): _activations(dt, *a)))
            out.append((f"fp8 casts {tag}", lambda dt=dt, a=(rows, n): _fp8_casts(dt, *a)))
        for heads_, d in [(32, 128)] + ([(12, 64), (5, 96)] if full else []):
            out.append((f"rotary {name} h{heads_} d{d}",
                        lambda dt=dt, a=(heads_, d): _rotary(dt, *a)))  # fmt: skip
        for shape in [(8192, 8, 1024, 4096)] + ([(1000, 3, 1000, 768)] if full else []):
            out.append((f"grouped_mm {name} T{shape[0]} E{shape[1]} {shape[2]}x{shape[3]}",
                        lambda dt=dt, a=shape: _grouped_mm(dt, *a)))  # fmt: skip
    return out
