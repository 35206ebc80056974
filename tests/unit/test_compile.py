"""--compile: each transformer layer's math through torch.compile (inductor, C++ on CPU) gives
the steps of the eager run within fp32 round-off, keeps the logical names, compiles a dense
layer into one graph and never recompiles after the first step."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import single_process_groups
from megalite.pipeline.split_backward import input_grad
from megalite.shape import validate
from megalite.testing import random_batch, tiny_config
from megalite.training.build import build_rank
from megalite.training.compile import compile_chunks, is_compiled

TOL = 1e-5  # per step, fp32


def _train(cfg, steps, after_first=None):
    """Losses of `steps` optimizer steps of a one-process run of `cfg`, and its parameters."""
    parts = build_rank(cfg, validate(cfg, 1), single_process_groups())
    losses = []
    for step in range(steps):
        batch = random_batch(cfg, step)
        parts.opt.zero_grad(len(batch))
        losses.append(parts.run(batch).loss)
        parts.opt.step(1e-3)
        if step == 0 and after_first is not None:
            after_first()
    params = {n: p for c in parts.chunks for n, p in c.named_parameters()}
    return losses, params, parts.chunks


def _graphs():
    return counters["stats"]["unique_graphs"]


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "schedule,vpp,recompute",
    [("1f1b", 1, "none"), pytest.param("zb-h1", 1, "none", marks=SLOW),
     pytest.param("1f1b", 1, "full", marks=SLOW), pytest.param("interleaved", 2, "none", marks=SLOW),
     pytest.param("zbv", 2, "none", marks=SLOW), pytest.param("dualpipev", 2, "none", marks=SLOW)],
)  # fmt: skip
def test_compiled_steps_match_eager(schedule, vpp, recompute):
    """3 steps compiled against eager, for the executor's schedules: the zero-bubble split
    backward (I then W, the compiled layer's backward run twice), virtual stages (two chunks in
    one process) and full recomputation (the compiled function checkpointed)."""
    cfg = tiny_config()
    cfg.parallel.pp_schedule, cfg.parallel.vpp, cfg.training.recompute = schedule, vpp, recompute
    cfg.model.num_layers = 2 * vpp
    eager, want, _ = _train(cfg, 3)
    cfg.training.compile = True
    torch._dynamo.reset()  # compiled afresh, whatever earlier tests compiled
    counters.clear()
    seen = {}
    got, params, chunks = _train(cfg, 3, lambda: seen.update(graphs=_graphs()))
    assert all(is_compiled(layer) for c in chunks for layer in c.layers.values())
    assert params.keys() == want.keys()  # logical names, no `_orig_mod.`
    for step, (a, b) in enumerate(zip(got, eager)):
        assert abs(a - b) <= TOL, f"step {step}: compiled {a} eager {b}"
    for name, p in params.items():
        err = (p - want[name]).abs().max().item()
        assert err <= TOL, f"{name}: {err}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert seen["graphs"] >= 1 and _graphs() == seen["graphs"], "recompiled after step 1"


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_dense_layer_is_one_graph(flavour):
    """A dense layer (tp = cp = 1) traces whole: one graph, no break (LayerNorm and GELU, or
    RMSNorm, RoPE, grouped queries and SwiGLU)."""
    cfg = tiny_config()
    cfg.model.flavour, cfg.model.num_query_groups = flavour, 2
    model = validate(cfg, 1).model
    chunk = GPTChunk(model, has_embedding=False, has_head=False)
    x = torch.randn(2, cfg.model.seq_length, cfg.model.hidden_size)
    for layer in chunk.layers.values():
        report = torch._dynamo.explain(layer._forward)(x)
        assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons


def test_selective_recompute_breaks_at_the_core():
    """Selective recompute checkpoints the attention core eagerly (the sharded RNG's
    context_fn cannot be traced): the graph breaks there only, and the gradients agree."""
    cfg = tiny_config()
    torch.manual_seed(0)
    chunk = GPTChunk(
        cfg.model, LayerEnv(recompute="selective"), has_embedding=False, has_head=False
    )
    x = torch.randn(2, cfg.model.seq_length, cfg.model.hidden_size, requires_grad=True)
    report = torch._dynamo.explain(chunk.layers["0"]._forward)(x)
    # the break unwinds through the frames that call the core (layer, attention): one each
    assert report.graph_break_count >= 1
    assert all("_recomputed_core" in r.reason for r in report.break_reasons), report.break_reasons
    g = torch.randn_like(x)
    chunk(x).backward(g)
    want = [p.grad.clone() for p in chunk.parameters()] + [x.grad.clone()]
    chunk.zero_grad()
    x.grad = None
    compile_chunks([chunk])
    chunk(x).backward(g)
    for a, b in zip([p.grad for p in chunk.parameters()] + [x.grad], want):
        assert (a - b).abs().max().item() <= TOL


def test_split_backward_through_compiled_layers():
    """The zero-bubble I/W split (split_backward.input_grad) on compiled layers: I gives the
    input's gradient alone, W then the parameters' (the compiled backward run a second time on
    the saved activations, which inductor must not have overwritten in I)."""
    cfg = tiny_config()
    torch.manual_seed(0)
    chunk = GPTChunk(cfg.model, has_embedding=False, has_head=False)
    x = torch.randn(2, cfg.model.seq_length, cfg.model.hidden_size, requires_grad=True)
    g = torch.randn_like(x)
    chunk(x).backward(g)
    want = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    want_x = x.grad.clone()
    chunk.zero_grad()
    x.grad = None
    torch._dynamo.reset()
    compile_chunks([chunk])
    for _ in range(2):  # compiling, then compiled
        chunk.zero_grad()
        x.grad = None
        weights = input_grad(chunk(x), g, x, list(chunk.parameters()))
        assert (x.grad - want_x).abs().max().item() <= TOL
        assert all(p.grad is None for p in chunk.parameters())
        weights()
        for n, p in chunk.named_parameters():
            assert (p.grad - want[n]).abs().max().item() <= TOL, n
