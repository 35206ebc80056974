"""Forward+backward time and peak memory of each megalite kernel beside its alternatives.

For every op: megalite's Triton kernel, the torch reference run eagerly, the same reference under
torch.compile, and Liger-Kernel where it is installed (attention: flash-attn where installed,
else PyTorch SDPA restricted to its flash backend). Memory-bound ops report achieved bandwidth
as a share of HBM bandwidth; attention reports TFLOP/s (causal: half the square).

    python bench/gpu/kernels.py                     # all ops, bf16, llama-1B-like shapes, a table
    python bench/gpu/kernels.py --ops rms_norm attention --impls megalite eager --json out.json
    python bench/gpu/kernels.py --dry-run           # list the cases (works without a GPU)
"""

import argparse
import json
import math
import sys
import time

OPS = ("rms_norm", "layer_norm", "rotary", "swiglu", "gelu", "cross_entropy", "attention")
IMPLS = ("megalite", "eager", "compile", "liger", "flash")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--tokens", type=int, default=8192, help="batch * sequence (default 4 x 2048)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (rotary, attention)")
    p.add_argument("--hidden", type=int, default=4096, help="norm width")
    p.add_argument("--ffn", type=int, default=8192, help="SwiGLU/GELU width")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--heads", type=int, default=32, help="query heads (rotary, attention)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth (H200: 4.8 TB/s)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--dry-run", action="store_true", help="print the cases and exit (no GPU)")
    return p.parse_args(argv)


def cases(a):
    """(op, label, shapes dict, bytes moved by fwd+bwd per element size, flops) per case.

    Bytes are the minimum traffic of a fused fwd+bwd (each tensor read or written once), in
    units of elements; attention is compute-bound and gets flops instead.
    """
    t, b = a.tokens, a.tokens // a.seq
    out = []
    if "rms_norm" in a.ops:  # fwd: read x, write y; bwd: read x, dy, write dx
        out.append(("rms_norm", f"{t}x{a.hidden}", dict(x=(t, a.hidden)), 5 * t * a.hidden, 0))
    if "layer_norm" in a.ops:
        out.append(("layer_norm", f"{t}x{a.hidden}", dict(x=(t, a.hidden)), 5 * t * a.hidden, 0))
    if "rotary" in a.ops:  # q and k, read + write, fwd and bwd
        d = max(a.head_dims)
        n = b * a.seq * (a.heads + a.kv_heads) * d
        shape = dict(q=(b, a.seq, a.heads, d), k=(b, a.seq, a.kv_heads, d))
        out.append(("rotary", f"q,k {b}x{a.seq}x({a.heads}+{a.kv_heads})x{d}", shape, 4 * n, 0))
    if "swiglu" in a.ops:  # fwd: read g, u, write y; bwd: read g, u, dy, write dg, du
        out.append(("swiglu", f"{t}x{a.ffn}", dict(x=(t, a.ffn)), 8 * t * a.ffn, 0))
    if "gelu" in a.ops:
        out.append(("gelu", f"{t}x{a.ffn}", dict(x=(t, a.ffn)), 5 * t * a.ffn, 0))
    if "cross_entropy" in a.ops:  # fwd: read logits; bwd: read logits, write their gradient
        out.append(("cross_entropy", f"{t}x{a.vocab}", dict(x=(t, a.vocab)), 3 * t * a.vocab, 0))
    if "attention" in a.ops:
        for d in a.head_dims:
            # causal fwd: 2 matmuls of b*h*s*s/2*d MACs; bwd: 5 of them (2.5x the forward)
            flops = 3.5 * 2 * 2 * b * a.heads * a.seq * a.seq / 2 * d
            label = f"{b}x{a.heads}/{a.kv_heads}x{a.seq}x{d}"
            shape = dict(q=(b, a.heads, a.seq, d), kv=(b, a.kv_heads, a.seq, d))
            out.append(("attention", label, shape, 0, flops))
    return out


def make_inputs(op, shape, dtype, torch):
    dev = "cuda"

    def r(*s, scale=1.0):
        return (torch.randn(*s, device=dev, dtype=torch.float32) * scale).to(dtype)

    def g(x):
        return x.requires_grad_()

    if op in ("rms_norm", "layer_norm"):
        n = shape["x"][1]
        x, w, bias = g(r(*shape["x"])), g(r(n) + 1), g(r(n))
        return (x, w, 1e-5) if op == "rms_norm" else (x, w, bias, 1e-5)
    if op == "rotary":
        s, d = shape["q"][1], shape["q"][3]
        ang = torch.arange(s, device=dev)[:, None] * 1e-2 ** torch.arange(d // 2, device=dev)
        return g(r(*shape["q"])), g(r(*shape["k"])), ang.cos(), ang.sin()
    if op == "swiglu":
        return g(r(*shape["x"], scale=3)), g(r(*shape["x"]))
    if op == "gelu":
        return (g(r(*shape["x"], scale=3)),)
    if op == "cross_entropy":
        x = g(r(*shape["x"], scale=4))
        return x, torch.randint(0, shape["x"][1], shape["x"][:1], device=dev)
    return g(r(*shape["q"])), g(r(*shape["kv"])), g(r(*shape["kv"]))


def implementations(op, impls, torch):
    """name -> callable(*inputs) -> a tensor (or tensors) to run backward from, or a skip reason."""
    import megalite.kernels as K

    fast, ref = getattr(K.TRITON_OPS, op), getattr(K.TORCH_OPS, op)
    if op == "rotary":  # q and k through the same op, as the model does
        fast_, ref_ = fast, ref

        def fast(q, k, c, s):
            return fast_(q, c, s), fast_(k, c, s)

        def ref(q, k, c, s):
            return ref_(q, c, s), ref_(k, c, s)

    out = {}
    if "megalite" in impls:
        out["megalite"] = fast
    if "eager" in impls:
        out["eager"] = ref
    if "compile" in impls:
        out["compile"] = torch.compile(ref)
    if "liger" in impls and op != "attention":
        out["liger"] = _liger(op, torch)
    if "flash" in impls and op == "attention":
        out["flash"] = _flash(torch)
    return out


def _liger(op, torch):
    try:
        from liger_kernel.ops import layer_norm, rms_norm, rope, swiglu
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch/triton
        return f"liger-kernel not importable ({type(e).__name__})"
    if op == "rms_norm":
        return lambda x, w, eps: rms_norm.LigerRMSNormFunction.apply(x, w, eps)
    if op == "layer_norm":
        return lambda x, w, b, eps: layer_norm.LigerLayerNormFunction.apply(x, w, b, eps)
    if op == "swiglu":
        return swiglu.LigerSiLUMulFunction.apply
    if op == "rotary":

        def liger_rope(q, k, c, s):  # Liger wants (b, h, s, d) and full-width (1, s, d) tables
            c2, s2 = (
                torch.cat([c, c], -1)[None].to(q.dtype),
                torch.cat([s, s], -1)[None].to(q.dtype),
            )
            return rope.LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), c2, s2)

        return liger_rope
    if op == "cross_entropy":
        loss = __import__("liger_kernel.transformers", fromlist=["x"]).LigerCrossEntropyLoss
        fn = loss(reduction="none")
        return lambda x, labels: fn(x, labels)
    return "no Liger kernel for this op (Liger fuses GELU only as GEGLU)"


def _flash(torch):
    try:
        from flash_attn import flash_attn_func

        # flash-attn wants (b, s, h, d) and handles grouped heads itself
        return lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True
        )
    except Exception:  # noqa: BLE001 - fall back to SDPA's own FlashAttention-2 backend
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True
                )

        return sdpa_flash


def measure(fn, inputs, a, torch):
    """Median fwd+bwd milliseconds over a.iters, and peak memory above the inputs (MiB)."""
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def outputs():
        out = fn(*inputs)
        return out if isinstance(out, tuple) else (out,)

    grads = [torch.randn_like(o) for o in outputs()]  # made once, outside the timed steps

    def step():
        torch.autograd.grad(outputs(), wrt, grads)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(a.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return sorted(times)[len(times) // 2], peak


def main(argv=None):
    a = parse_args(argv)
    todo = cases(a)
    if a.dry_run:
        for op, label, *_ in todo:
            print(f"{op:14s} {label:32s} {' '.join(a.impls)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "bench/gpu/kernels.py needs a CUDA GPU (use --dry-run to list the cases)",
            file=sys.stderr,
        )
        return 2
    dtype = getattr(torch, DTYPES[a.dtype])
    elem = torch.finfo(dtype).bits // 8
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {a.dtype}")
    print("| op | shape | impl | fwd+bwd ms | GB/s | % of HBM | TFLOP/s | peak extra MiB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for op, label, shape, elems, flops in todo:
        torch.manual_seed(0)
        inputs = make_inputs(op, shape, dtype, torch)
        for name, fn in implementations(op, a.impls, torch).items():
            row = dict(op=op, shape=label, impl=name)
            if isinstance(fn, str):
                row["skipped"] = fn
            else:
                t0 = time.time()
                try:
                    ms, peak = measure(fn, inputs, a, torch)
                    row.update(ms=ms, peak_mib=peak, wall_s=time.time() - t0)
                    if elems:
                        row["gbps"] = elems * elem / ms / 1e6
                        row["hbm_share"] = row["gbps"] / (a.hbm_tbps * 1e3)
                    if flops:
                        row["tflops"] = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001 - one failing implementation skips a row
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                torch.cuda.empty_cache()
            rows.append(row)
            print(_fmt(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), dtype=a.dtype, rows=rows), f, indent=1
            )
    return 0


def _fmt(r):
    if "skipped" in r:
        return f"| {r['op']} | {r['shape']} | {r['impl']} | n/a: {r['skipped']} | | | | |"

    def f(key, spec, scale=1.0):
        v = r.get(key)
        return (
            "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v * scale, spec)
        )

    return (
        f"| {r['op']} | {r['shape']} | {r['impl']} | {f('ms', '.3f')} | {f('gbps', '.0f')} | "
        f"{f('hbm_share', '.0f', 100)} | {f('tflops', '.0f')} | {f('peak_mib', '.0f')} |"
    )


if __name__ == "__main__":
    sys.exit(main())
