"""Compiled transformer blocks (`--compile`): each layer's math through `torch.compile`, one
layer at a time, as torchtitan does (not the whole model).

What is compiled is `TransformerLayer._forward`, the layer's arithmetic from its input to its
output, and not the module's `__call__`. Everything that decides *around* a layer stays eager:

- its hooks (ZeRO-3's gather before the forward and its free after it, the pre-backward regather)
  run outside the compiled region: they resize storage and wait on asynchronous collectives,
  which a graph cannot hold;
- full recomputation (`checkpoint(self._forward, ...)` in the layer) checkpoints the compiled
  function, so the recompute replays the same compiled graph;
- parameter names do not change (`torch.compile(module)` would wrap the layer in an
  `OptimizedModule` whose names gain `_orig_mod.`): checkpoints, ZeRO units and the optimizer see
  the same logical names with or without `--compile`.

Every layer of a chunk has the same code and structure, so the layers share one graph (dynamo
lifts parameters to graph inputs): no recompilation per layer, none after the first step.

Graph breaks. megalite's collectives (`megalite.parallel.comm`) are autograd functions that
count bytes in the ledger and time themselves on the host: they stay eager, and dynamo breaks the
graph at each (`torch.compiler.disable` on their `apply` there). With tp = 1 and cp = 1 a dense
layer is one graph; with tensor or context parallelism it is the pieces between collectives.
Selective recompute keeps the attention core's checkpoint eager (a break there); MoE layers
break where the dispatch reads the routing counts on the host (the all-to-all sizes). The
zero-bubble split backward runs a compiled layer's backward whole in I and again in W (one
autograd node cannot be cut). docs/compile.md says more.
"""

import torch

# The zero-bubble split backward runs a compiled layer's backward twice (I with the graph kept,
# then W), which inductor's defaults do not expect. In-place reuse of the backward's input
# buffers (saved activations among them) is off as a precaution: one run during development
# gave W gradients 10% off with it on, which fresh caches did not reproduce (a cached graph
# compiled with donated buffers is the likely cause; tests/unit/test_compile.py checks W).
INDUCTOR_OPTIONS = {"inplace_buffers": False}


def compile_layer(layer: torch.nn.Module, **kw) -> None:
    """Compile `layer`'s math (`layer._forward`) in place; `kw` go to `torch.compile`
    (default inductor options: INDUCTOR_OPTIONS). The module, its parameters, names and hooks
    are untouched."""
    if kw.get("backend", "inductor") == "inductor":
        kw["options"] = {**INDUCTOR_OPTIONS, **kw.get("options", {})}
    # The same for AOT autograd's donated buffers (saved tensors freed into the one backward,
    # which refuses a second): a process-wide setting, read when a graph is compiled. (Imported
    # here: nothing else has imported torch._dynamo, which loads it, before the first compile.)
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    layer._forward = torch.compile(layer._forward, **kw)


def compile_chunks(chunks, **kw) -> int:
    """Compile every transformer layer of every chunk (`compile_layer`); returns how many."""
    n = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            compile_layer(layer, **kw)
            n += 1
    return n


def is_compiled(layer: torch.nn.Module) -> bool:
    """`layer`'s math runs compiled (`compile_layer` was applied)."""
    return "_forward" in vars(layer)
