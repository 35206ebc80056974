"""Fused kernels (installed as megalite.kernels), each beside its plain-torch reference.

`select(mode, device)` returns the ops the model calls: the Triton kernels when mode is
"triton" (or "auto" on CUDA), the torch references otherwise. A Triton op handed inputs it does
not support (a head dim, a dtype, bf16 under the CPU interpreter) warns once and runs its
reference instead, so choosing "triton" never turns a working model into a failing one.

The namespace is the model's seam for new implementations: every layer of a chunk calls the ops
it was built with (`GPTChunk(ops=...)`), so `override(ops, linear=fp8_linear)` or
`override(ops, attention=my_attention)` plugs one in everywhere at once (docs/extending.md).
- `linear(x, w, b=None)`: x (..., in) @ w (out, in)^T (+ b), every matmul with a weight
  (tensor-parallel linears, the fused q/k/v and gate/up, the output layer, the MoE router).
- `attention(q, k, v, dropout_p=0.0)`: causal attention of q (b, hq, s, d) over k, v
  (b, hkv, s, d), hq a multiple of hkv, scale 1/sqrt(d) -> (b, hq, s, d): the core of training
  and whole-sequence inference (`Attention._core`). A model with `--sliding-window W` also
  passes `window=W` (to the masked and block ops too); others never do. Packed documents and context parallelism
  use `attention_masked` and the `attention_block_*` ops; a KV cache `attention_masked`.
- `attention_sinks(q, k, v, sinks, q_pos=None, k_pos=None, q_doc=None, k_doc=None,
  dropout_p=0.0, window=None)`: gpt-oss's attention with a learned sink logit per query head
  (sinks (hq,)), causal or by positions as `attention_masked`; context parallelism adds the
  sink to the block ops' merged result (kernels/attention_sinks.py `add_sink`, `sink_grad`).
- `fp8_linear`: a maker `(shards, reduce_max) -> linear or None` (kernels/fp8_linear.py `Fp8Maker`;
  default `NO_FP8`, which makes none): the linears that may run in FP8 (the attention and MLP
  projections) each build their own `linear` from it with the groups that shard their dims;
  the output layer and the MoE router keep `linear`.
- `fp8_casts`: how an FP8 linear takes amaxes and casts (kernels/fp8.py `TorchCasts`; the fused
  kernels of kernels/fp8_cast.py in TRITON_OPS), handed to the `Fp8Maker` by training/build.py.
"""

if __name__ == "kernels":  # the repository root is on sys.path (python -c, a REPL, a notebook)
    # This folder is megalite.kernels; as the top-level `kernels` it would hide the PyPI
    # package of that name (which transformers imports). Hand the import over to the installed
    # one; without one, be what a folder without __init__.py is: an empty namespace package
    # (no __file__, nothing to import from it), which transformers reads as "not installed".
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _installed(name: str) -> bool:
        here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return False
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # what the import statement returns
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return True

    if not _installed(__name__):
        __file__, __path__ = None, []
else:
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F
    from megalite.kernels._triton import INTERPRET, TRITON_ERROR, warn_once
    from megalite.kernels.activations import gelu, gelu_ref, swiglu, swiglu_ref
    from megalite.kernels.attention import (
        attention,
        attention_masked,
        attention_masked_ref,
        attention_ref,
    )
    from megalite.kernels.attention_blocks import (
        attention_block_bwd,
        attention_block_bwd_ref,
        attention_block_fwd,
        attention_block_fwd_ref,
        merge_attention,
    )
    from megalite.kernels.attention_sinks import attention_sinks, attention_sinks_ref
    from megalite.kernels.cross_entropy import (
        cross_entropy,
        cross_entropy_ref,
        cross_entropy_shard_grad,
        cross_entropy_shard_grad_ref,
        cross_entropy_shard_stats,
        cross_entropy_shard_stats_ref,
    )
    from megalite.kernels.fp8 import TORCH_CASTS
    from megalite.kernels.fp8_cast import TRITON_CASTS
    from megalite.kernels.fp8_linear import NO_FP8
    from megalite.kernels.grouped_gemm import grouped_mm, grouped_mm_ref
    from megalite.kernels.layer_norm import layer_norm, layer_norm_ref
    from megalite.kernels.rms_norm import rms_norm, rms_norm_ref
    from megalite.kernels.rotary import rotary, rotary_ref

    TORCH_OPS = SimpleNamespace(
        linear=F.linear,
        rms_norm=rms_norm_ref,
        layer_norm=layer_norm_ref,
        rotary=rotary_ref,
        swiglu=swiglu_ref,
        gelu=gelu_ref,
        cross_entropy=cross_entropy_ref,
        ce_shard_stats=cross_entropy_shard_stats_ref,
        ce_shard_grad=cross_entropy_shard_grad_ref,
        attention=attention_ref,
        attention_masked=attention_masked_ref,
        attention_sinks=attention_sinks_ref,
        attention_block_fwd=attention_block_fwd_ref,
        attention_block_bwd=attention_block_bwd_ref,
        merge_attention=merge_attention,
        grouped_mm=grouped_mm_ref,
        fp8_linear=NO_FP8,
        fp8_casts=TORCH_CASTS,
    )

    TRITON_OPS = SimpleNamespace(
        linear=F.linear,  # cuBLAS: no Triton matmul of our own
        rms_norm=rms_norm,
        layer_norm=layer_norm,
        rotary=rotary,
        swiglu=swiglu,
        gelu=gelu,
        cross_entropy=cross_entropy,
        ce_shard_stats=cross_entropy_shard_stats,
        ce_shard_grad=cross_entropy_shard_grad,
        attention=attention,
        attention_masked=attention_masked,
        attention_sinks=attention_sinks,
        attention_block_fwd=attention_block_fwd,
        attention_block_bwd=attention_block_bwd,
        merge_attention=merge_attention,
        grouped_mm=grouped_mm,
        fp8_linear=NO_FP8,
        fp8_casts=TRITON_CASTS,
    )

    __all__ = [
        "TORCH_OPS",
        "TRITON_OPS",
        "attention_block_bwd",
        "attention_block_bwd_ref",
        "attention_block_fwd",
        "attention_block_fwd_ref",
        "attention_masked",
        "attention_masked_ref",
        "merge_attention",
        "cross_entropy_shard_grad",
        "cross_entropy_shard_stats",
        "grouped_mm",
        "grouped_mm_ref",
        "override",
        "select",
    ]

    def select(mode: str, device: torch.device | str) -> SimpleNamespace:
        """mode "torch" | "triton" | "auto" (Triton on CUDA, torch elsewhere) -> namespace of ops."""
        if mode not in ("torch", "triton", "auto"):
            raise ValueError(f"kernels={mode!r}: choose one of torch, triton, auto")
        device = torch.device(device)
        if mode == "torch" or (mode == "auto" and device.type != "cuda"):
            return TORCH_OPS
        if TRITON_ERROR is not None:
            warn_once("select", f"triton is unavailable ({TRITON_ERROR})")
            return TORCH_OPS
        if device.type == "cpu" and not INTERPRET:
            warn_once(
                "select", "Triton on CPU needs TRITON_INTERPRET=1 set before importing triton"
            )
            return TORCH_OPS
        return TRITON_OPS

    def override(ops: SimpleNamespace, **impls) -> SimpleNamespace:
        """`ops` with some implementations replaced (same signatures: see the module docstring);
        `ops` itself is unchanged. A name the model does not call is refused, not ignored."""
        unknown = sorted(set(impls) - set(vars(ops)))
        if unknown:
            raise ValueError(
                f"override: no op named {', '.join(unknown)}; ops are {sorted(vars(ops))}"
            )
        return SimpleNamespace(**{**vars(ops), **impls})
