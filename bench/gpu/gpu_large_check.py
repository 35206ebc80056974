"""What only a GPU can show: kernels in bf16 at production sizes, and memory against the planner.

    python bench/gpu/gpu_large_check.py kernels [--smoke] [--out DIR]
    python bench/gpu/gpu_large_check.py memory --metrics FILE [--smoke] [pretrain flags...]

Run by bench/gpu_check.sh on a lent GPU; `--smoke` runs the same code at tiny sizes on CPU
(tests/unit/test_gpu_check.py), where the Triton ops fall back to their references, so only
the code path is checked there, not a kernel.

kernels: each Triton op against its plain-torch reference on the same bf16 inputs, forward and
backward, at sizes the unit tests do not reach: the cross-entropy at 20,480 tokens x 128,256
(Llama-3's vocabulary at tp=1: past 2^31 elements, where an int32 offset overflows), flash
attention at 8K tokens (GQA, head dim 128), RMSNorm at 32K rows x 8192. The reference runs in
fp32 and in row slices, so it fits beside the kernel's bf16 tensors on a 40 GB GPU. Each
check passes when the kernel's largest error (relative to the reference's largest magnitude,
at least 1) is within `TOLERANCE` of the fp32 reference. The tolerances are bf16's rounding
with room; they have not met a GPU yet: a failure prints the errors, to judge by.

memory: a run's measured peak (the trainer's `peak_memory_bytes`, torch.cuda's
max_memory_allocated, in its metrics file) and its state bytes against the planner's estimate
for the same flags (plan/layouts.plan: params, grads, optimizer, activations): the states
within 1%, the peak within 10% (the design's bound); the breakdown is printed either way.

Results: printed, and written as JSON to --out (kernels_large.json, memory.json).
"""

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import timed  # noqa: E402

# largest |kernel - fp32 reference| allowed, by what is compared (bf16 outputs round to ~2^-8)
TOLERANCE = {"loss": 2e-3, "grad": 1.6e-2, "out": 3e-2}
STATE_TOL, PEAK_TOL = 0.01, 0.10


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error over the reference's largest magnitude (at least 1)."""
    return _max_err(a, ref) / max(1.0, ref.abs().max().item())


def check_cross_entropy(rows: int, vocab: int, device, slice_rows: int = 2048) -> dict:
    from megalite.kernels import cross_entropy

    gen = torch.Generator(device).manual_seed(0)
    logits = (4 * torch.randn(rows, vocab, generator=gen, device=device)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    logits.requires_grad_(True)
    loss = cross_entropy(logits, labels)
    loss.sum().backward()
    err = {"loss": 0.0, "grad": 0.0}
    for lo in range(0, rows, slice_rows):  # the fp32 reference, a slice of rows at a time
        x = logits.detach()[lo : lo + slice_rows].float().requires_grad_(True)
        ref = torch.nn.functional.cross_entropy(x, labels[lo : lo + slice_rows], reduction="none")
        ref.sum().backward()
        err["loss"] = max(err["loss"], _max_err(loss[lo : lo + slice_rows], ref))
        err["grad"] = max(err["grad"], _max_err(logits.grad[lo : lo + slice_rows], x.grad))
        del x, ref
    return {"shape": [rows, vocab], "elements": rows * vocab, "err": err}


def check_attention(b: int, hq: int, hkv: int, s: int, d: int, device) -> dict:
    from megalite.kernels import attention, attention_ref

    gen = torch.Generator(device).manual_seed(1)
    q, k, v = (
        torch.randn(b, h, s, d, generator=gen, device=device).to(torch.bfloat16)
        for h in (hq, hkv, hkv)
    )
    g = torch.randn(b, hq, s, d, generator=gen, device=device).to(torch.bfloat16)
    outs = []
    for op, dtype in ((attention, torch.bfloat16), (attention_ref, torch.float32)):
        args = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = op(*args)
        out.backward(g.to(dtype))
        outs.append((out.detach(), [a.grad for a in args]))
        del out, args
    (o, grads), (o_ref, grads_ref) = outs
    err = {"out": _rel_err(o, o_ref)}
    err["grad"] = max(_rel_err(a, r) for a, r in zip(grads, grads_ref))
    return {"shape": [b, hq, hkv, s, d], "err": err}


def check_rms_norm(rows: int, h: int, device) -> dict:
    from megalite.kernels import rms_norm, rms_norm_ref

    gen = torch.Generator(device).manual_seed(2)
    x = torch.randn(rows, h, generator=gen, device=device).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(h, generator=gen, device=device)).to(torch.bfloat16)
    g = torch.randn(rows, h, generator=gen, device=device).to(torch.bfloat16)
    outs = []
    for op, dtype in ((rms_norm, torch.bfloat16), (rms_norm_ref, torch.float32)):
        a, b = (t.detach().to(dtype).requires_grad_(True) for t in (x, w))
        out = op(a, b, 1e-5)
        out.backward(g.to(dtype))
        outs.append((out.detach(), a.grad, b.grad / rows))  # the weight's grad: a sum over rows
    (o, gx, gw), (o_r, gx_r, gw_r) = outs
    return {"shape": [rows, h],
            "err": {"out": _rel_err(o, o_r), "grad": max(_rel_err(gx, gx_r), _rel_err(gw, gw_r))}}  # fmt: skip


def within(err: dict) -> bool:
    return all(v <= TOLERANCE[k] for k, v in err.items())


def kernels(a) -> dict:
    device = torch.device(a.device)
    big = not a.smoke
    checks = {
        "cross_entropy": lambda: check_cross_entropy(
            20480 if big else 64, 128256 if big else 1000, device
        ),  # fmt: skip
        "attention": lambda: check_attention(
            1, 16, 4, 8192 if big else 64, 128 if big else 64, device
        ),  # fmt: skip
        "rms_norm": lambda: check_rms_norm(32768 if big else 64, 8192 if big else 256, device),
    }
    out, ok = {}, True
    for name, run in checks.items():
        with timed() as t:
            try:
                r = run()
                r["ok"] = within(r["err"])
            except Exception as e:  # a crash (an overflowed offset: an illegal address): a failure
                r = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        r["seconds"] = round(t.wall, 2)
        ok &= r["ok"]
        out[name] = r
        print(f"{name}: {'ok' if r['ok'] else 'FAILED'} {json.dumps(r)}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"ok": ok, "device": str(device), "checks": out}


def memory_verdict(planned: dict, measured: dict) -> dict:
    """planned: the planner's bytes (params, grads, optimizer, total); measured: the trainer's
    metrics (param_bytes, grad_bytes, optimizer_state_bytes, peak_memory_bytes)."""
    pairs = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_state_bytes",
             "total": "peak_memory_bytes"}  # fmt: skip
    rows = {}
    for k, m in pairs.items():
        p, got = planned.get(k), measured.get(m)
        if p is None or got is None:
            rows[k] = {"planned": p, "measured": got, "ok": False}
            continue
        ratio = got / p if p else float("inf")
        rows[k] = {"planned": p, "measured": got, "ratio": round(ratio, 4),
                   "ok": abs(ratio - 1) <= (PEAK_TOL if k == "total" else STATE_TOL)}  # fmt: skip
    return {"ok": all(r["ok"] for r in rows.values()), "rows": rows}


def memory(a, flags) -> dict:
    from megalite.config_read import parse_args
    from megalite.plan.layouts import plan
    from megalite.shape import validate

    cfg = parse_args(flags)
    # the built-in tokenizer's vocabulary is known before it is trained (as --dry-run does)
    vocab = cfg.model.vocab_size or cfg.data.tokenizer_vocab_size
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    p = plan(cfg, validate(cfg, 1))
    rows = [json.loads(line) for line in open(a.metrics) if line.strip()]
    rows = [r for r in rows if "peak_memory_bytes" in r]
    if not rows:
        return {"ok": False, "error": f"{a.metrics}: no logged step with peak_memory_bytes"}
    measured = {**rows[-1], "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows)}
    res = memory_verdict(p.memory, measured)
    for k, r in res["rows"].items():
        print(f"  {k:10s} planned {r['planned']!s:>14} measured {r['measured']!s:>14} "
              f"{r.get('ratio', '')} {'ok' if r['ok'] else 'OFF'}")  # fmt: skip
    if a.smoke:  # on CPU the peak is the process's RSS: the code ran, nothing to judge
        res["judged"], res["ok"] = False, True
    return res


def main(argv=None):
    # no abbreviations: the pretrain flags after ours must not match ours by prefix
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("what", choices=("kernels", "memory"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: the code path only)")
    ap.add_argument("--metrics", help="memory: the run's metrics file (JSON lines)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a, flags = ap.parse_known_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.what == "kernels":
        res, name = kernels(a), "kernels_large"
    else:
        if not a.metrics:
            ap.error("memory needs --metrics FILE")
        res, name = memory(a, flags), "memory"
    path = os.path.join(a.out, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"{name}: {'ok' if res['ok'] else 'FAILED'} ({path})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
