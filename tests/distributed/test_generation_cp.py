"""Generation with context parallelism (megalite.generation.CPKVCache) at cp2 and cp2*tp2.

Random transformers Mistral (a window of 8, shorter than the prompts) and Llama 3 (llama3 rope
scaling) models, converted to megalite and loaded in fp64 in one spawn of four gloo ranks, give
transformers' greedy tokens and the one-process sampled ones. The prompts differ in length, so
the left padding (widened to 16 slots, four chunks of 4) ends inside another rank's chunk; each
rank must feed its 8 slots of the prompt once, then every new token.
"""

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.generation import generate
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from megalite.testing import spawn
from tests.distributed.test_generation import NEW, _chunks, _one_process, _run

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

# 13, 6 and 10 tokens: padded to 16, row 1's ten padding slots span chunks 0, 1 and part of 2
PROMPTS = [list(range(20, 33)), [7, 3, 9, 4, 8, 2], [40, 41, 5, 44, 6, 46, 47, 9, 49, 50]]
LAYOUTS = [dict(cp=2, dp=2), dict(tp=2, cp=2)]


def _layouts(rank, world, paths):
    out = {}
    for sizes in LAYOUTS:
        groups = build_groups(Topology(**sizes), torch.device("cpu"))
        for path in paths:
            cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
            chunks = _chunks(cfg, groups, 1, 1, sp=groups.tp.size > 1)
            load_model(chunks, groups.tp, fmt.Checkpoint(path))
            out[(str(sizes), path)] = _run(chunks, groups, PROMPTS)
    return out


def test_mistral_and_llama3_generate_at_cp2_and_cp2_tp2_what_transformers_does(tmp_path):
    from tests.unit.test_checkpoint_hf import convert, hf_greedy
    from tests.unit.test_hf_families import hf_family

    models, paths = [], []
    for name in ("mistral", "llama3"):
        m = hf_family(name, seed=5)
        m.save_pretrained(tmp_path / name, safe_serialization=True)
        convert.main([str(tmp_path / name), str(tmp_path / f"{name}-ml"), "--to", "megalite"])
        models.append(m.double())
        paths.append(str(tmp_path / f"{name}-ml"))
    results = spawn(_layouts, 4, paths)
    for m, path in zip(models, paths):
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path, PROMPTS)
        assert greedy == [hf_greedy(m, p, NEW) for p in PROMPTS], path
        for sizes in LAYOUTS:
            for rank in range(4):
                g, s, fed = results[rank][(str(sizes), path)]
                assert (g, s) == (greedy, sampled), (sizes, path, rank)
                assert fed == [[8] + [1] * (NEW - 1)], (sizes, path, rank)


def test_latent_attention_at_cp_is_refused_in_one_line():
    from megalite.config import ModelConfig

    cfg = ModelConfig(flavour="deepseek_v3", num_layers=1, hidden_size=32, num_attention_heads=4,
                      seq_length=16, vocab_size=64)  # fmt: skip

    class Groups:  # a cp axis of two, without starting torch.distributed
        from megalite.parallel.comm import Group

        tp = pp = Group("tp", [0], 0)
        cp = Group("cp", [0, 1], 0)
        device = torch.device("cpu")

    with pytest.raises(MegaliteError, match="latent attention"):
        generate([GPTChunk(cfg)], Groups, [[1, 2]], 2)
