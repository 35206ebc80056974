"""Multi-head latent attention sharded, against one process (fp64), and DeepSeek-V3 generation.

- Layers: logits, loss and every gradient of tp2 chunks (with and without sequence parallelism)
  equal one process's within 1e-10: q_b/kv_b split by heads, out row-parallel, the
  a-projections and their norms whole on every rank (their gradient summed over TP); low-rank q
  with yarn's mscale and a full-rank q with v wider than q/k.
- Context parallelism: MLA (v padded to the q/k head dim) at cp2 (ring and all-to-all, with and
  without packed documents) and cp2*tp2 gives one process's loss and gradients.
- Generation: random transformers DeepSeek-V3 models (dense, and with its MoE) converted to
  megalite and loaded at tp2*pp2 give transformers' greedy tokens and the one-process sampled
  ones (latent KV cache); the MoE one also at tp2*pp2*ep2 (test_hf_families._generate).
"""

import pytest

from megalite.checkpoint import format as fmt
from megalite.config_read import from_dict
from megalite.testing import spawn
from tests.distributed import test_context_parallel, test_hf_families
from tests.distributed.test_generation import NEW, PROMPTS, _one_process

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

MLA = dict(flavour="deepseek_v3", kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4)
CASES = [
    dict(MLA, q_lora_rank=12, v_head_dim=8, rope_scaling="yarn", rope_scaling_factor=2.0,
         rope_original_max_position_embeddings=4, yarn_mscale=1.0, yarn_mscale_all_dim=0.7),
    dict(MLA, v_head_dim=12),  # full-rank q; v wider than q/k (10): q and k padded
]  # fmt: skip


def _layers(rank, world):
    test_hf_families.CASES = CASES  # this spawned process's copy only
    return test_hf_families._layers(rank, world)


def test_tp2_layers_match_one_process():
    assert all(spawn(_layers, 2))


def _cp(rank, world, tp, comm_type):
    test_context_parallel.MODEL_CASES = CASES[:1]
    return test_context_parallel._cp_model(rank, world, tp, comm_type)


@pytest.mark.parametrize("tp,world,comm_type", [(1, 2, "a2a"), (2, 4, "p2p")])
def test_latent_attention_with_context_parallelism_matches_one_process(tp, world, comm_type):
    for rank_out in spawn(_cp, world, tp, comm_type):
        for _, documents, _, errs in rank_out:
            bad = {k: v for k, v in errs.items() if v > 1e-10}
            assert not bad, (comm_type, documents, bad)


def test_deepseek_v3_generates_at_tp2_pp2_what_transformers_does(tmp_path):
    """Dense, and with DeepSeek-V3's MoE from layer 1 on (experts whole on each rank, then split
    over ep2): one spawn for both."""
    from tests.unit.test_checkpoint_hf import convert, hf_greedy
    from tests.unit.test_mla import hf_deepseek

    models, paths = [], []
    for name in ("q-lora-yarn", "moe"):
        m = hf_deepseek(name, seed=5)
        m.save_pretrained(tmp_path / name, safe_serialization=True)
        convert.main([str(tmp_path / name), str(tmp_path / f"{name}-ml"), "--to", "megalite"])
        models.append(m if name == "moe" else m.double())  # grouped_mm: no fp64
        paths.append(str(tmp_path / f"{name}-ml"))
    results = spawn(test_hf_families._generate, 4, paths)
    for m, path in zip(models, paths):
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path)
        assert greedy == [hf_greedy(m, p, NEW) for p in PROMPTS], path
        for rank in range(4):
            g, s, _ = results[rank][path]
            assert (g, s) == (greedy, sampled), (path, rank)
        if cfg.num_experts:
            test_hf_families._check_ep2(results, path, cfg, greedy, sampled)
