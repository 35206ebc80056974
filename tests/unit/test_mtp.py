"""Multi-token prediction (model/mtp.py), in one process (fp64).

- The loss is the model's plus the scaling factor times the mean of the modules' losses, module
  k predicting token t+1+k from [enorm(emb(t+k)); hnorm(h^{k-1})] (written out by hand here).
- Pipeline layouts: the model cut into a first chunk (embedding, layer 0) and a head chunk
  (layer 1, head, MTP modules and a tied copy of the embedding) gives one chunk's loss, and its
  gradients, the two embedding halves summed as the `embed` group sums them; with tied
  embeddings the head chunk's output layer is the MTP embedding.
- validate() refuses what MTP does not run with.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.shape import validate

CFG = ModelConfig(flavour="deepseek_v3", num_layers=2, hidden_size=32, num_attention_heads=4,
                  q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                  v_head_dim=8, vocab_size=100, make_vocab_size_divisible_by=8, seq_length=8,
                  mtp_num_layers=2, mtp_loss_scaling_factor=0.3)  # fmt: skip
IDS = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(0))
TOKENS, LABELS = IDS[:, :-1], IDS[:, 1:]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_the_loss_adds_the_scaled_mean_of_each_depths_prediction():
    chunk = GPTChunk(CFG, LayerEnv(seed=3, dtype=torch.float64))
    eps, V = CFG.norm_epsilon, CFG.vocab_size
    with torch.no_grad():
        h = chunk.embed(TOKENS)
        for layer in chunk.layers.values():
            h = layer(h)
        head = chunk.output.weight[:V]
        main = F.cross_entropy((_rms(h, chunk.final_norm.weight, eps) @ head.T).flatten(0, 1),
                               LABELS.flatten())  # fmt: skip
        s, losses = LABELS.shape[1], []
        for k, m in enumerate(chunk.mtp.values(), 1):  # token t+k in, t+1+k the target
            emb = chunk.embedding.word.weight[IDS[:, k : k + s - k]]  # (b, s - k, h)
            x = torch.cat([_rms(emb, m.enorm.weight, eps), _rms(h[:, : s - k], m.hnorm.weight,
                                                                 eps)], -1)  # fmt: skip
            h = m.layer(x @ m.eh_proj.weight.T)  # causal: the first s - k positions alone
            logits = _rms(h, m.final_norm.weight, eps) @ head.T
            losses.append(F.cross_entropy(logits.flatten(0, 1), IDS[:, k + 1 :].flatten()))
            h = F.pad(h, (0, 0, 0, k))  # back to s positions for the next depth (those unused)
        expected = main + 0.3 * sum(losses) / 2
        assert abs(chunk(TOKENS, LABELS).item() - expected.item()) <= 1e-12
        off = GPTChunk(
            dataclasses.replace(CFG, mtp_num_layers=0), LayerEnv(seed=3, dtype=torch.float64)
        )
        assert abs(off(TOKENS, LABELS).item() - main.item()) <= 1e-12
        assert abs(expected.item() - main.item()) > 1e-3  # the modules' losses count


@pytest.mark.parametrize("tied", [False, True])
def test_a_pipeline_cut_gives_one_chunks_loss_and_gradients(tied):
    cfg = dataclasses.replace(CFG, untie_embeddings_and_output_weights=not tied)
    whole = GPTChunk(cfg, LayerEnv(seed=3, dtype=torch.float64))
    first = GPTChunk(cfg, LayerEnv(seed=3, dtype=torch.float64), layers=[0], has_head=False)
    last = GPTChunk(cfg, LayerEnv(seed=3, dtype=torch.float64), layers=[1], has_embedding=False)
    expected = whole(TOKENS, LABELS)
    expected.backward()
    loss = last(first(TOKENS), LABELS)
    assert abs(loss.item() - expected.item()) <= 1e-12
    loss.backward()
    grads = {n: p.grad for c in (first, last) for n, p in c.named_parameters()}
    embed = "output.weight" if tied else "mtp_embedding.weight"
    assert (last.mtp_embedding.weight is last.output.weight) == tied
    assert "embed" in first.embedding.word.weight._spec.grad_sum
    summed = grads.pop("embedding.word.weight") + grads.pop(embed)  # the `embed` group's sum
    assert (summed - whole.embedding.word.weight.grad).abs().max() <= 1e-12
    for name, p in whole.named_parameters():
        if name != "embedding.word.weight":
            assert (grads[name] - p.grad).abs().max() <= 1e-12, name


def test_validate_refuses_what_mtp_does_not_run_with():
    def refused(match, world=1, **change):
        cfg = Config()
        cfg.model = dataclasses.replace(CFG, **change.pop("model", {}))
        for section, fields in change.items():
            for k, v in fields.items():
                setattr(getattr(cfg, section), k, v)
        with pytest.raises(MegaliteError, match=match):
            validate(cfg, world)

    refused("does not run with --cp", world=2, parallel={"cp": 2})
    refused("needs rotary positions", model={"flavour": "gpt2", "num_query_groups": None})
    refused("packed documents", data={"reset_attention_mask": True})
    refused(r"must be in \[0, seq_length=8\)", model={"mtp_num_layers": 8})
    refused("--kv-channels does not apply", model={"kv_channels": 16})
    refused("--num-query-groups=2 does not apply", model={"num_query_groups": 2})


@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, True)])
def test_the_planner_lists_the_mtp_parameters_in_the_models_order(tp, sequence_parallel):
    """plan/memory.py expands one meta-device layer per kind: the MTP modules and the head
    stage's embedding copy come after the head, as GPTChunk registers them."""
    from megalite.parallel.comm import Group
    from megalite.parallel.specs import spec_of
    from megalite.pipeline.partition import rank_chunks
    from megalite.plan import memory

    m = dataclasses.replace(CFG, num_layers=4)
    group = Group("tp", list(range(tp)), tp - 1)
    for kw in rank_chunks(4, 2, 1, 0) + rank_chunks(4, 2, 1, 1):
        chunk = GPTChunk(m, LayerEnv(tp=group, sequence_parallel=sequence_parallel), **kw)
        real = [(n, p.numel(), "tp" in spec_of(p).grad_sum)
                for n, p in chunk.named_parameters()]  # fmt: skip
        assert memory.chunk_params(m, tp, **kw, sequence_parallel=sequence_parallel) == real


@pytest.mark.parametrize("mtp", [0, 1])
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_the_planners_activations_count_latent_attention_and_mtp(mtp, q_lora_rank):
    """plan/activations.py's estimate against the bytes autograd saves (its contract: within
    20%), a first chunk with the head (and the MTP module) and a middle one, fp32 on CPU."""
    from megalite.plan import activations
    from megalite.plan.layouts import layout
    from tests.unit.plan_configs import tiny
    from tests.unit.test_plan_activations import saved_bytes

    cfg = tiny("deepseek_v3", q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, mtp_num_layers=mtp)  # fmt: skip
    b, s, h = 2, 64, 64
    for kw in ({"layers": range(2), "has_embedding": True, "has_head": True},
               {"layers": range(2), "has_embedding": False, "has_head": False}):  # fmt: skip
        chunk = GPTChunk(cfg.model, **kw)
        x = torch.randint(500, (b, s)) if kw["has_embedding"] else torch.randn(b, s, h)
        measured = saved_bytes(chunk, x.requires_grad_(x.is_floating_point()),
                               torch.randint(500, (b, s)))  # fmt: skip
        estimate, _ = activations.chunk_activations(cfg, layout(cfg), kw)
        assert abs(estimate / measured - 1) < 0.1, (kw, estimate, measured)
