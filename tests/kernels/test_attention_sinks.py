"""gpt-oss's attention sinks on the Triton kernels (kernels/attention_sinks.py), fp32 under the
interpreter, against the torch core `sink_attention` (attention_sinks_ref): the output and the
gradients of q, k, v and the sinks, causal, with GQA and MQA, a sliding window, packed documents
and rows that see no key; and the ring's composition (Triton key blocks merged, the sink added
once, each block's backward fed the final result) equals the whole softmax with its sink; a
gpt-oss layer (sinks, a window) on the Triton ops gives the torch ops' loss and gradients.
"""

import pytest
import torch
from megalite.kernels import TORCH_OPS, TRITON_OPS, _triton, select
from megalite.kernels.attention_blocks import (
    attention_block_bwd,
    attention_block_fwd,
    merge_attention,
)
from megalite.kernels.attention_sinks import (
    add_sink,
    attention_sinks,
    attention_sinks_ref,
    sink_grad,
)

from megalite.config import ModelConfig
from tests.kernels.helpers import check_op, cuda_dtypes, make
from tests.kernels.test_attention import _qkv
from tests.kernels.test_hf_families_kernels import _loss_and_grads

F32 = torch.float32


def _sinks(hq):
    return make((hq,), F32, scale=2.0)  # away from 0: the sinks take a real share


@pytest.mark.parametrize(
    "b,hq,hkv,s,d,window",
    [
        (2, 4, 2, 37, 16, None),  # GQA, the length not a multiple of a tile
        (1, 2, 1, 70, 32, 9),  # MQA, a sliding window, two query tiles
    ],
)
def test_causal_matches_torch(b, hq, hkv, s, d, window):
    torch.manual_seed(0)
    args = (*_qkv(b, hq, hkv, s, d, F32), _sinks(hq))

    def kernel(q, k, v, sinks):
        return attention_sinks(q, k, v, sinks, window=window)

    def ref(q, k, v, sinks):
        return attention_sinks_ref(q, k, v, sinks, window=window)

    check_op(kernel, ref, args)
    assert not _triton._warned  # the kernels ran: nothing fell back to torch


def test_documents_and_empty_rows_match_torch():
    torch.manual_seed(1)
    b, hq, hkv, s, d = 2, 4, 2, 29, 16
    args = (*_qkv(b, hq, hkv, s, d, F32), _sinks(hq))
    docs = torch.sort(torch.randint(0, 3, (b, s)), 1).values  # packed, per row
    q_pos, k_pos = torch.arange(s), torch.arange(s) + 4  # the first 4 queries see no key

    def kernel(q, k, v, sinks):
        return attention_sinks(q, k, v, sinks, q_pos, k_pos, docs, docs, window=6)

    def ref(q, k, v, sinks):
        return attention_sinks_ref(q, k, v, sinks, q_pos, k_pos, docs, docs, window=6)

    check_op(kernel, ref, args)
    out = kernel(*args)
    assert out[:, :, :4].abs().max() == 0  # the sink takes all of an empty row, with value 0


def test_namespaces_and_minus_inf_sinks():
    """Both op namespaces carry the op; sinks at -inf (and rows that see nothing) give plain
    masked attention, without NaN in the output or the gradients."""
    assert TORCH_OPS.attention_sinks is attention_sinks_ref
    assert TRITON_OPS.attention_sinks is attention_sinks
    q, k, v = _qkv(1, 2, 1, 20, 16, F32)
    sinks = torch.full((2,), float("-inf"), requires_grad=True)
    q_pos, k_pos = torch.arange(20), torch.arange(20) + 3
    out = attention_sinks(q, k, v, sinks, q_pos, k_pos)
    plain = TORCH_OPS.attention_masked(q, k, v, q_pos, k_pos)
    assert (out - plain).abs().max() <= 1e-6
    assert out.stride() == q.stride()  # q's layout, as attention's
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[3].abs().max() == 0  # a sink at -inf has no share


@pytest.mark.gpu
@cuda_dtypes()
@pytest.mark.parametrize("window", [None, 128])
def test_attention_sinks_gpu(dtype, window):
    torch.manual_seed(1)
    q, k, v = _qkv(2, 16, 4, 1023, 64, dtype, "cuda")
    sinks = make((16,), dtype, "cuda", scale=2.0)
    check_op(lambda q, k, v, s: attention_sinks(q, k, v, s, window=window),
             lambda q, k, v, s: attention_sinks_ref(q, k, v, s, window=window),
             (q, k, v, sinks))  # fmt: skip


def test_ring_composition_matches_whole_softmax():
    """Key blocks in any order (as a ring brings them), merged by lse, the sink added once:
    the output and, from each block's backward with the final (out, lse), every gradient."""
    torch.manual_seed(2)
    b, hq, hkv, s, d = 1, 4, 2, 24, 16
    q, k, v = (t.detach() for t in _qkv(b, hq, hkv, s, d, F32))
    sinks = _sinks(hq).detach()
    pos = torch.randperm(s)  # query i at position pos[i]; key j at position j
    blocks = pos.chunk(3)
    out = lse = None
    for kp in reversed(blocks):
        o, l_ = attention_block_fwd(q, k[:, :, kp], v[:, :, kp], pos, kp, window=10)
        out, lse = (o, l_) if out is None else merge_attention(out, lse, o, l_)
    out, lse = add_sink(out, lse, sinks)
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = attention_sinks_ref(*full[:3], full[3], pos, torch.arange(s), window=10)
    dout = torch.randn_like(want)
    want.backward(dout)
    assert (out - want).abs().max() <= 1e-5
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for kp in blocks:
        g_q, g_k, g_v = attention_block_bwd(q, k[:, :, kp], v[:, :, kp], out, lse, dout, pos,
                                            kp, window=10)  # fmt: skip
        dq += g_q
        dk[:, :, kp] += g_k
        dv[:, :, kp] += g_v
    got = (dq, dk, dv, sink_grad(out, lse, dout, sinks))
    for name, a, t in zip("q k v sinks".split(), got, full):
        assert (a - t.grad).abs().max() <= 1e-5 * max(1.0, t.grad.abs().max().item()), name


def test_gpt_oss_layer_matches_torch(recwarn):
    cfg = ModelConfig(flavour="gpt_oss", num_layers=1, hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, seq_length=24, vocab_size=250, sliding_window=7,
                      make_vocab_size_divisible_by=64)  # fmt: skip
    loss_t, grads_t = _loss_and_grads(cfg, TORCH_OPS)
    loss_k, grads_k = _loss_and_grads(cfg, select("triton", "cpu"))
    assert not [str(w.message) for w in recwarn]  # no fallback to the torch ops
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert "layers.0.attention.sinks" in grads_t
    for name, g in grads_t.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-4, atol=1e-6, msg=name)
